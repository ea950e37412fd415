"""Archiving while processes make guarded calls, and archiving killed (SIGKILL) at random moments:
no event is lost or duplicated, archives and journal verify as one chain every time, and no call
runs twice."""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import subprocess
import time
from collections import Counter
from contextlib import suppress
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
import pytest

from guard import Airlock, AirlockContext, SecurityPolicy
from guard.effect_guard import EffectGuard
from journal import open_journal
from tests.cli_support import AIRLOCK, ROOT, invoke
from tests.journals import Database, JournalFactory

WORKERS = 3
CALLS = 150  # fresh calls a worker makes; it also retries each of them once, later


def _work(target: str, options: dict[str, Any], worker: int, ran_file: str, start: Any, done: Any) -> None:
    """One process of the agent: CALLS fresh calls, and a retry of each a few calls later; every run
    of the tool is written to ``ran_file`` (O_APPEND, one line each) before it returns."""
    journal = open_journal(target, **options)
    fd = os.open(ran_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=journal)))
    def charge(call: str) -> dict[str, str]:
        os.write(fd, f"{call}\n".encode())
        return {"charged": call}

    start.wait()
    results = []
    for n in range(CALLS + 5):
        for call in ([f"w{worker}-{n}"] if n < CALLS else []) + ([f"w{worker}-{n - 5}"] if n >= 5 else []):
            with AirlockContext(agent_id=f"agent-{worker}", metadata={"tool_call_id": call}):
                results.append(charge(call) == {"charged": call})
    journal.close()
    os.close(fd)
    done.put((worker, all(results), len(results)))


def _archive_now(target: str, output: Path) -> bool:
    result = invoke("journal", "archive", "--db", target, "--before", datetime.now(UTC).isoformat(),
                    "-o", str(output))
    assert result.exit_code == 0, result.output
    return result.stdout.startswith("Archived")


@pytest.fixture
def target(journal_kind: JournalFactory, tmp_path: Path) -> str:
    """An empty journal of every store (tests/conftest.py), made: a file, or a database of its own."""
    target = journal_kind.target(tmp_path, own_database=True)
    journal_kind.open(target).close()
    return target


def test_archive_under_concurrent_guarded_calls_loses_and_duplicates_nothing(journal_kind: JournalFactory, target: str,
                                                                            tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    start, done = ctx.Event(), ctx.Queue()
    ran = [tmp_path / f"ran-{w}.txt" for w in range(WORKERS)]
    options = dict(journal_kind.quick)
    procs = [ctx.Process(target=_work, args=(target, options, w, str(ran[w]), start, done)) for w in range(WORKERS)]
    for proc in procs:
        proc.start()
    archives: list[Path] = []
    try:
        start.set()
        while any(proc.is_alive() for proc in procs):
            output = tmp_path / f"a{len(archives) + 1}.jsonl"
            if _archive_now(target, output):
                archives.append(output)
        finished = [done.get(timeout=120) for _ in procs]
    finally:
        for proc in procs:
            proc.join(timeout=120)
            if proc.is_alive():
                proc.kill()
    assert all(ok for _, ok, _ in finished), finished
    output = tmp_path / f"a{len(archives) + 1}.jsonl"
    if _archive_now(target, output):
        archives.append(output)
    assert len(archives) >= 2  # archived while the workers called, and after

    # Each call ran once: no run lost (every fresh call ran), none repeated (no retry ran).
    runs = Counter(line for f in ran for line in f.read_text().splitlines())
    assert runs == Counter(f"w{w}-{n}" for w in range(WORKERS) for n in range(CALLS))

    # Archives and journal hold every event once, in one chain.
    with open_journal(target, readonly=True) as journal:
        head = journal.head()
        kept = [e.export() for e in journal.events()]
        assert journal.verify().ok
    lines = [orjson.loads(line) for a in archives for line in a.read_bytes().splitlines()] + kept
    assert [line["seq"] for line in lines] == list(range(1, head[0] + 1))
    args = [arg for a in archives for arg in ("--export", str(a))]
    checked = invoke("journal", "verify", *args, "--db", target)
    assert checked.exit_code == 0 and checked.stdout == f"OK: {head[0]} events, head {head[1]}\n", checked.output
    kinds = Counter((line["call_id"], line["kind"]) for line in lines)
    for w in range(WORKERS):
        for n in range(CALLS):
            call = f"w{w}-{n}"
            assert (kinds[call, "pending"], kinds[call, "committed"], kinds[call, "replayed"]) == (1, 1, 1), call


# -- killed at random moments ---------------------------------------------------------------------

RUNS = 14
BATCHES = RUNS + 2
CALLS_A_BATCH = 120


def _seeded(made: JournalFactory, target: str) -> list[str]:
    """A journal of BATCHES batches of guarded calls with large arguments; returns a cut time after
    each batch (an archive before cut k takes the first k batches)."""
    cuts = []
    with made.open(target, **made.quick) as journal:

        @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=journal)))
        def charge(note: str, cents: int) -> int:
            return cents

        for batch in range(BATCHES):
            for n in range(CALLS_A_BATCH):
                with AirlockContext(metadata={"tool_call_id": f"b{batch}-{n}"}):
                    charge("x" * 3000, n)
            time.sleep(0.002)
            cuts.append(datetime.now(UTC).isoformat())
    return cuts


