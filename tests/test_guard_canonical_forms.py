"""The byte rule's form of a value (docs/semantics.md) never depends on where in it orjson meets
what it cannot write by itself: a key that is a string of a subclass, a tuple or a float of a
subclass, a dataclass or a model. And the form of every value that had one stays byte for byte."""

from __future__ import annotations

import collections
import dataclasses
import enum
import hashlib
import math
import uuid
from datetime import UTC, date, datetime, timedelta, timezone
from typing import Any, NamedTuple

import orjson
import pydantic
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from guard import Airlock, AirlockContext, SecurityPolicy, is_refusal
from guard.canonical import _OPTIONS, NotCanonical, _default, _str_keys, canonical_bytes, canonical_json
from guard.effect_guard import EffectGuard, idempotency_key


class Currency(enum.StrEnum):
    EUR = "EUR"
    USD = "USD"


class Level(enum.IntEnum):
    LOW = 1
    HIGH = 2


class Colour(enum.Enum):
    RED = "red"
    PAIR = (1, 2)
    RATE = 1.5


class Perm(enum.IntFlag):
    R = 4
    W = 2


class Label(str):
    pass


class Count(int):
    pass


class Attrs(dict):  # a dict of a subclass with its own attribute
    note = "ignored"


class Names(list):
    pass


@dataclasses.dataclass
class AB:
    b: int
    a: int


@dataclasses.dataclass(frozen=True, slots=True)
class Money:
    currency: Currency
    cents: int


@dataclasses.dataclass
class Order:
    lines: list[Money]
    shipping: tuple[Any, ...]
    _internal: str = "kept"
    tags: dict[str, Any] = dataclasses.field(default_factory=dict)


class Address(pydantic.BaseModel):
    city: str
    zip: str


class Customer(pydantic.BaseModel):
    name: str
    address: Address
    since: datetime
    level: Level = Level.LOW
    scores: tuple[int, ...] = ()


CUSTOMER = Customer(name="Zoë", address=Address(zip="1000", city="Brussels"),
                    since=datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC), scores=(3, 1))
ORDER = Order([Money(Currency.EUR, 500), Money(Currency.USD, 1)], ("post", 2, (3.25, None)),
              tags={"gift": True, "note": Label("fragile")})

# Values that had a canonical form before NamedTuples, float subclasses and StrEnum keys anywhere
# were taken in: their bytes are the keys already journaled, which must never change.
BEFORE: list[tuple[str, Any]] = [
    ("plain", {"b": [1.5, None, True, False], "a": "x", "c": {"z": 0, "y": -1}}),
    ("unicode", {"é": "€ 😀", "\u00e9\u0301": "nfd", "nul": "a\x00b"}),
    ("numbers", [2**64 - 1, -(2**63), 0.1, 1e300, -0.0, 5e-324, 1.0]),
    ("empties", {"d": {}, "l": [], "t": (), "s": ""}),
    ("tuples", (1, (2, [3, (4,)]), [])),
    ("dataclass", AB(b=1, a=2)),
    ("dataclasses-nested", ORDER),
    ("dataclass-in-list", [AB(1, 2), {"x": AB(3, 4)}, (AB(5, 6),)]),
    ("enums", [Currency.EUR, Level.HIGH, Colour.RED, Colour.PAIR, Colour.RATE, Perm.R | Perm.W, True]),
    ("dict-subclasses", [collections.OrderedDict(b=1, a=2), collections.defaultdict(list, z=[1]),
                         collections.Counter("abca"), Attrs(y=1, x=2)]),
    ("list-subclass", Names(["b", "a"])),
    ("str-int-subclasses", {"label": Label("x"), "count": Count(7), "member": Currency.USD}),
    ("str-enum-keys", {Currency.EUR: 1, "USD": [Currency.EUR], "n": {Currency.USD: {"x": 1}}}),
    ("str-enum-keys-in-dict-subclass", Attrs({Currency.EUR: 1, Label("b"): 2})),
    ("str-enum-keys-before-dataclass", {"a": {Currency.EUR: 1}, "b": AB(1, 2)}),
    ("times", [datetime(2026, 12, 1, 5, 23, 6, 123456, tzinfo=UTC), date(2026, 2, 3),
               datetime(2026, 1, 1, 1, 0, 0, 7, tzinfo=timezone(timedelta(hours=2))), datetime(2026, 1, 1)]),
    ("uuid", uuid.UUID("12345678-1234-5678-1234-567812345678")),
    ("model", CUSTOMER),
    ("models-and-dataclasses", {"who": CUSTOMER, "what": ORDER, "pairs": [(CUSTOMER.address, AB(0, 0))]}),
    ("model-in-dataclass", Order([], (CUSTOMER.address,), tags={"customer": CUSTOMER})),
    ("arguments", {"account": "acct_1", "cents": 500, "order": ORDER, "currency": Currency.EUR}),
]

