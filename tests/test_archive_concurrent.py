"""Two `airlock journal archive` commands at once, in real processes, as a user with two cron
entries (or two hosts) would start them: both check the journal, plan the same archive and write
their files; the first to let go of events wins. The other says that another archive did the
work, naming its file and what it holds, removes its own file (a copy of events that archive
holds), exits 0, and advises nothing: the journal and the winner's archive verify as one chain,
and the same command run again archives nothing."""

from __future__ import annotations

import os
import re
import subprocess
import time
from datetime import UTC, datetime
from pathlib import Path

import orjson
import pytest

from journal import open_journal
from journal.archive_run import in_steps
from tests.cli_support import AIRLOCK, Tools, invoke
from tests.journals import JournalFactory

ROOT = Path(__file__).resolve().parents[1]


def fill(made: JournalFactory, target: str) -> None:
    with made.open(target, **made.quick) as j:
        # 6000 events where the archive lets go of them in steps: it does so in two.
        calls = 3000 if in_steps(j) else 300
        tools = Tools(j)
        for n in range(calls):
            tools.call(f"c{n}", tools.charge, account="acct_1", cents=n + 1)


def start_archive(target: str, before: str, output: Path, *more: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k != "AIRLOCK_JOURNAL"}
    return subprocess.Popen([AIRLOCK, "journal", "archive", "--before", before, "--output", str(output),
                             "--db", target, *more], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def wait_for(paths: list[Path], seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while not all(p.exists() for p in paths):
        assert time.monotonic() < deadline, f"not written: {[p for p in paths if not p.exists()]}"
        time.sleep(0.05)


@pytest.fixture
def target(journal_kind: JournalFactory, tmp_path: Path) -> str:
    """A journal of every store (tests/conftest.py), a file or a database of its own, filled."""
    target = journal_kind.target(tmp_path, "J.db", own_database=True)
    fill(journal_kind, target)
    return target


def test_two_archives_at_once_one_archives_the_other_says_so_and_removes_its_copy(journal_kind: JournalFactory,
                                                                                 target: str,
                                                                                 tmp_path: Path) -> None:
    key = tmp_path / "audit-key.pem"
    assert invoke("journal", "keygen", "--output", str(key)).exit_code == 0
    before = datetime.now(UTC).isoformat()
    a, b = tmp_path / "A.jsonl", tmp_path / "B.jsonl"
    # The journal's write lock taken by another connection: every archive waits at its first
    # transaction that lets go of events, after it has checked, planned and written its file.
    with journal_kind.database(target).write_lock():
        procs = {out: start_archive(target, before, out, "--sign", str(key)) for out in (a, b)}
        wait_for([a, b, a.with_name("A.jsonl.manifest.json"), b.with_name("B.jsonl.manifest.json")])
        assert a.read_bytes() == b.read_bytes()  # two copies of one archive, until one lets go
    done = {out: proc.communicate(timeout=120) for out, proc in procs.items()}
    codes = {out: proc.returncode for out, proc in procs.items()}
    assert codes == {a: 0, b: 0}, done

    [winner] = [out for out, (stdout, _) in done.items() if stdout.startswith("Archived ")]
    [loser] = [out for out in (a, b) if out != winner]
    with open_journal(target, readonly=True, create=False) as j:
        seq, _ = j.archived_head()
    stdout, stderr = done[loser]
    # On SQLite the winner may still be letting go of them, a step at a time, as the loser reports.
    assert re.fullmatch(
        re.escape(f"Nothing archived: another archive, run at the same time, took these events first: {winner} holds "
                  f"seq 1 to {seq}") + r"( \(the journal is still letting go of them\))?"
        + re.escape(f". This run (of seq 1 to {seq}) let go of none; {loser} and its manifest, written before, held "
                    "only copies of events that archive holds, and were removed.\n"), stdout), done[loser]
    assert "again" not in stdout + stderr and "Error" not in stderr
    assert not loser.exists() and not loser.with_name(loser.name + ".manifest.json").exists()

    # The journal is complete: the winner's archive and the journal are one chain, and the
    # same command run again finds nothing to archive (no third file).
    joined = invoke("journal", "verify", "--export", str(winner), "--db", target)
    assert joined.exit_code == 0, joined.output
    assert orjson.loads(winner.read_bytes().splitlines()[-1])["seq"] == seq
    again = invoke("journal", "archive", "--before", before, "--output", str(loser), "--db", target)
    assert again.exit_code == 0, again.output
    assert again.stdout.startswith("Nothing to archive: no event before "), again.output
    assert not loser.exists()
