"""The hash chain: the byte rule a third party can recompute, and offline checks of exported lines."""

from __future__ import annotations

import copy
import hashlib
import itertools
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from guard.store import EffectEvent, format_at, parse_at
from journal import SQLiteJournal
from journal.chain import GENESIS, compute_hash, event_body, verify_lines
from journal.events import at_text


@pytest.fixture
def journal(tmp_path: Path) -> Any:
    with SQLiteJournal(tmp_path / "j.db", durability="process") as j:
        yield j


def fill(journal: SQLiteJournal) -> None:
    at = parse_at("2026-12-01T05:23:06.000001Z")
    owner = {"host": "h1", "pid": 7}
    common: dict[str, Any] = {"tool": "charge", "agent_id": "a1", "idempotency_key": "k" * 64,
                              "arguments": '{"account":"acct","cents":5}', "owner": owner, "at": at}
    journal.append(EffectEvent(kind="pending", call_id="c1", attempt=1, **common))
    journal.append(EffectEvent(kind="committed", call_id="c1", attempt=1, value='{"id":"ch_1"}', **common))
    journal.append(EffectEvent(kind="refused", call_id=None, attempt=0,
                               reason={"code": "tool_call_id_required", "message": "no id"}, **common))
    journal.append(EffectEvent(kind="pending", call_id="c2", attempt=1, **common))
    journal.append(EffectEvent(kind="unknown", call_id="c2", attempt=1,
                               error={"type": "TimeoutError", "message": "slow"}, **common))


def exported(journal: SQLiteJournal, redact: frozenset[str] = frozenset()) -> list[dict[str, Any]]:
    # Through JSON text and back, as a file would carry them.
    return [orjson.loads(orjson.dumps(e.export(redact))) for e in journal.events()]


def test_first_hash_is_the_documented_byte_rule(journal: SQLiteJournal) -> None:
    fill(journal)
    first = next(iter(journal.events()))
    body = (
        b'{"actor":"guard","agent_id":"a1","arguments_sha256":"'
        + hashlib.sha256(b'{"account":"acct","cents":5}').hexdigest().encode()
        + b'","at":"2026-12-01T05:23:06.000001Z","attempt":1,"call_id":"c1","error":null,'
        b'"idempotency_key":"' + b"k" * 64 + b'","kind":"pending","owner":{"host":"h1","pid":7},'
        b'"reason":null,"seq":1,"tool":"charge","value_sha256":null}'
    )
    assert first.prev_hash == GENESIS == "0" * 64
    assert first.hash == hashlib.sha256(b"0" * 64 + body).hexdigest()


def test_each_event_links_to_the_one_before(journal: SQLiteJournal) -> None:
    fill(journal)
    events = list(journal.events())
    assert [e.seq for e in events] == [1, 2, 3, 4, 5]
    for before, after in itertools.pairwise(events):
        assert after.prev_hash == before.hash
    assert journal.head() == (5, events[-1].hash)


def test_compute_hash_matches_event_body(journal: SQLiteJournal) -> None:
    fill(journal)
    committed = list(journal.events())[1]
    body = event_body(
        seq=2, at="2026-12-01T05:23:06.000001Z", call_id="c1", kind="committed", tool="charge", agent_id="a1",
        idempotency_key="k" * 64, arguments_sha256=hashlib.sha256(b'{"account":"acct","cents":5}').hexdigest(),
        value_sha256=hashlib.sha256(b'{"id":"ch_1"}').hexdigest(), error=None, reason=None, actor="guard",
        attempt=1, owner={"pid": 7, "host": "h1"},
    )
    assert compute_hash(committed.prev_hash, body) == committed.hash


def test_export_line_has_every_field_as_json_values(journal: SQLiteJournal) -> None:
    fill(journal)
    line = exported(journal)[1]
    assert set(line) == {
        "seq", "at", "call_id", "kind", "tool", "agent_id", "idempotency_key", "arguments", "arguments_sha256",
        "value", "value_sha256", "error", "reason", "actor", "attempt", "owner", "prev_hash", "hash", "redacted",
    }
    assert line["arguments"] == {"account": "acct", "cents": 5}
    assert line["value"] == {"id": "ch_1"}
    assert line["at"] == "2026-12-01T05:23:06.000001Z"
    assert line["owner"] == {"host": "h1", "pid": 7}
    assert line["redacted"] == []


