"""What the OpenTelemetry instrumentation costs a fresh guarded call, as a ratio against the same call
with telemetry off, in one process.

    python benchmarks/otel_bench.py [--calls 20000] [--sqlite-calls 2000] [--rounds 9]

Two stores: the in-memory one, and a SQLite journal at durability="process" (in a temporary
directory). Two providers: first the API's no-op one (no SDK configured: what a host that installs
the extra, or a package that depends on the API, and sets up nothing pays), then the SDK's, with a
batch span processor whose exporter drops the spans and an in-memory metric reader. Telemetry off is
``guard.telemetry.set_enabled(False)``: the same single check per call as a process without
OpenTelemetry. Each round makes fresh calls on two fresh stores, one with telemetry off and one on,
in short blocks that alternate between them, so that machine noise hits both alike. The ratio is of
the best block of each (the least disturbed, as timeit takes its best run); the median of the ratios
of blocks made back to back is printed beside it.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from guard import Airlock, AirlockContext, SecurityPolicy, telemetry
from guard.effect_guard import EffectGuard, InMemoryEffectStore
from journal import SQLiteJournal

NOOP_TARGET = 1.05


def charge(account: str, cents: int) -> dict[str, object]:
    return {"charge_id": "ch_1", "account": account, "cents": cents}


def per_call(fn: Callable[..., object], contexts: Sequence[AirlockContext]) -> float:
    """CPU seconds of this thread for ``fn("acct_1", 500)`` once in each context (a fresh id each).

    CPU time, not wall time: the time the thread spent waiting for a core of a loaded machine is not
    the guard's. (A store's own threads, and the SDK's export thread, are not counted: they are off
    the call's path.)"""
    start = time.thread_time()
    for ctx in contexts:
        with ctx:
            fn("acct_1", 500)
    return time.thread_time() - start


def one_round(make_store: Callable[[str], Any], calls: int, block: int, label: str
              ) -> tuple[list[float], list[float]]:
    """One round: a fresh store with telemetry off and one with it on, ``calls`` fresh calls each,
    made in blocks that alternate between the two so that both see the same machine. Returns the
    microseconds per call of each block, off and on."""
    stores = {enabled: make_store(f"{label}-{'on' if enabled else 'off'}") for enabled in (False, True)}
    try:
        tools = {enabled: Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=store)))(charge)
                 for enabled, store in stores.items()}
        for enabled, tool in tools.items():  # the first call of a process loads the instruments
            with AirlockContext(metadata={"tool_call_id": f"{label}-{enabled}-warm"}):
                tool("acct_1", 1)
        contexts = {enabled: [AirlockContext(agent_id="bench", metadata={"tool_call_id": f"{label}-{enabled}-{i}"})
                              for i in range(calls)] for enabled in (False, True)}
        blocks: dict[bool, list[float]] = {False: [], True: []}
        gc.collect()
        for b, first in enumerate(range(0, calls, block)):
            for enabled in ((False, True) if b % 2 == 0 else (True, False)):
                telemetry.set_enabled(enabled)
                part = contexts[enabled][first:first + block]
                blocks[enabled].append(per_call(tools[enabled], part) / len(part) * 1e6)
        telemetry.set_enabled(True)
        return blocks[False], blocks[True]
    finally:
        for store in stores.values():
            close = getattr(store, "close", None)
            if close is not None:
                close()


def compare(make_store: Callable[[str], Any], calls: int, block: int, rounds: int, tag: str
            ) -> tuple[float, float, float, float]:
    """The best block's microseconds per call off and on, their ratio, and the median of the ratios
    of the blocks made back to back."""
    off: list[float] = []
    on: list[float] = []
    for r in range(rounds):
        a, b = one_round(make_store, calls, block, f"{tag}-r{r}")
        off.extend(a)
        on.extend(b)
    paired = statistics.median(b / a for a, b in zip(off, on, strict=True))
    return min(off), min(on), min(on) / min(off), paired


def set_up_sdk() -> None:
    """The SDK's providers, as a host that exports its traces and metrics sets them up."""
    from opentelemetry import metrics, trace
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    class Dropping(SpanExporter):
        def export(self, spans: Any) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(Dropping()))
    trace.set_tracer_provider(provider)
    metrics.set_meter_provider(MeterProvider(metric_readers=[InMemoryMetricReader()]))


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000, help="calls a round on the in-memory store")
    parser.add_argument("--sqlite-calls", type=int, default=2000, help="calls a round on the SQLite journal")
    parser.add_argument("--rounds", type=int, default=9)
    opts = parser.parse_args()
    for name in ("calls", "sqlite_calls", "rounds"):
        if getattr(opts, name) < 1:
            parser.error(f"--{name.replace('_', '-')} is a number, 1 or more")
    try:
        import opentelemetry.sdk  # noqa: F401
    except ImportError:
        parser.exit(1, "otel_bench.py needs opentelemetry-sdk: pip install -e '.[test]'\n")

    with tempfile.TemporaryDirectory(prefix="airlock-otel-bench-", dir="/var/tmp") as tmp:
        stores: list[tuple[str, Callable[[str], Any], int, int]] = [
            ("in-memory store", lambda label: InMemoryEffectStore(), opts.calls, 200),
            ('SQLite, durability="process"',
             lambda label: SQLiteJournal(Path(tmp) / f"{label}.db", durability="process"), opts.sqlite_calls, 20),
        ]
        print(f"fresh guarded call, {opts.rounds} rounds; best block's CPU time per call, telemetry off and on "
              "in one process; ratio = on / off")
        for provider in ("no-op provider", "SDK provider"):
            if provider == "SDK provider":
                set_up_sdk()
            for label, make_store, calls, block in stores:
                off, on, ratio, paired = compare(make_store, calls, block, opts.rounds,
                                                 f"{provider[:3]}-{label[:3]}")
                target = f"   target < {NOOP_TARGET:.2f}x" if provider == "no-op provider" else ""
                print(f"  {provider:<15} {label:<29} off {off:8.2f} us   on {on:8.2f} us   "
                      f"ratio {ratio:.3f}x   (median of paired blocks {paired:.3f}x){target}")
        # The SDK's batch processor exports from its own thread; nothing is left to wait for.
        from opentelemetry import trace

        shutdown = getattr(trace.get_tracer_provider(), "shutdown", None)
        if shutdown is not None:
            shutdown()


if __name__ == "__main__":
    main()