# sha256 of each value's canonical bytes as the guard wrote them before these refinements.
DIGESTS_BEFORE = {
    "plain": "75ae11b96bf63df3c52a5b13362841446aaac126c72b60e9367eca3340b7e39e",
    "unicode": "149b33f78e8a64d1a1fbbc6869cc88115ad248356ffd7dc3428f0da65557e489",
    "numbers": "e2cda81130d17e4b24215d41e4e988192318390124442919be2eedd4c0725415",
    "empties": "e3280fd417afa52c8d41d56ec04733aade59a7094d62c4d64b16b3578e5ac63c",
    "tuples": "dc6d88d14582d4241b70bc45d0566a5ddaaa6c9a2686293fa8c8b8e5479c7254",
    "dataclass": "d3626ac30a87e6f7a6428233b3c68299976865fa5508e4267c5415c76af7a772",
    "dataclasses-nested": "159e5a78c5b4193a98c29a36471fc9dc101741e65c4f3f10845dd7e081b533f0",
    "dataclass-in-list": "0c6ec6139cf250702c7ceb194b91b59f79234bec411f444a63ff74a02a0eaafa",
    "enums": "41455536e2ae01a382a3af156ac502fac6b70b17acc16b2b5a072c8a5dc2a59b",
    "dict-subclasses": "647d935807b9309b32e128218bee0891429c1e04c98f577a1cc408c158b1e299",
    "list-subclass": "02d8bc3008a9bb0dcc4b86d7fd3428ced792355c733c19756bec5a56dc61b2c5",
    "str-int-subclasses": "ad988bfb545c1861d5530cdae09fbaeb9962c5276ee7bd07e1503eaa14c964c6",
    "str-enum-keys": "ea5a7eee9a99cde993edaa94d78c67afc7ee1bff8e7f37a1a5e82af3a7848138",
    "str-enum-keys-in-dict-subclass": "9e89500f9f10047230f487a8c5b4201d5a408ab6423b77e5bd8a499463b70dc1",
    "str-enum-keys-before-dataclass": "e31081bdbbc2c416c8ff80060ca208d8a3c18d8fc8537e61ba85da3207cff00b",
    "times": "5dadb5381639cee0d487c9e23e2615682e0c2b1ea341f6fd2c17a4951a3c8dff",
    "uuid": "be6bf1ea57078ff17fa690d9c62d24fb803c8aac2368bb9088431187034a2cfe",
    "model": "2a5b27a064f7a7df31875dcb5604df82f41d6d122c4051b20c36d36bb38f2c00",
    "models-and-dataclasses": "7884e1b957aa382cd2f8de0ba551629d2b6ec0a056a51545f40b5b23fefe20ea",
    "model-in-dataclass": "05b7527fad255585265f887dc164060785200ad7daf843c067dc2c8a06fa823b",
    "arguments": "0b2cefb77b886c3de87ed9b8e6c091ec6c8deff735590549f522244523e4b453",
}


@pytest.mark.parametrize(("name", "value"), BEFORE, ids=[name for name, _ in BEFORE])
def test_a_value_that_had_a_form_keeps_its_bytes(name: str, value: Any) -> None:
    written = canonical_bytes(value)
    assert hashlib.sha256(written).hexdigest() == DIGESTS_BEFORE[name], written