def test_export_verifies_offline(journal: SQLiteJournal) -> None:
    fill(journal)
    report = verify_lines(exported(journal))
    assert (report.ok, report.events, report.head, report.first_bad_seq) == (True, 5, journal.head()[1], None)


def test_redacted_export_still_verifies(journal: SQLiteJournal) -> None:
    fill(journal)
    lines = exported(journal, frozenset({"arguments", "value"}))
    assert lines[1]["arguments"] is None and lines[1]["value"] is None
    assert lines[1]["redacted"] == ["arguments", "value"]
    assert lines[1]["value_sha256"] == hashlib.sha256(b'{"id":"ch_1"}').hexdigest()
    assert verify_lines(lines).ok


def test_redacting_a_field_inside_the_hash_is_refused(journal: SQLiteJournal) -> None:
    fill(journal)
    event = next(iter(journal.events()))
    with pytest.raises(ValueError, match="cannot redact owner"):
        event.export(frozenset({"owner"}))


@pytest.mark.parametrize(
    ("field", "value"),
    [("tool", "refund"), ("attempt", 2), ("at", "2026-12-01T05:23:07.000001Z"), ("owner", {"host": "h2", "pid": 7}),
     ("value", {"id": "ch_2"}), ("arguments", {"account": "acct", "cents": 500})],
)
def test_an_altered_line_is_found(journal: SQLiteJournal, field: str, value: Any) -> None:
    fill(journal)
    lines = exported(journal)
    lines[1][field] = value
    report = verify_lines(lines)
    assert (report.ok, report.first_bad_seq, report.events) == (False, 2, 1)
    assert "seq 2" in str(report.problem)


def test_an_altered_digest_of_a_redacted_field_is_found(journal: SQLiteJournal) -> None:
    fill(journal)
    lines = exported(journal, frozenset({"value"}))
    lines[1]["value_sha256"] = hashlib.sha256(b'{"id":"ch_2"}').hexdigest()
    assert verify_lines(lines).first_bad_seq == 2


@pytest.mark.parametrize(
    ("field", "forged"),
    [("value", {"id": "FORGED"}), ("arguments", {"account": "acct_eve", "cents": 999999})],
)
def test_a_value_beside_a_redaction_claim_is_found(journal: SQLiteJournal, field: str, forged: Any) -> None:
    # Claiming a field redacted must not let a forged value stand beside the untouched digest.
    fill(journal)
    lines = exported(journal)
    lines[1][field] = forged
    lines[1]["redacted"] = [field]
    report = verify_lines(lines)
    assert (report.ok, report.first_bad_seq, report.events) == (False, 2, 1)
    assert f"its {field} is named redacted but is not null" in str(report.problem)


@pytest.mark.parametrize("redacted", [["value", "hash"], ["owner"], "value", [1], None])
def test_a_redacted_list_that_names_no_redactable_field_is_found(journal: SQLiteJournal, redacted: Any) -> None:
    fill(journal)
    lines = exported(journal, frozenset({"value"}))
    lines[1]["redacted"] = redacted
    report = verify_lines(lines)
    assert (report.ok, report.first_bad_seq) == (False, 2)
    assert "redacted list" in str(report.problem)


def test_a_rehashed_line_breaks_the_next_link(journal: SQLiteJournal) -> None:
    fill(journal)
    lines = exported(journal)
    forged = copy.deepcopy(lines[1])
    forged["tool"] = "refund"
    body = {k: forged[k] for k in ("seq", "at", "call_id", "kind", "tool", "agent_id", "idempotency_key",
                                   "arguments_sha256", "value_sha256", "error", "reason", "actor", "attempt", "owner")}
    forged["hash"] = compute_hash(forged["prev_hash"], body)
    lines[1] = forged
    report = verify_lines(lines)
    assert (report.ok, report.first_bad_seq) == (False, 3)
    assert "link" in str(report.problem)


def test_a_gap_is_an_error_unless_allowed(journal: SQLiteJournal) -> None:
    fill(journal)
    lines = exported(journal)
    del lines[2]
    report = verify_lines(lines)
    assert (report.ok, report.first_bad_seq) == (False, 4)
    assert "missing" in str(report.problem)
    allowed = verify_lines(lines, allow_gaps=True)
    assert (allowed.ok, allowed.events) == (True, 4)


