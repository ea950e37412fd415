"""What the guard tells the outside: an OpenTelemetry span and metrics for each guarded call, and the
``on_event`` hook of :class:`~guard.effect_guard.EffectGuard`.

OpenTelemetry is optional (the extra ``otel``, ``opentelemetry-api`` only). Nothing of it is imported
before the first guarded call; where it cannot be imported then, the guard turns :data:`on` off and
each later call pays one check of that flag. With the API and no SDK configured by the host, a call
reads whether a provider has been set, and does nothing more; see docs/observability.md.

Each guarded call makes one span, ``airlock <tool>``, a child of the host's current span and the
parent of whatever the tool does, with the attributes ``airlock.tool``, ``airlock.call_id``,
``airlock.agent_id``, ``airlock.outcome``, ``airlock.block_reason`` and ``airlock.attempt``; it adds
one to the counter ``airlock.calls`` (by tool and outcome) and records the time the call spent in
its store in the histogram ``airlock.store.duration`` (seconds).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from collections.abc import Awaitable, Callable, Mapping
from queue import SimpleQueue
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from .canonical import storable

if TYPE_CHECKING:
    from contextvars import Token

    from opentelemetry.context import Context
    from opentelemetry.metrics import Counter, Histogram
    from opentelemetry.trace import Span, Tracer

    from .store import EffectEvent

__all__ = [
    "CALLS",
    "EXIT_WAIT",
    "OUTCOMES",
    "SCOPE",
    "STORE_DURATION",
    "TracedCall",
    "atraced",
    "deliver",
    "is_enabled",
    "set_enabled",
    "traced",
    "wait_for_events",
]

log = logging.getLogger("guard")
T = TypeVar("T")

#: The instrumentation scope of the tracer and the meter.
SCOPE = "airlock-journal"
#: The counter of guarded calls, by ``airlock.tool`` and ``airlock.outcome``.
CALLS = "airlock.calls"
#: The histogram of the seconds a call spent in its store (begin and appends), by tool and outcome.
STORE_DURATION = "airlock.store.duration"
#: What ``airlock.outcome`` says of a call.
OUTCOMES = ("committed", "replayed", "refused", "unknown", "released")

# Store times are milliseconds for a local journal and up to the busy deadline (seconds) under
# contention; the API's default buckets are made for milliseconds counted as whole numbers.
_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
            1.0, 2.5, 5.0, 10.0, 30.0)

#: Whether guarded calls are traced: read once per call. False once OpenTelemetry was found missing
#: (at the first guarded call) or after ``set_enabled(False)``.
on = True
_wanted = True  # what set_enabled last asked for
_missing = False  # the import of opentelemetry failed: it stays off whatever is asked
_instruments: _Instruments | None = None
_load_lock = threading.Lock()
# The API's modules that hold the providers a host sets (None until then), once loaded and only if
# they still keep them there: the fast path of a call when no SDK is configured reads them directly.
_trace_api: Any = None
_metrics_api: Any = None
_Begun = tuple["_Instruments", "Span", "Token[Context] | None"]


def set_enabled(enabled: bool) -> None:
    """Turn the spans and metrics of guarded calls on or off for this process (on by default,
    where OpenTelemetry can be imported). ``on_event`` hooks are not affected."""
    global on, _wanted
    _wanted = bool(enabled)
    on = _wanted and not _missing


def is_enabled() -> bool:
    """Whether guarded calls are traced now (False when OpenTelemetry cannot be imported, once a
    guarded call has found that out, or after ``set_enabled(False)``)."""
    return on


class TracedCall(Protocol):
    """What a span reads of one guarded call (a :class:`~guard.call.GuardedCall`)."""

    tool_call_id: str | None
    agent_id: str | None
    attempt: int
    code: str | None  # the refusal's code, when the call was refused
    kind: str | None  # the outcome it recorded (or would have, unguarded), when the tool ran
    store_seconds: float | None  # None while untraced

    @property
    def tool_name(self) -> str: ...

    @property
    def replayed(self) -> bool: ...


class _Instruments:
    """The tracer and meter's instruments, and the few API functions a call uses, looked up once."""

    def __init__(self) -> None:
        from opentelemetry import context, metrics, trace
        from opentelemetry.trace import INVALID_SPAN, Status, StatusCode

        self.tracer: Tracer = trace.get_tracer(SCOPE)
        meter = metrics.get_meter(SCOPE)
        self.calls: Counter = meter.create_counter(
            CALLS, unit="{call}", description="Guarded tool calls, by tool and outcome.")
        self.duration: Histogram = meter.create_histogram(
            STORE_DURATION, unit="s", description="Time a guarded call spent in its effect store.",
            explicit_bucket_boundaries_advisory=list(_BUCKETS))
        self.invalid = INVALID_SPAN
        # Where the API keeps the providers the host set (None until it sets one); a later API that
        # keeps them elsewhere only costs the fast path below, never a span.
        self.trace_api: Any = trace
        try:
            from opentelemetry.metrics import _internal as metrics_api
        except ImportError:
            self.metrics_api: Any = None
        else:
            self.metrics_api = metrics_api
        self.noop_providers = (trace.NoOpTracerProvider, metrics.NoOpMeterProvider)
        self.settled: bool | None = None  # idle() for good, once both providers are set
        self.in_context = trace.set_span_in_context
        self.attach = context.attach
        self.detach = context.detach
        self.status = Status
        self.error = StatusCode.ERROR
        # The attributes of the counter, one mapping per tool and outcome, made once.
        self.labels: dict[tuple[str, str], Mapping[str, str]] = {}

    def idle(self) -> bool:
        """True while no SDK is configured (no provider set, or the API's no-op ones): then a span
        and a count would go nowhere, and a call is run without them."""
        settled = self.settled
        if settled is not None:
            return settled
        tracers = getattr(self.trace_api, "_TRACER_PROVIDER", self)
        meters = getattr(self.metrics_api, "_METER_PROVIDER", self)
        noop_tracers, noop_meters = self.noop_providers
        idle = (tracers is None or type(tracers) is noop_tracers) and (meters is None or type(meters) is noop_meters)
        if tracers is not None and meters is not None:  # each is set once: the answer stays
            self.settled = idle
        return idle

    def start(self, call: TracedCall) -> tuple[Span, Token[Context] | None]:
        """Start the call's span under the current one; make it current unless it is the no-op span."""
        name = call.tool_name
        attributes = {"airlock.tool": name}
        # The ids may come from the model: as the journal keeps them (a lone surrogate escaped), which
        # an exporter can encode.
        if call.tool_call_id is not None:
            attributes["airlock.call_id"] = storable(call.tool_call_id)
        if call.agent_id is not None:
            attributes["airlock.agent_id"] = storable(call.agent_id)
        span = self.tracer.start_span(f"airlock {name}", attributes=attributes)
        token: Token[Context] | None = None
        if span is not self.invalid:
            # Under the no-op provider the span is the host's own, or none: nothing to make current.
            token = self.attach(self.in_context(span))
        call.store_seconds = 0.0
        return span, token

    def finish(self, call: TracedCall, span: Span, token: Token[Context] | None, exc: BaseException | None) -> None:
        """End the span with the call's outcome, and count the call."""
        if token is not None:
            self.detach(token)
        name = call.tool_name
        code = call.code
        if code is not None:
            outcome = "refused"
        elif call.kind is not None:
            outcome = call.kind
        elif call.replayed:
            outcome = "replayed"
        elif exc is not None:  # left before the guard could say (cancelled while it waited for its store)
            outcome = "released" if isinstance(exc, Exception) else "unknown"
        else:
            outcome = "committed"
        if span.is_recording():
            attributes: dict[str, str | int] = {"airlock.outcome": outcome, "airlock.attempt": call.attempt}
            if code is not None:
                attributes["airlock.block_reason"] = code
                span.set_status(self.status(self.error, f"refused: {code}"))
            elif exc is not None:
                span.record_exception(exc)
                span.set_status(self.status(self.error, _described(exc)))
            span.set_attributes(attributes)
        span.end()
        labels = self.labels.get((name, outcome))
        if labels is None:
            labels = self.labels[(name, outcome)] = {"airlock.tool": name, "airlock.outcome": outcome}
        self.calls.add(1, labels)
        seconds = call.store_seconds
        if seconds:  # a call that never reached a store (no effect guard, or an unkeyed call) has no store time
            self.duration.record(seconds, labels)