@pytest.mark.parametrize(("name", "value"), BEFORE, ids=[name for name, _ in BEFORE])
def test_every_way_the_guard_writes_a_value_gives_its_bytes(name: str, value: Any) -> None:
    # The way a StrEnum key, a NamedTuple or a float subclass takes writes what the others write.
    written = canonical_bytes(value)
    assert orjson.dumps(_str_keys(value), default=_default, option=_OPTIONS) == written
    if "keys" not in name:  # with a StrEnum key orjson refuses the value as it is
        assert orjson.dumps(value, default=_default, option=_OPTIONS) == written


# -- a StrEnum key wherever it sits ------------------------------------------------------------


@dataclasses.dataclass
class Payee:
    name: str = "bob"


@dataclasses.dataclass
class Split:
    shares: dict[Any, Any]


class Quote(pydantic.BaseModel):
    price: int = 1


def test_a_str_enum_key_is_its_string_whatever_orjson_meets_first() -> None:
    plain = idempotency_key("pay", {"a": {"name": "bob"}, "b": {"EUR": 1}})
    assert idempotency_key("pay", {"a": Payee(), "b": {Currency.EUR: 1}}) == plain  # the dataclass first
    assert idempotency_key("pay", {"b": {Currency.EUR: 1}, "a": Payee()}) == plain
    assert canonical_json({"a": Quote(), "b": {Currency.EUR: [Payee()]}}) == (
        '{"a":{"price":1},"b":{"EUR":[{"name":"bob"}]}}')
    assert canonical_json(Split({Currency.USD: 2, Currency.EUR: {Currency.EUR: 1}})) == (
        '{"shares":{"EUR":{"EUR":1},"USD":2}}')


def test_a_dict_with_a_non_string_key_still_has_no_form_next_to_a_dataclass() -> None:
    for value in ({"a": Payee(), "b": {1: "x"}}, Split({Currency.EUR: 1, 2: "x"}), {"a": Payee(), "b": {1, 2}}):
        with pytest.raises(NotCanonical):
            canonical_bytes(value)


def test_a_call_with_a_dataclass_and_a_str_enum_dict_runs_once_on_every_store(store: Any) -> None:
    runs: list[Any] = []

    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=store)))
    def pay(a: Payee, b: dict[Any, int]) -> str:
        runs.append(b)
        return "paid"

    with AirlockContext(metadata={"tool_call_id": "c1"}):
        assert pay(Payee(), {Currency.EUR: 100}) == "paid"
    with AirlockContext(metadata={"tool_call_id": "c1"}):  # the retry, spelled as a model sends it
        assert pay({"name": "bob"}, {"EUR": 100}) == "paid"
    record = store.get("c1")
    assert record.arguments == '{"a":{"name":"bob"},"b":{"EUR":100}}'
    assert [e.kind for e in store.events(call_id="c1")] == ["pending", "committed", "replayed"]
    assert len(runs) == 1


def test_a_dataclass_value_holding_a_str_enum_dict_is_replayed_on_every_store(store: Any) -> None:
    runs: list[int] = []

    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=store)))
    def quote(n: int) -> Any:
        runs.append(n)
        return {"payee": Payee(), "split": Split({Currency.EUR: 1, Currency.USD: [Quote()]})}

    with AirlockContext(metadata={"tool_call_id": "q1"}):
        quote(1)
        again = quote(1)
    assert again == {"payee": {"name": "bob"}, "split": {"shares": {"EUR": 1, "USD": [{"price": 1}]}}}
    assert runs == [1]


# -- tuples and floats of a subclass ---------------------------------------------------------


class Point(NamedTuple):
    x: int
    y: int


class Segment(NamedTuple):
    start: Point
    end: Point
    label: str = "edge"


class Pair(tuple[Any, ...]):
    pass


class Rate(float):
    def __repr__(self) -> str:
        return f"Rate({float(self)})"


