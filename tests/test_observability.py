"""Spans, metrics and the on_event hook of guarded calls, read through the OpenTelemetry SDK's own
in-memory exporter and metric reader; and a process without OpenTelemetry, which imports none of it."""

from __future__ import annotations

import asyncio
import http.server
import logging
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import orjson
import pytest
from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from guard import (
    Airlock,
    AirlockBlocked,
    AirlockContext,
    OversightResponse,
    OversightVerdict,
    SecurityPolicy,
    is_refusal,
    requires,
    telemetry,
)
from guard.adapters import openai as openai_adapter
from guard.effect_guard import EffectGuard, InMemoryEffectStore, reversibility
from guard.store import EffectEvent
from journal import SQLiteJournal

ROOT = Path(__file__).resolve().parents[1]


# -- the SDK, set up once for this module --------------------------------------------------------


class Telemetry:
    """The SDK's in-memory exporter and metric reader behind the global providers."""

    def __init__(self) -> None:
        self.exporter = InMemorySpanExporter()
        self.reader = InMemoryMetricReader()
        current = trace.get_tracer_provider()
        if isinstance(current, TracerProvider):  # another module of this run set one: listen to it too
            current.add_span_processor(SimpleSpanProcessor(self.exporter))
        else:
            provider = TracerProvider()
            provider.add_span_processor(SimpleSpanProcessor(self.exporter))
            trace.set_tracer_provider(provider)
        if isinstance(metrics.get_meter_provider(), MeterProvider):
            pytest.skip("a meter provider without this module's reader is already set in this process")
        metrics.set_meter_provider(MeterProvider(metric_readers=[self.reader]))

    def spans(self, tool: str) -> list[ReadableSpan]:
        return [s for s in self.exporter.get_finished_spans() if s.name == f"airlock {tool}"]

    def only_span(self, tool: str) -> ReadableSpan:
        spans = self.spans(tool)
        assert len(spans) == 1, [dict(s.attributes or {}) for s in spans]
        return spans[0]

    def points(self, name: str) -> dict[tuple[str, str], Any]:
        """The data points of metric ``name`` by (tool, outcome): a count's value, a histogram's point."""
        found: dict[tuple[str, str], Any] = {}
        data = self.reader.get_metrics_data()
        for resource in data.resource_metrics if data is not None else ():
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    if metric.name != name:
                        continue
                    for point in metric.data.data_points:
                        attributes = dict(point.attributes or {})
                        key = (str(attributes["airlock.tool"]), str(attributes["airlock.outcome"]))
                        found[key] = point.value if hasattr(point, "value") else point
        return found


_SDK: list[Telemetry] = []


@pytest.fixture(scope="module", autouse=True)
def _pristine_after() -> Iterator[None]:
    """After this module, the process is as if no SDK had been set up: the test modules after it run
    untraced, and may set providers of their own (as OpenTelemetry's own test helpers reset them)."""
    yield
    if not _SDK:
        return
    sdk = _SDK.pop()
    sdk.exporter.shutdown()  # keeps no more spans, whatever happens below
    from opentelemetry.metrics import _internal as metrics_api
    from opentelemetry.util._once import Once

    trace._TRACER_PROVIDER_SET_ONCE = Once()  # type: ignore[attr-defined]
    trace._TRACER_PROVIDER = None  # type: ignore[attr-defined]
    metrics_api._METER_PROVIDER_SET_ONCE = Once()
    metrics_api._METER_PROVIDER = None
    metrics_api._PROXY_METER_PROVIDER = metrics_api._ProxyMeterProvider()
    with telemetry._load_lock:  # the guard's tracer and meter are bound to the SDK's: made anew
        telemetry._instruments = telemetry._trace_api = telemetry._metrics_api = None


@pytest.fixture
def otel() -> Iterator[Telemetry]:
    if not _SDK:
        _SDK.append(Telemetry())
    sdk = _SDK[0]
    telemetry.set_enabled(True)
    sdk.exporter.clear()
    yield sdk
    sdk.exporter.clear()


host_tracer = trace.get_tracer("the-host")