def _described(exc: BaseException) -> str:
    """``Type: message`` of an exception, even one whose ``__str__`` fails."""
    try:
        text = str(exc)
    except Exception:
        text = "<unprintable>"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _load() -> _Instruments | None:
    """The instruments, made at the first traced call; None (and tracing off) where OpenTelemetry
    cannot be imported."""
    global _instruments, _missing, on, _trace_api, _metrics_api
    with _load_lock:
        if _instruments is None and not _missing:
            try:
                _instruments = instruments = _Instruments()
            except ImportError as e:
                _missing, on = True, False
                log.debug("OpenTelemetry is not importable (%s): guarded calls are not traced", e)
            else:
                apis = instruments.trace_api, instruments.metrics_api
                if hasattr(apis[0], "_TRACER_PROVIDER") and hasattr(apis[1], "_METER_PROVIDER"):
                    _trace_api, _metrics_api = apis
    return _instruments


def _begun(call: TracedCall) -> _Begun | None:
    instruments = _instruments if _instruments is not None else _load()
    if instruments is None or instruments.idle():
        return None
    try:
        span, token = instruments.start(call)
    except Exception:  # a failing SDK never fails the call
        log.exception("could not start the span of a call to %s", call.tool_name)
        return None
    return instruments, span, token


def _ended(begun: _Begun, call: TracedCall, exc: BaseException | None) -> None:
    try:
        begun[0].finish(call, begun[1], begun[2], exc)
    except Exception:
        log.exception("could not end the span of a call to %s", call.tool_name)