def test_a_filtered_export_verifies_with_gaps_allowed(journal: SQLiteJournal) -> None:
    fill(journal)
    lines = [orjson.loads(orjson.dumps(e.export())) for e in journal.events(call_id="c2")]
    assert [line["seq"] for line in lines] == [4, 5]
    assert not verify_lines(lines).ok  # seq 1 to 3 are missing
    assert verify_lines(lines, allow_gaps=True).ok


def test_a_gap_still_checks_links_after_it(journal: SQLiteJournal) -> None:
    fill(journal)
    lines = exported(journal)
    del lines[2]
    lines[3]["prev_hash"] = GENESIS
    assert verify_lines(lines, allow_gaps=True).first_bad_seq == 5


def test_reordered_lines_are_found(journal: SQLiteJournal) -> None:
    fill(journal)
    lines = exported(journal)
    lines[1], lines[2] = lines[2], lines[1]
    report = verify_lines(lines, allow_gaps=True)
    assert (report.ok, report.first_bad_seq) == (False, 2)


def test_malformed_lines_are_reported_not_raised(journal: SQLiteJournal) -> None:
    fill(journal)
    lines = exported(journal)
    del lines[0]["owner"]
    report = verify_lines(lines)
    assert (report.ok, report.first_bad_seq) == (False, 1)
    assert "owner" in str(report.problem)
    no_seq = verify_lines([{"kind": "pending"}])
    assert not no_seq.ok and no_seq.first_bad_seq is None and "line 1" in str(no_seq.problem)


def test_empty_stream_verifies_to_genesis() -> None:
    report = verify_lines([])
    assert (report.ok, report.events, report.head) == (True, 0, GENESIS)


@given(st.datetimes(min_value=datetime(2, 1, 1), max_value=datetime(9999, 12, 30),
                    timezones=st.sampled_from([UTC, timezone(timedelta(hours=5, minutes=30))])))
def test_the_fast_time_text_is_the_exported_one(at: datetime) -> None:
    assert at_text(at) == format_at(at)
    assert at_text(at.replace(microsecond=0)).endswith(".000000Z")


# -- any alteration of any stored field is found -----------------------------------------------

_KINDS = ("pending", "committed", "unknown", "released", "replayed", "refused")
_FIELDS = {
    "at": "'2030-01-01T00:00:00.000000Z'", "call_id": "'other'", "kind": "'refused'", "tool": "'other'",
    "agent_id": "'other'", "idempotency_key": "'" + "e" * 64 + "'", "arguments": "'{\"x\":1}'",
    "value": "'{\"x\":2}'", "error": "'{\"message\":\"m\",\"type\":\"T\"}'",
    "reason": "'{\"code\":\"c\",\"message\":\"m\"}'", "actor": "'operator:mallory'", "attempt": "attempt + 7",
    "owner": "'{\"host\":\"h\",\"pid\":2}'", "prev_hash": "'" + "1" * 64 + "'", "hash": "'" + "2" * 64 + "'",
}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    kinds=st.lists(st.sampled_from(_KINDS), min_size=1, max_size=12),
    field=st.sampled_from(sorted(_FIELDS)),
    pick=st.integers(min_value=0),
)
def test_altering_any_field_of_any_event_is_found_at_that_seq(
    tmp_path_factory: pytest.TempPathFactory, kinds: list[str], field: str, pick: int
) -> None:
    import sqlite3

    path = tmp_path_factory.mktemp("chain") / "j.db"
    with SQLiteJournal(path, durability="process") as journal:
        for n, kind in enumerate(kinds):
            journal.append(EffectEvent(
                kind=kind, call_id=f"c{n % 3}", tool="charge", agent_id="a", idempotency_key="k" * 64,
                arguments=f'{{"n":{n}}}', value='{"v":1}' if kind == "committed" else None,
                error={"type": "TimeoutError", "message": "slow"} if kind == "unknown" else None,
                reason={"code": "policy_violation", "message": "no"} if kind == "refused" else None,
                attempt=1,
            ))
        assert journal.verify().ok
        lines = [orjson.loads(orjson.dumps(e.export())) for e in journal.events()]
        assert verify_lines(lines).ok
        seq = pick % len(kinds) + 1
        conn = sqlite3.connect(path, isolation_level=None)
        conn.execute("DROP TRIGGER events_no_update")
        changed = conn.execute(f"UPDATE events SET {field} = {_FIELDS[field]} WHERE seq = ? AND "
                               f"{field} IS NOT {_FIELDS[field]}", (seq,)).rowcount
        conn.close()
        report = journal.verify()
        if changed:
            assert (report.ok, report.first_bad_seq) == (False, seq), (field, report)
        else:
            assert report.ok