def guarded(store: Any = None, name: str = "charge", **policy: Any) -> Any:
    """A ``def`` tool named ``name`` that records its runs, on a fresh effect guard over ``store``."""
    runs: list[Any] = []
    failures: list[str] = []  # how the next runs fail, in turn
    eg = policy.pop("effect_guard", None) or EffectGuard(store=store or InMemoryEffectStore())

    def tool(account: str, cents: int) -> dict[str, Any]:
        runs.append((account, cents))
        with host_tracer.start_as_current_span("backend request"):  # what a tool's own client would make
            pass
        fail = failures.pop(0) if failures else ""
        if fail == "timeout":
            raise TimeoutError("backend did not answer")
        if fail == "declined":
            raise ValueError("card declined")
        return {"charge_id": f"ch_{len(runs)}", "cents": cents}

    tool.__name__ = name
    wrapped = Airlock(policy=SecurityPolicy(effect_guard=eg, **policy))(tool)
    wrapped.runs, wrapped.failures = runs, failures
    return wrapped


def call(tool: Any, call_id: str | None, *args: Any, agent: str = "agent-1", **kwargs: Any) -> Any:
    metadata = {} if call_id is None else {"tool_call_id": call_id}
    with AirlockContext(agent_id=agent, metadata=metadata):
        return tool(*args, **kwargs)