def traced(call: TracedCall, run: Callable[[Any, tuple[Any, ...], dict[str, Any]], T],
           args: tuple[Any, ...], kwargs: dict[str, Any]) -> T:
    """``run(call, args, kwargs)`` (a guarded ``def`` call) inside the call's span."""
    if _trace_api is not None and _trace_api._TRACER_PROVIDER is None and _metrics_api._METER_PROVIDER is None:
        return run(call, args, kwargs)  # no SDK configured yet: nothing would be recorded
    begun = _begun(call)
    if begun is None:
        return run(call, args, kwargs)
    try:
        result = run(call, args, kwargs)
    except BaseException as e:
        _ended(begun, call, e)
        raise
    _ended(begun, call, None)
    return result


async def atraced(call: TracedCall, run: Callable[[Any, tuple[Any, ...], dict[str, Any]], Awaitable[T]],
                  args: tuple[Any, ...], kwargs: dict[str, Any]) -> T:
    """``await run(call, args, kwargs)`` (a guarded ``async def`` call) inside the call's span."""
    if _trace_api is not None and _trace_api._TRACER_PROVIDER is None and _metrics_api._METER_PROVIDER is None:
        return await run(call, args, kwargs)  # no SDK configured yet: nothing would be recorded
    begun = _begun(call)
    if begun is None:
        return await run(call, args, kwargs)
    try:
        result = await run(call, args, kwargs)
    except BaseException as e:
        _ended(begun, call, e)
        raise
    _ended(begun, call, None)
    return result


# -- on_event ------------------------------------------------------------------------------------
#
# Hooks run on one daemon thread of this process, in the order the events came (for one call, the
# order they were stored). Handing an event over is a put on a queue, so a slow hook (a webhook)
# never delays a tool nor its caller.

_Item = tuple[Callable[["EffectEvent"], Any], "EffectEvent"] | threading.Event
_queue: SimpleQueue[_Item] = SimpleQueue()
_worker: threading.Thread | None = None
_worker_lock = threading.Lock()
#: At exit, how long the process waits for the hooks of events already stored.
EXIT_WAIT = 5.0


def deliver(hook: Callable[[EffectEvent], Any], event: EffectEvent) -> None:
    """Hand ``event`` (stored) to ``hook`` on the hooks' thread; returns at once."""
    _queue.put((hook, event))
    if _worker is None:
        try:
            _start_worker()
        except Exception as e:  # no thread to be had: the event waits for the next try, the call goes on
            log.error("could not start the thread of the on_event hooks: %r", e)


def _start_worker() -> None:
    global _worker
    with _worker_lock:
        if _worker is None:
            worker = threading.Thread(target=_run_hooks, args=(_queue,), name="airlock-on-event", daemon=True)
            worker.start()
            _worker = worker


def _run_hooks(queue: SimpleQueue[_Item]) -> None:
    while True:
        item = queue.get()
        if isinstance(item, threading.Event):
            item.set()
            continue
        hook, event = item
        try:
            hook(event)
        except BaseException:  # a hook never stops the hooks after it
            log.exception("on_event hook %r raised on the %s event of call %s (attempt %s)",
                          hook, event.kind, event.call_id, event.attempt)
        del item, hook, event  # not kept alive while the thread waits for the next one


def wait_for_events(timeout: float | None = None) -> bool:
    """Wait until every event handed to an ``on_event`` hook so far has been through its hook.

    Returns False if ``timeout`` (seconds) ran out first. Raises ``RuntimeError`` from a hook
    itself, which would wait for its own return.
    """
    worker = _worker
    if worker is None:
        return True
    if threading.current_thread() is worker:
        raise RuntimeError("wait_for_events() cannot be called from an on_event hook")
    reached = threading.Event()
    _queue.put(reached)
    return reached.wait(timeout)


def _at_exit() -> None:
    if _worker is not None and not wait_for_events(EXIT_WAIT):
        log.warning("on_event hooks did not finish within %s s of exit; the events left were not delivered",
                    EXIT_WAIT)


def _forked() -> None:
    # The child has no hooks' thread, and the events queued in the parent are the parent's to deliver.
    global _queue, _worker, _worker_lock
    _queue, _worker, _worker_lock = SimpleQueue(), None, threading.Lock()


atexit.register(_at_exit)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)