def _committed(database: Database) -> list[Path]:
    """The archive files the journal records, oldest first (read with a connection of its own)."""
    return [Path(f) for (f,) in database.rows("SELECT file FROM archives ORDER BY last_seq")]


def _opened_output(pid: int, directory: Path) -> bool:
    """Whether process ``pid`` has a file of ``directory`` open other than the journal's (its archive)."""
    try:
        links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
    except OSError:
        return False
    return any(link.startswith(str(directory) + "/") and "journal.db" not in link for link in links)


def _run_and_kill(command: list[str], directory: Path, kill_at: tuple[bool, float] | None) -> tuple[float, float]:
    """Run ``command``; with ``kill_at`` (after it opened its archive file?, seconds), SIGKILL it at
    that moment unless it has finished first. Returns how long it took to open its archive file
    and to finish (or be killed)."""
    started = time.monotonic()
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    opened = 0.0
    try:
        if kill_at is None or kill_at[0]:
            deadline = started + 120
            while not _opened_output(proc.pid, directory) and proc.poll() is None:
                assert time.monotonic() < deadline, "the archive never began to write"
                time.sleep(0.0005)
            opened = time.monotonic() - started
        if kill_at is not None:
            with suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=kill_at[1])
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=120)
        problem = proc.stderr.read() if proc.stderr is not None else b""
        if proc.stderr is not None:
            proc.stderr.close()
    assert proc.returncode in (0, -signal.SIGKILL), problem
    return opened, time.monotonic() - started


@pytest.fixture
def two_journals(journal_kind: JournalFactory, tmp_path: Path) -> tuple[str, str]:
    """An empty journal to archive, and one to time a run on, of one store (each in turn)."""
    (tmp_path / "reference").mkdir()
    return (journal_kind.target(tmp_path, own_database=True),
            journal_kind.target(tmp_path / "reference", own_database=True))


@pytest.mark.slow
def test_an_archive_killed_at_any_moment_leaves_one_chain(journal_kind: JournalFactory, two_journals: tuple[str, str],
                                                          tmp_path: Path) -> None:
    target, reference = two_journals
    database = journal_kind.database(target)
    archives = tmp_path / "archives"
    archives.mkdir()
    cuts = _seeded(journal_kind, target)
    with open_journal(target, readonly=True) as journal:
        head = journal.head()
    rng = random.Random(int.from_bytes(os.urandom(4), "big"))
    # How long a whole run takes on this machine, and its writing, to spread the kills over:
    # measured on a journal of its own.
    timing = tmp_path / "timing"
    timing.mkdir()
    opened, total = _run_and_kill([AIRLOCK, "journal", "archive", "--db", reference, "--before",
                                   _seeded(journal_kind, reference)[0], "-o", str(timing / "a.jsonl")], timing, None)
    writing = max(total - opened, 0.001)

    cut, killed = 0, 0
    for run in range(RUNS):
        output = archives / f"a{run}.jsonl"
        command = [AIRLOCK, "journal", "archive", "--db", target, "--before", cuts[cut], "-o", str(output)]
        # Half the runs are killed at any moment of their run, half while they write or commit.
        after_open = rng.random() < 0.5
        moment = rng.uniform(0, writing * 1.2) if after_open else rng.uniform(0, total * 1.1)
        before = len(_committed(database))
        _run_and_kill(command, archives, (after_open, moment))
        committed = _committed(database)
        killed += len(committed) == before
        # Never a partial file; an archive file is complete whether or not the journal let go of its events.
        assert sorted(p.name for p in archives.iterdir() if not p.name.startswith("a")) == []
        for stray in sorted(set(archives.glob("a*.jsonl")) - set(committed)):
            alone = invoke("journal", "verify", "--export", str(stray), "--allow-gaps")
            assert alone.exit_code == 0, alone.output
            stray.unlink()  # written, but the journal kept its events: an operator removes it
        assert all(a.exists() for a in committed)
        args = [arg for a in committed for arg in ("--export", str(a))]
        checked = invoke("journal", "verify", *args, "--db", target)
        assert checked.exit_code == 0, (run, checked.output)
        assert checked.stdout == f"OK: {head[0]} events, head {head[1]}\n"
        cut = min(len(committed), len(cuts) - 1)
    assert killed  # at least one run was stopped before its commit (the others commit, killed or not)
    with open_journal(target, readonly=True) as journal:
        assert journal.verify().ok