def attributes(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


# -- one span per call, with its outcome ---------------------------------------------------------


def test_a_fresh_call_is_one_span_under_the_hosts_span_and_the_parent_of_the_tools_own(otel: Telemetry) -> None:
    charge = guarded()
    with host_tracer.start_as_current_span("agent step") as step:
        assert call(charge, "call-1", "acct_1", 500) == {"charge_id": "ch_1", "cents": 500}
        assert trace.get_current_span() is step  # the guard's span is no longer current
    span = otel.only_span("charge")
    assert attributes(span) == {
        "airlock.tool": "charge", "airlock.call_id": "call-1", "airlock.agent_id": "agent-1",
        "airlock.outcome": "committed", "airlock.attempt": 1,
    }
    assert span.parent is not None and span.parent.span_id == step.get_span_context().span_id
    assert span.context.trace_id == step.get_span_context().trace_id
    (backend,) = [s for s in otel.exporter.get_finished_spans() if s.name == "backend request"]
    assert backend.parent is not None and backend.parent.span_id == span.context.span_id
    assert span.status.status_code is StatusCode.UNSET


def test_ids_with_no_utf8_form_are_on_the_span_as_the_journal_keeps_them(otel: Telemetry) -> None:
    charge = guarded()
    call(charge, "call-\udcff", "acct_1", 5, agent="agent-\ud800")
    seen = attributes(otel.only_span("charge"))
    assert (seen["airlock.call_id"], seen["airlock.agent_id"]) == ("call-\\udcff", "agent-\\ud800")
    assert charge.runs == [("acct_1", 5)]


def test_each_outcome_of_the_replay_table_is_the_spans_and_is_counted(otel: Telemetry) -> None:
    charge = guarded(name="pay")
    counted = otel.points("airlock.calls")
    call(charge, "c-ok", "acct_1", 500)
    call(charge, "c-ok", "acct_1", 500)  # replayed
    charge.failures.append("timeout")
    with pytest.raises(TimeoutError):
        call(charge, "c-lost", "acct_2", 700)
    charge.failures.append("declined")
    with pytest.raises(ValueError, match="declined"):
        call(charge, "c-declined", "acct_3", 900)
    call(charge, "c-declined", "acct_3", 900)  # released, so it runs again: attempt 2

    spans = otel.spans("pay")
    assert [(attributes(s)["airlock.call_id"], attributes(s)["airlock.outcome"], attributes(s)["airlock.attempt"])
            for s in spans] == [
        ("c-ok", "committed", 1), ("c-ok", "replayed", 1), ("c-lost", "unknown", 1),
        ("c-declined", "released", 1), ("c-declined", "committed", 2)]
    lost, declined = spans[2], spans[3]
    assert lost.status.status_code is StatusCode.ERROR
    assert [e.attributes["exception.type"] for e in lost.events if e.attributes] == ["TimeoutError"]
    assert declined.status.status_code is StatusCode.ERROR and "card declined" in str(declined.status.description)
    now = otel.points("airlock.calls")
    grown = {key: now[key] - counted.get(key, 0) for key in now if key[0] == "pay"}
    assert grown == {("pay", "committed"): 2, ("pay", "replayed"): 1, ("pay", "unknown"): 1,
                     ("pay", "released"): 1}


def test_the_store_time_of_each_call_is_recorded_in_seconds(otel: Telemetry, tmp_path: Path) -> None:
    with SQLiteJournal(tmp_path / "j.db", durability="process") as journal:
        charge = guarded(journal, name="timed")
        for i in range(3):
            call(charge, f"t-{i}", "acct_1", i)
        call(charge, "t-0", "acct_1", 0)
    histogram = otel.points("airlock.store.duration")
    committed, replayed = histogram[("timed", "committed")], histogram[("timed", "replayed")]
    assert committed.count == 3 and replayed.count == 1
    # Every call reached the file (a begin, and an append for the fresh ones), and none took an hour.
    assert 0 < committed.sum < 3600 and 0 < replayed.sum < 3600
    assert committed.max > 0


def test_a_call_that_never_reaches_a_store_has_a_span_and_no_store_time(otel: Telemetry) -> None:
    @Airlock()  # no effect guard: nothing is journaled
    def lookup(city: str) -> str:
        return city.upper()

    before = otel.points("airlock.store.duration")
    assert call(lookup, None, "oslo") == "OSLO"
    assert attributes(otel.only_span("lookup"))["airlock.outcome"] == "committed"
    assert ("lookup", "committed") not in otel.points("airlock.store.duration")
    assert otel.points("airlock.store.duration").keys() == before.keys() | set()


def _refusal_cases() -> list[Any]:
    def allowed_only(**_: Any) -> Any:
        return guarded(name="refund", allowed_tools=["charge"]), ("c1", "acct_1", 5), {}

    def reused(**_: Any) -> Any:
        tool = guarded(name="refund")
        call(tool, "c1", "acct_1", 5)
        return tool, ("c1", "acct_9", 99), {}

    def capability(**_: Any) -> Any:
        tool = guarded(name="refund")
        return requires("payments:write")(tool), ("c1", "acct_1", 5), {}

    def escalation(**_: Any) -> Any:
        return guarded(name="refund", escalate_tools={"refund": "money leaves"}), ("c1", "acct_1", 5), {}

    def denied(**_: Any) -> Any:
        def no(request: Any) -> OversightResponse:
            return OversightResponse(request_id=request.request_id, verdict=OversightVerdict.DENY)

        tool = guarded(name="refund", escalate_tools={"refund": "money leaves"}, approver=no)
        return tool, ("c1", "acct_1", 5), {}

    def no_id(**_: Any) -> Any:
        return guarded(name="refund"), (None, "acct_1", 5), {}

    def no_target(**_: Any) -> Any:
        tool = guarded(name="refund", effect_guard=EffectGuard(target_args=["account"]))
        return tool, ("c1", "", 5), {}

    def not_canonical(**_: Any) -> Any:
        return guarded(name="refund"), ("c1", "acct_1", float("nan")), {}

    def in_doubt(**_: Any) -> Any:
        tool = guarded(name="refund")
        tool.failures.append("timeout")
        with pytest.raises(TimeoutError):
            call(tool, "c1", "acct_1", 5)
        return tool, ("c1", "acct_1", 5), {}

    def no_value(**_: Any) -> Any:
        @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard()))
        def refund(account: str, cents: int) -> object:
            return object()  # no JSON form: committed without a value

        call(refund, "c1", "acct_1", 5)
        return refund, ("c1", "acct_1", 5), {}

    def store_down(tmp_path: Path) -> Any:
        SQLiteJournal(tmp_path / "ro.db").close()
        journal = SQLiteJournal(tmp_path / "ro.db", readonly=True)  # a real journal that cannot write
        return guarded(journal, name="refund"), ("c1", "acct_1", 5), {}

    return [
        pytest.param(allowed_only, "policy_violation", id="policy_violation"),
        pytest.param(reused, "policy_violation", id="policy_violation-id-reused"),
        pytest.param(capability, "capability_denied", id="capability_denied"),
        pytest.param(escalation, "escalation_required", id="escalation_required"),
        pytest.param(denied, "escalation_denied", id="escalation_denied"),
        pytest.param(no_id, "tool_call_id_required", id="tool_call_id_required"),
        pytest.param(no_target, "target_args_required", id="target_args_required"),
        pytest.param(not_canonical, "arguments_not_canonical", id="arguments_not_canonical"),
        pytest.param(in_doubt, "effect_status_unknown", id="effect_status_unknown"),
        pytest.param(no_value, "replay_value_unavailable", id="replay_value_unavailable"),
        pytest.param(store_down, "store_unavailable", id="store_unavailable"),
    ]


