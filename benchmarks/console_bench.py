"""How fast the operator console renders its pages on a large journal; prints figures, asserts nothing.

    .venv/bin/python benchmarks/console_bench.py                 # 1,000,000 events in a temporary file
    .venv/bin/python benchmarks/console_bench.py --quick         # 100,000 events: a check in seconds
    .venv/bin/python benchmarks/console_bench.py --db /tmp/big.db --keep   # seed once, measure again later

The journal is seeded as benchmarks/cli_bench.py seeds it (a bulk insert with the journal's own
hash chain, then ``rebuild``): 1,000,000 events are some 420,000 calls, 2% of them unknown and 1%
left pending by a process that is gone. Each page is then asked for through the console's ASGI app
in this process (the median of several requests, after one that compiles its templates: the
page's own time, as a warm server spends it), and through ``airlock journal serve`` in a process
of its own over HTTP (what a browser waits for on this machine). The targets are section 11's:
the calls page under 200 ms, a call's page under 50 ms.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx
from cli_bench import seed
from starlette.testclient import TestClient

from cli.console.app import create_app
from cli.console.state import Console
from journal import SQLiteJournal, open_journal

AIRLOCK = str(Path(sys.executable).with_name("airlock"))


def row(label: str, figure: str, target: str = "", verdict: bool | None = None) -> None:
    mark = "" if verdict is None else ("  ok" if verdict else "  MISSED")
    print(f"{label:<52} {figure:>12}   {target}{mark}", flush=True)


def median_ms(get: object, path: str, repeat: int) -> float:
    """The median time of ``repeat`` requests for ``path``, after one that warms the page up."""
    times = []
    for n in range(repeat + 1):
        began = time.perf_counter()
        answer = get(path)  # type: ignore[operator]
        elapsed = time.perf_counter() - began
        if answer.status_code != 200:
            sys.exit(f"GET {path} answered {answer.status_code}: {answer.text[:500]}")
        if n:
            times.append(elapsed)
    return statistics.median(times) * 1000


def pages(target: str) -> list[tuple[str, str, float | None]]:
    """(label, path, target in ms or None) of the pages measured, with ids from the journal."""
    with open_journal(target, readonly=True, create=False) as j:
        unknown = j.calls(status="unknown", limit=1)[0].call_id
        committed = j.calls(status="committed", limit=1)[0].call_id
        old = j.calls(status="committed", limit=1, offset=200_000)
        deep = (old or j.calls(status="committed", limit=1))[0].call_id
    return [
        ("calls page (newest 50)", "/calls", 200.0),
        ("calls page, status unknown", "/calls?status=unknown", 200.0),
        ("calls page, tool and agent", "/calls?tool=read_balance&agent=agent-3", 200.0),
        ("calls page, changed within 1d", "/calls?since=1d", 200.0),
        ("calls page, 100 a page from call 10,001", "/calls?offset=10000&limit=100", None),
        ("calls page, owner gone (reads every pending call)", "/calls?owner=gone", None),
        ("a call's page (unknown: 3 events)", f"/calls/{unknown}", 50.0),
        ("a call's page (newest committed)", f"/calls/{committed}", 50.0),
        ("a call's page (committed 200,000 calls back)", f"/calls/{deep}", 50.0),
        ("in doubt (every unknown and pending call)", "/in-doubt", None),
        ("approvals inbox", "/approvals", None),
        ("overview (stats, in doubt, head)", "/", None),
    ]


def in_process(target: str, repeat: int) -> None:
    journal = open_journal(target, readonly=True, create=False)
    console = Console(journal=journal, target=target)
    try:
        with TestClient(create_app(console), follow_redirects=False) as client:
            client.get(f"/?token={console.sessions.token}")
            print("The console's ASGI app in this process (median of "
                  f"{repeat} requests, after one that warms the page):")
            for label, path, goal in pages(target):
                took = median_ms(client.get, path, repeat)
                row(label, f"{took:.1f} ms", "" if goal is None else f"target < {goal:.0f} ms",
                    None if goal is None else took < goal)
    finally:
        journal.close()


def over_http(target: str, repeat: int) -> None:
    env = {k: v for k, v in os.environ.items() if k != "AIRLOCK_JOURNAL"}
    server = subprocess.Popen([AIRLOCK, "journal", "serve", "--db", target, "--port", "0"], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=env)
    try:
        assert server.stdout is not None
        url = None
        deadline = time.monotonic() + 120
        while url is None and time.monotonic() < deadline:
            line = server.stdout.readline()
            if not line:
                sys.exit(f"airlock journal serve ended (exit {server.wait(30)})")
            found = re.search(r"(http://\S+/\?token=\S+)", line)
            url = found.group(1) if found else None
        if url is None:
            sys.exit("airlock journal serve printed no URL in 120 s")
        base = url.split("/?token=")[0]
        with httpx.Client(base_url=base, follow_redirects=False, timeout=120) as client:
            client.get(url.removeprefix(base))
            print(f"\nairlock journal serve in its own process, over HTTP (median of {repeat} requests):")
            for label, path, goal in pages(target):
                if goal is None:
                    continue
                took = median_ms(client.get, path, repeat)
                row(label, f"{took:.1f} ms", f"target < {goal:.0f} ms", took < goal)
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--quick", action="store_const", const=100_000, dest="events",
                        help="100,000 events instead of 1,000,000")
    parser.add_argument("--db", type=Path,
                        help="journal file (seeded when it does not exist; default: a temporary one)")
    parser.add_argument("--keep", action="store_true", help="keep the journal seeded in --db")
    parser.add_argument("--repeat", type=int, default=15, help="requests per page (the median is shown)")
    options = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="airlock-console-bench-"))
    db = options.db or workdir / "bench.db"
    seeded_here = not db.exists()
    try:
        if seeded_here:
            began = time.perf_counter()
            seed(db, options.events)
            with SQLiteJournal(db, durability="process") as journal:
                calls = journal.rebuild()
            print(f"seeded {options.events:,} events ({calls:,} calls) in {time.perf_counter() - began:.1f} s")
        with SQLiteJournal(db, readonly=True) as journal:
            events, calls = journal.count_events(), journal.stats().calls
        print(f"journal {db} ({db.stat().st_size / 2**20:.0f} MiB): {events:,} events, {calls:,} calls\n")
        in_process(str(db), options.repeat)
        over_http(str(db), options.repeat)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        if seeded_here and options.db is not None and not options.keep:
            for leftover in db.parent.glob(db.name + "*"):
                leftover.unlink()


if __name__ == "__main__":
    main()