def test_a_tuple_of_a_subclass_is_the_array_of_its_items() -> None:
    assert canonical_json(Point(1, 2)) == "[1,2]"
    assert canonical_json(Segment(Point(0, 0), Point(3, 4))) == '[[0,0],[3,4],"edge"]'
    assert canonical_json({"p": Pair((Point(1, 2), Pair(())))}) == '{"p":[[1,2],[]]}'
    assert idempotency_key("move", {"to": Point(1, 2)}) == idempotency_key("move", {"to": [1, 2]})


def test_a_float_of_a_subclass_is_its_float_and_nan_still_has_no_form() -> None:
    assert canonical_json(Rate(0.25)) == "0.25"
    assert canonical_json({"r": [Rate(1e300), Rate(-0.0)], "p": Point(1, 2)}) == '{"p":[1,2],"r":[1e+300,-0.0]}'
    assert idempotency_key("rate", {"r": Rate(0.5)}) == idempotency_key("rate", {"r": 0.5})
    for bad in (Rate("nan"), Rate("inf"), [Rate("-inf")], Point(1, Rate("nan")), Split({Currency.EUR: Rate("inf")})):
        with pytest.raises(NotCanonical, match="NaN and infinities"):
            canonical_bytes(bad)


def test_named_tuples_and_float_subclasses_are_arguments_and_replayed_values_on_every_store(store: Any) -> None:
    runs: list[Any] = []

    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=store)))
    def move(to: Point, speed: Rate) -> Segment:
        runs.append((to, speed))
        return Segment(Point(0, 0), to, label=f"at {float(speed)}")

    with AirlockContext(metadata={"tool_call_id": "m1"}):
        first = move(Point(1, 2), Rate(0.5))
    assert not is_refusal(first), first
    assert first == Segment(Point(0, 0), Point(1, 2), "at 0.5")  # the first caller gets the tool's own value
    with AirlockContext(metadata={"tool_call_id": "m1"}):
        again = move([1, 2], 0.5)  # the same arguments, as a model sends them
    assert again == [[0, 0], [1, 2], "at 0.5"]
    record = store.get("m1")
    assert (record.status, record.arguments, record.value) == (
        "committed", '{"speed":0.5,"to":[1,2]}', '[[0,0],[1,2],"at 0.5"]')
    assert len(runs) == 1

    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=store)))
    def rate_of(name: str) -> Rate:
        return Rate(math.inf)

    with AirlockContext(metadata={"tool_call_id": "r1"}):
        assert rate_of("x") == math.inf
    with AirlockContext(metadata={"tool_call_id": "r1"}):
        assert rate_of("x")["block_reason"] == "replay_value_unavailable"  # an infinity: never replayed as None


# -- the property: any mix of these has the form of its plain twin --------------------------


@dataclasses.dataclass
class Box:
    item: Any


class Wrapped(pydantic.BaseModel):
    item: Any


def plain(value: Any) -> Any:
    """``value`` in plain JSON types, made by the byte rule's words, not by the guard's code."""
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, dict):
        return {str.__str__(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    if isinstance(value, Box):
        return {"item": plain(value.item)}
    if isinstance(value, Wrapped):
        return {"item": plain(value.item)}
    raise AssertionError(f"no plain form for {value!r}")


leaves = (
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(st.characters(exclude_categories=["Cs"]), max_size=4) | st.sampled_from(list(Currency) + list(Level))
    | st.floats(allow_nan=False, allow_infinity=False).map(Rate) | st.text(max_size=3).map(Label)
)
keys = st.text(max_size=3) | st.sampled_from(list(Currency))


def _containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return (
        st.lists(children, max_size=3) | st.lists(children, max_size=3).map(tuple)
        | st.lists(children, max_size=3).map(Pair) | st.builds(Point, children, children)
        | st.dictionaries(keys, children, max_size=3) | st.builds(Box, children)
        | st.dictionaries(st.text(max_size=3), children, max_size=3).map(lambda d: Wrapped(item=d))
    )


@settings(max_examples=300, deadline=None)
@given(st.recursive(leaves, _containers, max_leaves=12))
def test_any_mix_has_the_form_of_its_plain_twin(value: Any) -> None:
    assert canonical_bytes(value) == orjson.dumps(plain(value), option=orjson.OPT_SORT_KEYS)