@pytest.mark.parametrize(("make", "code"), _refusal_cases())
def test_every_refusal_is_one_span_with_its_block_reason_and_is_counted(
    otel: Telemetry, tmp_path: Path, make: Any, code: str
) -> None:
    tool, (call_id, *args), kwargs = make(tmp_path=tmp_path)
    otel.exporter.clear()
    counted = otel.points("airlock.calls").get(("refund", "refused"), 0)
    refusal = call(tool, call_id, *args, **kwargs)
    assert is_refusal(refusal) and refusal["block_reason"] == code
    span = otel.only_span("refund")
    seen = attributes(span)
    assert seen["airlock.outcome"] == "refused" and seen["airlock.block_reason"] == code
    assert seen.get("airlock.call_id") == call_id
    assert span.status.status_code is StatusCode.ERROR and code in str(span.status.description)
    assert otel.points("airlock.calls")[("refund", "refused")] == counted + 1


def test_a_refusal_raised_is_the_same_span(otel: Telemetry) -> None:
    @Airlock(policy=SecurityPolicy(allowed_tools=[], effect_guard=EffectGuard()), on_block="raise")
    def wire(account: str) -> None:
        raise AssertionError("a refused tool ran")

    with pytest.raises(AirlockBlocked):
        call(wire, "w1", "acct_1")
    seen = attributes(otel.only_span("wire"))
    assert (seen["airlock.outcome"], seen["airlock.block_reason"]) == ("refused", "policy_violation")


def test_an_adapters_refusal_of_bad_arguments_is_a_span_too(otel: Telemetry) -> None:
    charge = guarded()
    reply = openai_adapter.dispatch(
        {"id": "call_bad", "type": "function", "function": {"name": "charge", "arguments": "{not json"}}, [charge])
    assert orjson.loads(reply["content"])["block_reason"] == "arguments_not_canonical"
    seen = attributes(otel.only_span("charge"))
    assert (seen["airlock.outcome"], seen["airlock.block_reason"]) == ("refused", "arguments_not_canonical")
    assert seen["airlock.call_id"] == "call_bad"
    assert charge.runs == []


def test_an_async_tool_is_one_span_under_the_tasks_current_span(otel: Telemetry, tmp_path: Path) -> None:
    journal = SQLiteJournal(tmp_path / "a.db")
    journal.offload_async = True  # its store work off the loop, in the guard's threads

    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=journal)))
    async def send(to: str) -> str:
        with host_tracer.start_as_current_span("smtp"):
            await asyncio.sleep(0)
        return f"sent to {to}"

    async def agent(n: int) -> list[str]:
        async def one(i: int) -> str:
            with (host_tracer.start_as_current_span(f"step {i}"),
                  AirlockContext(agent_id="mailer", metadata={"tool_call_id": f"m-{i}"})):
                return await send(f"user{i}@example.com")

        return list(await asyncio.gather(*(one(i) for i in range(n))))

    try:
        assert asyncio.run(agent(4)) == [f"sent to user{i}@example.com" for i in range(4)]
    finally:
        journal.close()
    finished = otel.exporter.get_finished_spans()
    steps = {s.name: s for s in finished if s.name.startswith("step ")}
    sends = otel.spans("send")
    assert len(sends) == 4
    for span in sends:
        i = attributes(span)["airlock.call_id"].removeprefix("m-")
        assert attributes(span)["airlock.outcome"] == "committed"
        assert span.parent is not None and span.parent.span_id == steps[f"step {i}"].context.span_id
    smtp_parents = sorted(s.parent.span_id for s in finished if s.name == "smtp" and s.parent is not None)
    assert smtp_parents == sorted(s.context.span_id for s in sends)