_TEXT = st.text(max_size=12)
_JSON = st.recursive(st.none() | st.booleans() | st.integers(-(2**53), 2**53) | _TEXT,
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_TEXT, inner, max_size=3),
                     max_leaves=8)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    kind=st.sampled_from(_KINDS),
    call_id=st.none() | _TEXT,
    agent_id=st.none() | _TEXT,
    arguments=st.none() | _JSON,
    value=st.none() | _JSON,
    error=st.none() | st.dictionaries(_TEXT, _TEXT, max_size=2),
    at=st.datetimes(min_value=datetime(2000, 1, 1), max_value=datetime(2100, 1, 1),
                    timezones=st.sampled_from([UTC, timezone(timedelta(hours=-7))])),
)
def test_the_sqlite_journal_hashes_an_event_as_the_shared_rule_does(
    tmp_path_factory: pytest.TempPathFactory, kind: str, call_id: str | None, agent_id: str | None,
    arguments: Any, value: Any, error: dict[str, str] | None, at: datetime,
) -> None:
    from guard.canonical import canonical_json
    from journal.rows import stamp

    event = EffectEvent(
        kind=kind, call_id=call_id, tool="tool-é", at=at, agent_id=agent_id,
        arguments=None if arguments is None else canonical_json(arguments),
        value=None if value is None else canonical_json(value), error=error, attempt=3,
    )
    with SQLiteJournal(tmp_path_factory.mktemp("rule") / "j.db", durability="process") as journal:
        journal.append(event)
        [stored] = list(journal.events())
    expected, _ = stamp(event, 1, GENESIS)
    assert stored.hash == expected.hash
    assert verify_lines([orjson.loads(orjson.dumps(stored.export()))]).ok


def documented_checker() -> Any:
    """The third party's checker that docs/journal.md prints, as it is printed."""
    text = (Path(__file__).parent.parent / "docs" / "journal.md").read_text()
    block = next(b.split("```", 1)[0] for b in text.split("```python\n")[1:] if "def check(lines)" in b)
    scope: dict[str, Any] = {}
    exec(compile(block, "docs/journal.md", "exec"), scope)  # our own documentation, as printed
    return scope["check"]


def test_the_documented_checker_passes_an_export_and_tells_a_none_value_from_none(journal: SQLiteJournal) -> None:
    fill(journal)
    journal.append(EffectEvent(kind="pending", call_id="c3", tool="notify", attempt=1, arguments="{}"))
    journal.append(EffectEvent(kind="committed", call_id="c3", tool="notify", attempt=1, arguments="{}", value="null"))
    journal.append(EffectEvent(kind="pending", call_id="c4", tool="notify", attempt=1, arguments="{}"))
    journal.append(EffectEvent(kind="committed", call_id="c4", tool="notify", attempt=1, arguments="{}",
                               reason={"code": "value_not_stored", "message": "no JSON form"}))
    check = documented_checker()
    lines = exported(journal)
    returned_none, without_value = lines[-3], lines[-1]
    assert returned_none["value"] is None and returned_none["value_sha256"] == hashlib.sha256(b"null").hexdigest()
    assert without_value["value"] is None and without_value["value_sha256"] is None
    check(lines)
    check(exported(journal, frozenset({"arguments", "value"})))
    forged = copy.deepcopy(lines)
    forged[-1]["value"] = {"id": "ch_forged"}  # a value where the event has none
    with pytest.raises(AssertionError):
        check(forged)
    forged = copy.deepcopy(lines)
    forged[1]["value"] = {"id": "ch_2"}
    with pytest.raises(AssertionError):
        check(forged)
