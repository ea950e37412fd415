"""Archiving a SQLite journal in steps, with the projection as of the log's start kept
copy-on-write: a run killed (SIGKILL) between its steps leaves a journal that verifies and an
archive that holds every event it let go of, and the next run finishes it; several archives in a
row keep ``verify`` and ``rebuild`` right; an archived call retried through the guard never runs
again; and the archive keeps no second copy of the calls that did not move."""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import sys
import textwrap
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
import pytest

from journal import SQLiteJournal, archive_run, open_journal
from journal.sqlite.archives import unfinished as sqlite_unfinished
from tests.cli_support import ROOT, Tools, invoke, pending_with_live_owner, seed

# A process that archives the journal's events older than now, letting go of them in steps of
# STEP events, and kills itself (SIGKILL) once it has committed the number of steps it is given.
_KILLED_AFTER = textwrap.dedent(
    """
    import os, signal, sys
    from datetime import UTC, datetime
    from journal import SQLiteJournal
    from journal.archive import archive_lines, archive_steps, plan_archive

    path, output, steps, every = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    journal = SQLiteJournal(path)
    plan = plan_archive(journal, datetime.now(UTC))
    marks = []
    with open(output, "wb") as out:
        for chunk in archive_lines(journal, plan, marks, every):
            out.write(chunk)
        out.flush()
        os.fsync(out.fileno())
    for n, step in enumerate(archive_steps(plan, marks)):
        if n == steps:
            os.kill(os.getpid(), signal.SIGKILL)
        journal.commit_archive(step, output, "2026-12-01T00:00:00.000000Z")
    """
)


def _calls(journal: Tools, prefix: str, count: int) -> None:
    for n in range(count):
        journal.call(f"{prefix}-{n}", journal.charge, account=f"acct_{n % 7}", cents=n + 1)


def _filled(path: Path, count: int = 60) -> None:
    with open_journal(str(path)) as journal:
        _calls(Tools(journal), "early", count)


def _archive(path: Path, output: Path) -> Any:
    result = invoke("journal", "archive", "--db", str(path), "--before", datetime.now(UTC).isoformat(),
                    "-o", str(output))
    assert result.exit_code == 0, result.output
    return result


def _verify(*args: str) -> tuple[int, str]:
    result = invoke("journal", "verify", *args)
    return result.exit_code, result.stdout + result.stderr


def _kept(path: Path) -> list[str]:
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return [row[0] for row in conn.execute("SELECT call_id FROM calls_archived ORDER BY call_id")]
    finally:
        conn.close()


def _unfinished(path: Path) -> Any:
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return sqlite_unfinished(conn)
    finally:
        conn.close()