def test_an_async_tool_that_times_out_is_unknown(otel: Telemetry) -> None:
    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard()))
    async def post(body: str) -> None:
        raise TimeoutError("no answer")

    async def run() -> None:
        with AirlockContext(metadata={"tool_call_id": "p1"}):
            await post("hi")

    with pytest.raises(TimeoutError):
        asyncio.run(run())
    span = otel.only_span("post")
    assert attributes(span)["airlock.outcome"] == "unknown" and span.status.status_code is StatusCode.ERROR


def test_a_guarded_call_made_by_a_tool_is_a_child_of_its_span(otel: Telemetry) -> None:
    policy = SecurityPolicy(effect_guard=EffectGuard())

    @reversibility("reversible")
    @Airlock(policy=policy)
    def quote(cents: int) -> int:
        return cents + 30

    @Airlock(policy=policy)
    def checkout(cents: int) -> int:
        return quote(cents)  # the inner call has no id of its own, and quote is reversible: it runs

    assert call(checkout, "k1", 100) == 130
    outer, inner = otel.only_span("checkout"), otel.only_span("quote")
    assert inner.parent is not None and inner.parent.span_id == outer.context.span_id
    assert "airlock.call_id" not in attributes(inner)


def test_telemetry_turned_off_makes_no_span(otel: Telemetry) -> None:
    charge = guarded()
    telemetry.set_enabled(False)
    try:
        assert not telemetry.is_enabled()
        assert call(charge, "off-1", "acct_1", 5) == {"charge_id": "ch_1", "cents": 5}
    finally:
        telemetry.set_enabled(True)
    assert otel.spans("charge") == []
    call(charge, "off-2", "acct_1", 5)
    assert len(otel.spans("charge")) == 1


# -- on_event ------------------------------------------------------------------------------------


class Hooked:
    """An on_event hook that keeps each event, and whether the store held it when the hook ran."""

    def __init__(self, store: InMemoryEffectStore) -> None:
        self.store = store
        self.events: list[EffectEvent] = []
        self.stored: list[bool] = []

    def __call__(self, event: EffectEvent) -> None:
        self.events.append(event)
        self.stored.append(any(e.kind == event.kind and e.attempt == event.attempt and e.at == event.at
                               for e in self.store.events(event.call_id)))


def test_on_event_gets_every_event_the_guard_journaled_once_it_is_stored() -> None:
    store = InMemoryEffectStore()
    hook = Hooked(store)
    charge = guarded(effect_guard=EffectGuard(store=store, on_event=hook), allowed_tools=["charge"])
    call(charge, "e1", "acct_1", 5)
    call(charge, "e1", "acct_1", 5)
    charge.failures.append("timeout")
    with pytest.raises(TimeoutError):
        call(charge, "e2", "acct_1", 6)
    call(charge, "e2", "acct_1", 6)  # refused: in doubt
    assert telemetry.wait_for_events(60)
    assert [(e.call_id, e.kind) for e in hook.events] == [
        ("e1", "pending"), ("e1", "committed"), ("e1", "replayed"),
        ("e2", "pending"), ("e2", "unknown"), ("e2", "refused")]
    assert all(hook.stored)
    assert hook.events[-1].reason is not None and hook.events[-1].reason["code"] == "effect_status_unknown"
    assert [(e.kind, e.call_id) for e in store.events()] == [(e.kind, e.call_id) for e in hook.events]


def test_on_event_runs_off_the_tools_path() -> None:
    gate, entered = threading.Event(), threading.Event()
    waited: list[bool] = []

    def slow_hook(event: EffectEvent) -> None:
        entered.set()
        waited.append(gate.wait(120))  # False if the call below could only return once this gave up

    charge = guarded(effect_guard=EffectGuard(on_event=slow_hook))
    assert call(charge, "s1", "acct_1", 5) == {"charge_id": "ch_1", "cents": 5}
    assert charge.runs == [("acct_1", 5)]  # the tool ran and the caller has its value, the hook still waiting
    assert entered.wait(60) and not gate.is_set()
    gate.set()
    assert telemetry.wait_for_events(60)
    assert waited == [True, True]  # pending and committed, each hook released by the test, none timed out


def test_a_hook_that_raises_is_logged_and_the_calls_go_on(caplog: pytest.LogCaptureFixture) -> None:
    seen: list[str] = []

    def broken(event: EffectEvent) -> None:
        seen.append(event.kind)
        if event.kind == "pending":
            raise RuntimeError("webhook down")

    charge = guarded(effect_guard=EffectGuard(on_event=broken))
    with caplog.at_level(logging.ERROR, logger="guard"):
        assert call(charge, "x1", "acct_1", 5) == {"charge_id": "ch_1", "cents": 5}
        assert call(charge, "x1", "acct_1", 5) == {"charge_id": "ch_1", "cents": 5}
        assert telemetry.wait_for_events(60)
    assert seen == ["pending", "committed", "replayed"]
    logged = [r for r in caplog.records if r.name == "guard" and "on_event hook" in r.getMessage()]
    assert len(logged) == 1 and "pending" in logged[0].getMessage() and "x1" in logged[0].getMessage()
    assert logged[0].exc_info is not None and "webhook down" in str(logged[0].exc_info[1])


def test_wait_for_events_from_a_hook_is_an_error_not_a_deadlock() -> None:
    errors: list[BaseException] = []

    def waits(event: EffectEvent) -> None:
        try:
            telemetry.wait_for_events(1)
        except RuntimeError as e:
            errors.append(e)

    call(guarded(effect_guard=EffectGuard(on_event=waits)), "w1", "acct_1", 5)
    assert telemetry.wait_for_events(60)
    assert len(errors) == 2 and "on_event hook" in str(errors[0])


def test_a_forked_child_delivers_its_own_events_and_not_its_parents(tmp_path: Path) -> None:
    gate = threading.Event()
    seen: list[tuple[int, str, str | None]] = []

    def hook(event: EffectEvent) -> None:
        gate.wait(60)  # the parent's events wait in the queue while the child is forked
        seen.append((os.getpid(), event.kind, event.call_id))

    charge = guarded(effect_guard=EffectGuard(on_event=hook))
    call(charge, "parent-1", "acct_1", 5)
    report = tmp_path / "child.txt"
    pid = os.fork()
    if pid == 0:  # the child: its hooks' thread is its own, and only its own events go through it
        code = 1
        try:
            gate.set()
            call(charge, "child-1", "acct_2", 6)
            delivered = telemetry.wait_for_events(60)
            report.write_text(repr((delivered, [(kind, call_id) for who, kind, call_id in seen if who == os.getpid()])))
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    gate.set()
    assert telemetry.wait_for_events(60)
    assert report.read_text() == repr((True, [("pending", "child-1"), ("committed", "child-1")]))
    assert seen == [(os.getpid(), "pending", "parent-1"), (os.getpid(), "committed", "parent-1")]


def test_on_event_with_a_journal_sees_the_event_in_the_file(tmp_path: Path) -> None:
    path = tmp_path / "hooked.db"
    kinds_in_file: list[list[str]] = []
    with SQLiteJournal(path) as journal:

        def hook(event: EffectEvent) -> None:
            with SQLiteJournal(path, readonly=True) as reader:  # another connection: it is committed
                kinds_in_file.append([e.kind for e in reader.call_events(str(event.call_id))])

        call(guarded(journal, effect_guard=EffectGuard(store=journal, on_event=hook)), "j1", "acct_1", 5)
        assert telemetry.wait_for_events(60)
    assert kinds_in_file[0][0] == "pending" and kinds_in_file[1] == ["pending", "committed"]