def _killed_after(path: Path, output: Path, steps: int, every: int = 10) -> None:
    done = subprocess.run([sys.executable, "-c", _KILLED_AFTER, str(path), str(output), str(steps), str(every)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr


@pytest.mark.parametrize("steps", [0, 1, 4])
def test_an_archive_killed_between_its_steps_is_finished_by_the_next(tmp_path: Path, steps: int) -> None:
    path, first = tmp_path / "journal.db", tmp_path / "a1.jsonl"
    _filled(path)
    with open_journal(str(path), readonly=True) as journal:
        head = journal.head()
    _killed_after(path, first, steps)
    lines = [orjson.loads(line) for line in first.read_bytes().splitlines()]
    assert [line["seq"] for line in lines] == list(range(1, head[0]))  # the archive is whole

    # The journal starts where the last step left it, verifies alone, and with the archive (which
    # also holds the events it has not let go of yet) as one chain.
    with open_journal(str(path), readonly=True) as journal:
        start = journal.archived_head()
        assert start[0] == steps * 10
        assert journal.verify().ok
        assert next(e.seq for e in journal.events()) == start[0] + 1
    assert _verify("--db", str(path)) == (0, f"OK: {head[0] - start[0]} events, head {head[1]}\n")
    assert _verify("--export", str(first), "--db", str(path)) == (0, f"OK: {head[0]} events, head {head[1]}\n")
    stopped = _unfinished(path)
    assert (stopped is None) == (steps == 0)

    # A retry of a call whose events are gone, and of one whose events are not yet, replays.
    with open_journal(str(path)) as journal:
        tools = Tools(journal)
        assert tools.call("early-0", tools.charge, account="acct_0", cents=1)["cents"] == 1
        assert tools.call("early-40", tools.charge, account="acct_5", cents=41)["cents"] == 41
        assert tools.payments.charges == []
        _calls(tools, "later", 3)

    # The next run finishes the stopped one first, then archives what is older than its own cut.
    second = tmp_path / "a2.jsonl"
    result = _archive(path, second)
    if steps:
        assert result.stderr.startswith(f"Finished the archive to {first} that was stopped: let go of "
                                        f"{head[0] - 1 - start[0]} more events (seq {start[0] + 1} to {head[0] - 1}).")
    else:  # killed before its first step: the journal kept every event, and a2 archives them again
        assert "Finished" not in result.stderr
    assert _unfinished(path) is None
    archives = [first, second] if steps else [second]
    with open_journal(str(path), readonly=True) as journal:
        end = journal.head()
        assert journal.verify().ok
    args = [arg for a in archives for arg in ("--export", str(a))]
    assert _verify(*args, "--db", str(path)) == (0, f"OK: {end[0]} events, head {end[1]}\n")


def test_an_archive_whose_file_went_away_is_not_finished(tmp_path: Path) -> None:
    path, first = tmp_path / "journal.db", tmp_path / "a1.jsonl"
    _filled(path)
    _killed_after(path, first, 2)
    with open_journal(str(path), readonly=True) as journal:
        start = journal.archived_head()
    first.rename(tmp_path / "elsewhere.jsonl")
    result = invoke("journal", "archive", "--db", str(path), "--before", datetime.now(UTC).isoformat(),
                    "-o", str(tmp_path / "a2.jsonl"))
    assert result.exit_code == 1
    assert result.stderr.startswith(f"Error: the archive {first} was stopped before the journal let go of its events")
    assert result.stderr.endswith("nothing was archived\n") and result.stderr.count("\n") == 1
    with open_journal(str(path), readonly=True) as journal:
        assert journal.archived_head() == start and journal.verify().ok
    # Put back, it is finished.
    (tmp_path / "elsewhere.jsonl").rename(first)
    _archive(path, tmp_path / "a2.jsonl")
    assert _unfinished(path) is None


def test_killed_at_random_moments_of_its_steps_no_event_is_lost(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    _filled(path, 400)
    with open_journal(str(path), readonly=True) as journal:
        head = journal.head()
    archives: list[Path] = []
    for run in range(6):
        output = tmp_path / f"a{run}.jsonl"
        with open_journal(str(path), readonly=True) as journal:
            base = journal.archived_head()[0]
        if base >= head[0] - 1 and _unfinished(path) is None:
            break
        if _unfinished(path) is None:
            _killed_after(path, output, 1 + run % 3, every=25 + run)
            archives.append(output)
        else:
            _archive(path, output)
            if output.exists():
                archives.append(output)
        with open_journal(str(path), readonly=True) as journal:
            assert journal.verify().ok
        args = [arg for a in archives for arg in ("--export", str(a))]
        assert _verify(*args, "--db", str(path)) == (0, f"OK: {head[0]} events, head {head[1]}\n")
    lines = [orjson.loads(line)["seq"] for a in archives for line in a.read_bytes().splitlines()]
    assert lines == list(range(1, len(lines) + 1))


def test_several_archives_keep_verify_and_rebuild_right_and_never_run_a_call_again(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    tools = seed(path)  # call-ok committed, call-timeout unknown, call-failed released, call-read, call-refused
    del tools
    archives: list[Path] = []

    def archive_now() -> None:
        output = tmp_path / f"a{len(archives) + 1}.jsonl"
        result = _archive(path, output)
        if result.stdout.startswith("Archived"):
            archives.append(output)

    # A call whose tool runs while its pending event is archived, and commits after.
    with pending_with_live_owner(path, "call-running"):
        with open_journal(str(path)) as journal:
            _calls(Tools(journal), "first", 2)  # the journal's last event stays: not call-running's
        archive_now()
        # Only first-1 moved past the start (its commit is the last event, which stays): every
        # other call's row is its own row as of the start.
        assert _kept(path) == ["first-1"]
    assert _kept(path) == ["call-running", "first-1"]  # committed after the start: its row as of it is kept
    with open_journal(str(path)) as journal:
        tools = Tools(journal)
        # The operator settles the archived call in doubt: its row moves, its old row is kept.
        journal.resolve("call-timeout", applied=True, value='{"charge_id": "ch_9"}', reason="backend has it",
                        operator="ops")
        assert journal.verify().ok
        assert _kept(path) == ["call-running", "call-timeout", "first-1"]
        _calls(tools, "second", 4)
    archive_now()
    assert _kept(path) == ["second-3"]  # the others' events are archived too: their rows are their own again
    with open_journal(str(path)) as journal:
        tools = Tools(journal)
        _calls(tools, "third", 3)
    archive_now()
    assert len(archives) == 3 and _kept(path) == ["third-2"]

    with open_journal(str(path)) as journal:
        tools = Tools(journal)
        calls = journal.calls(limit=None)
        assert journal.verify().ok
        # Retried through the guard, no archived call runs again.
        assert tools.call("call-ok", tools.charge, account="acct_1", cents=500) == {"charge_id": "ch_1", "cents": 500}
        assert tools.call("call-timeout", tools.charge, account="acct_2", cents=700) == {"charge_id": "ch_9"}
        assert tools.call("second-2", tools.charge, account="acct_2", cents=3) == {"charge_id": "ch_3", "cents": 3}
        assert tools.call("call-running", tools.charge, account="acct_9", cents=100) is None
        refused = tools.call("second-1", tools.charge, account="acct_1", cents=99)
        assert refused["block_reason"] == "policy_violation"
        assert tools.payments.charges == []
        assert journal.rebuild() == len(calls)
        assert journal.calls(limit=None) == calls
        assert journal.verify().ok
    with open_journal(str(path), readonly=True) as journal:
        head = journal.head()
    args = [arg for a in archives for arg in ("--export", str(a))]
    assert _verify(*args, "--db", str(path)) == (0, f"OK: {head[0]} events, head {head[1]}\n")

    # A row of an archived call changed or removed by hand is found, and rebuild brings it back.
    for statement in ("UPDATE calls SET status = 'released' WHERE call_id = 'second-0'",
                      "DELETE FROM calls WHERE call_id = 'call-ok'",
                      "UPDATE calls SET value = '{\"charge_id\": \"forged\"}' WHERE call_id = 'call-timeout'"):
        conn = sqlite3.connect(path)
        with conn:
            conn.execute(statement)
        conn.close()
        code, output = _verify("--db", str(path))
        assert code == 1 and "run rebuild" in output, output
        refused = invoke("journal", "archive", "--db", str(path), "--before", datetime.now(UTC).isoformat(),
                         "-o", str(tmp_path / "refused.jsonl"))
        assert refused.exit_code == 1 and "does not verify" in refused.stderr
        assert invoke("journal", "rebuild", "--db", str(path)).exit_code == 0
        with open_journal(str(path), readonly=True) as journal:
            assert journal.calls(limit=None) == calls
        assert _verify("--db", str(path))[0] == 0
    # A rebuild writes only the rows that differ: the copies kept are those of the rows changed by
    # hand (and of the call that moved past the start); the next archive lets them go.
    assert _kept(path) == ["call-ok", "call-timeout", "second-0", "third-2"]
    with open_journal(str(path)) as journal:
        _calls(Tools(journal), "fourth", 2)
    archive_now()
    assert _kept(path) == ["fourth-1"]
    with open_journal(str(path), readonly=True) as journal:
        assert journal.verify().ok


def test_the_check_before_an_archive_finds_what_verify_finds(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    seed(path)
    _archive(path, tmp_path / "a1.jsonl")
    with open_journal(str(path)) as journal:
        _calls(Tools(journal), "later", 3)
    for statement in ("UPDATE calls SET attempt = 2 WHERE call_id = 'later-1'",
                      "DELETE FROM calls WHERE call_id = 'call-read'",
                      "UPDATE calls SET tool = 'other' WHERE call_id = 'call-failed'",
                      "INSERT INTO calls SELECT 'made-up', tool, status, attempt, agent_id, idempotency_key, "
                      "arguments, value, error, reason, actor, owner, created_at, updated_at, since, last_seq "
                      "FROM calls WHERE call_id = 'later-0'"):
        copy = tmp_path / "copy.db"
        copy.write_bytes(path.read_bytes())
        conn = sqlite3.connect(copy)
        with conn:
            conn.execute(statement)
        conn.close()
        with SQLiteJournal(copy) as journal:
            full, bounded = journal.verify(), archive_run.check(journal)
        assert not full.ok, statement
        assert (bounded.ok, bounded.first_bad_seq, bounded.problem) == (False, full.first_bad_seq, full.problem)
        copy.unlink()
    with SQLiteJournal(path) as journal:
        assert archive_run.check(journal) == journal.verify()


def test_archiving_90_percent_gives_back_most_of_the_file(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    with open_journal(str(path)) as journal:
        tools = Tools(journal)
        for n in range(400):
            tools.call(f"c{n}", tools.charge, account="x" * 500, cents=n)
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    before = path.stat().st_size
    _archive(path, tmp_path / "a1.jsonl")
    conn = sqlite3.connect(path)
    try:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        # One copy: the last call's, whose commit is the event that stays.
        assert conn.execute("SELECT call_id FROM calls_archived").fetchall() == [("c399",)]
        assert conn.execute("SELECT count(*) FROM calls").fetchone() == (400,)
    finally:
        conn.close()
    # Left: each call's row (with its arguments) and the last event; not a second copy of the rows.
    assert path.stat().st_size < before * 0.45


def _as_version_6(path: Path) -> None:
    """Lay an archived journal out as version 6 did: no steps, and a copy of every call's row as of
    the start of the log in calls_archived (taken as version 6 took it)."""
    from journal.sqlite.archive_schema import record_of

    conn = sqlite3.connect(path)
    with conn:
        conn.execute("DROP TRIGGER calls_keep_archived_on_update")
        conn.execute("DROP TRIGGER calls_keep_archived_on_delete")
        conn.execute("ALTER TABLE archives DROP COLUMN upto_hash")
        conn.execute("ALTER TABLE archives DROP COLUMN upto_seq")
        conn.execute(f"INSERT OR IGNORE INTO calls_archived (call_id, record) SELECT call_id, {record_of('calls')} "
                     "FROM calls WHERE last_seq <= (SELECT max(last_seq) FROM archives)")
        conn.execute("PRAGMA user_version = 6")
    conn.close()


def test_a_version_6_journal_with_archives_migrates_and_still_verifies(tmp_path: Path) -> None:
    from journal.sqlite.schema import LATEST

    path = tmp_path / "journal.db"
    seed(path)
    with open_journal(str(path)) as journal:
        _calls(Tools(journal), "later", 3)
    _archive(path, tmp_path / "a1.jsonl")
    with open_journal(str(path)) as journal:
        journal.resolve("call-timeout", applied=False, reason="no charge at the backend", operator="ops")
        calls = journal.calls(limit=None)
    assert _kept(path) == ["call-timeout", "later-2"]
    _as_version_6(path)
    assert len(_kept(path)) == len(calls)
    with open_journal(str(path), readonly=True) as journal:  # read as it is, not migrated
        assert journal.verify().ok and journal.calls(limit=None) == calls
    with open_journal(str(path)) as journal:  # a writer migrates it
        assert journal.verify().ok
        assert journal.calls(limit=None) == calls
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        assert conn.execute("PRAGMA user_version").fetchone() == (LATEST,)
    finally:
        conn.close()
    # The copies equal to today's rows are let go; the calls that moved keep theirs.
    assert _kept(path) == ["call-timeout", "later-2"]
    with open_journal(str(path)) as journal:
        tools = Tools(journal)
        assert tools.call("call-ok", tools.charge, account="acct_1", cents=500) == {"charge_id": "ch_1", "cents": 500}
        assert tools.payments.charges == []
        assert journal.rebuild() == len(calls)
        assert journal.verify().ok
    _archive(path, tmp_path / "a2.jsonl")
    with open_journal(str(path), readonly=True) as journal:
        head = journal.head()
        assert journal.verify().ok
    assert _verify("--export", str(tmp_path / "a1.jsonl"), "--export", str(tmp_path / "a2.jsonl"), "--db",
                   str(path)) == (0, f"OK: {head[0]} events, head {head[1]}\n")


def test_the_command_killed_while_it_lets_go_in_steps_is_finished_by_the_next(tmp_path: Path) -> None:
    from benchmarks.archive_bench import fill
    from tests.cli_support import AIRLOCK

    path, first = tmp_path / "journal.db", tmp_path / "a1.jsonl"
    fill(path, 4 * archive_run.STEP)  # four steps' worth of events
    with open_journal(str(path), readonly=True) as journal:
        head = journal.head()
    proc = subprocess.Popen([AIRLOCK, "journal", "archive", "--db", str(path), "--before",
                             datetime.now(UTC).isoformat(), "-o", str(first)],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        # Killed as soon as a step has let go of events and the archive is not yet whole.
        while _unfinished(path) is None and proc.poll() is None:
            pass
        proc.kill()
    finally:
        proc.wait(timeout=120)
        if proc.stderr is not None:
            proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL, "the archive finished before it was seen half-way"
    with open_journal(str(path), readonly=True) as journal:
        start = journal.archived_head()
        assert 0 < start[0] < head[0] - 1 and journal.verify().ok
    assert _verify("--export", str(first), "--db", str(path)) == (0, f"OK: {head[0]} events, head {head[1]}\n")

    result = _archive(path, tmp_path / "a2.jsonl")
    assert result.stderr.startswith(f"Finished the archive to {first} that was stopped")
    assert result.stdout.startswith("Nothing to archive")  # the first archive took all but the last event
    with open_journal(str(path), readonly=True) as journal:
        assert journal.archived_head()[0] == head[0] - 1 and journal.verify().ok
    assert _verify("--export", str(first), "--db", str(path)) == (0, f"OK: {head[0]} events, head {head[1]}\n")