class Webhook(http.server.BaseHTTPRequestHandler):
    received: ClassVar[list[Any]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        Webhook.received.append((self.headers["Content-Type"], orjson.loads(body)))
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


def test_the_documented_webhook_hook_pages_when_a_call_becomes_unknown() -> None:
    page = (ROOT / "docs" / "observability.md").read_text()
    example = page.split("## Paging on a call in doubt", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Webhook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    Webhook.received.clear()
    try:
        namespace: dict[str, Any] = {}
        exec(compile(example, "docs/observability.md", "exec"), namespace)
        namespace["WEBHOOK_URL"] = f"http://127.0.0.1:{server.server_address[1]}/page"
        charge = guarded(effect_guard=EffectGuard(on_event=namespace["page_when_in_doubt"]))
        call(charge, "ok-1", "acct_1", 5)
        charge.failures.append("timeout")
        with pytest.raises(TimeoutError):
            call(charge, "lost-1", "acct_2", 700)
        assert telemetry.wait_for_events(60)
    finally:
        server.shutdown()
        server.server_close()
    assert len(Webhook.received) == 1
    content_type, message = Webhook.received[0]
    assert content_type == "application/json"
    assert message["call_id"] == "lost-1" and message["tool"] == "charge" and "TimeoutError" in message["text"]


# -- without OpenTelemetry -----------------------------------------------------------------------

_WITHOUT = textwrap.dedent(
    """
    import sys
    {block}
    from guard import Airlock, AirlockContext, SecurityPolicy
    from guard import telemetry
    from guard.effect_guard import EffectGuard

    events = []

    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(on_event=events.append)))
    def charge(account, cents):
        return {{"cents": cents}}

    before = sorted(m for m in sys.modules if m.split(".")[0] == "opentelemetry" and sys.modules[m] is not None)
    with AirlockContext(metadata={{"tool_call_id": "c1"}}):
        first = charge("acct_1", 5)
        again = charge("acct_1", 5)
    telemetry.wait_for_events(60)
    after = sorted(m for m in sys.modules if m.split(".")[0] == "opentelemetry" and sys.modules[m] is not None)
    print(first == again == {{"cents": 5}}, telemetry.is_enabled(), before, after, [e.kind for e in events])
    """
)

_BLOCKER = """
class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "opentelemetry":
            raise ImportError(f"No module named {name!r} (blocked)")
        return None

sys.meta_path.insert(0, Blocker())
"""


@pytest.mark.parametrize("block", [
    pytest.param("sys.modules['opentelemetry'] = None", id="modules-none"),
    pytest.param(_BLOCKER, id="meta-path-blocker"),
])
def test_without_opentelemetry_nothing_is_imported_and_calls_are_the_same(block: str) -> None:
    done = subprocess.run([sys.executable, "-c", _WITHOUT.format(block=block)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split(" ", 2)[:2] == ["True", "False"]  # the calls' values, and tracing off
    assert done.stdout.rstrip().endswith("[] [] ['pending', 'committed', 'replayed']")
    assert "Traceback" not in done.stderr


def test_with_the_api_and_no_sdk_a_call_is_untraced_and_imports_only_the_api() -> None:
    done = subprocess.run([sys.executable, "-c", _WITHOUT.format(block="")], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    ok, enabled, rest = done.stdout.split(" ", 2)
    assert (ok, enabled) == ("True", "True")
    assert rest.startswith("[] [")  # nothing of OpenTelemetry before the first guarded call
    assert "'opentelemetry.trace'" in rest and "opentelemetry.sdk" not in rest


_LATE_SDK = textwrap.dedent(
    """
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from guard import Airlock, AirlockContext, SecurityPolicy
    from guard.effect_guard import EffectGuard

    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard()))
    def charge(account, cents):
        return cents

    with AirlockContext(metadata={"tool_call_id": "before"}):
        charge("acct_1", 5)
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    with AirlockContext(metadata={"tool_call_id": "after"}):
        charge("acct_1", 6)
    print([(s.name, s.attributes["airlock.call_id"]) for s in exporter.get_finished_spans()])
    """
)


def test_a_host_that_sets_up_the_sdk_after_the_first_call_is_traced_from_then_on() -> None:
    done = subprocess.run([sys.executable, "-c", _LATE_SDK], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[('airlock charge', 'after')]"


def test_the_benchmark_prints_a_ratio_for_each_provider_and_store() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "otel_bench.py"), "--rounds", "1",
                           "--calls", "400", "--sqlite-calls", "40"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 5 and lines[0].startswith("fresh guarded call, 1 rounds")
    for line, (provider, store) in zip(lines[1:], [("no-op provider", "in-memory store"),
                                                   ("no-op provider", 'SQLite, durability="process"'),
                                                   ("SDK provider", "in-memory store"),
                                                   ("SDK provider", 'SQLite, durability="process"')], strict=True):
        assert line.split()[:2] == provider.split() and store in line and " ratio " in line
    assert lines[1].endswith("target < 1.05x") and lines[3].endswith("x)")  # the target is the no-op's


def test_the_benchmark_refuses_a_size_below_one() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "otel_bench.py"), "--rounds", "0"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--rounds is a number, 1 or more" in done.stderr
