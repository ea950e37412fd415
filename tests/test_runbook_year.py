"""The runbook's routine for a simulated year, each command as docs/runbook.md prints it: a signed
checkpoint every day, a signed archive on the 1st of every month (`--before 90d`: twelve of them),
calls, retries and calls in doubt settled by the runbook's `resolve` commands in between, and every
quarter the audit that verifies the archives, the journal and every checkpoint together.

Time is simulated, not waited for: each simulated day's calls are made in real time, one day after
the other, and where a command takes the clock (the file names' `$(date -u ...)`, the archive's
`--before 90d`) it is given the simulated date, and for `--before` the real time at which the
simulated day 90 days back began (an explicit timestamp). The cron entries run in this process
(no shell construct is left in them once the date is put in); the quarterly audit, a shell
command, runs in bash with the installed `airlock` on its PATH. Needs the `sign` extra."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import subprocess
import sys
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any

import orjson
import pytest

from guard import is_refusal
from journal import open_journal
from tests.cli_support import Tools, invoke
from tests.journals import JournalFactory

pytest.importorskip("cryptography")

ROOT = Path(__file__).resolve().parents[1]
RUNBOOK = (ROOT / "docs" / "runbook.md").read_text()

YEAR = 2026
FIRST_DAY = date(YEAR - 1, 10, 1)  # three months before the year: the first archive has 90 days to take
LAST_DAY = date(YEAR, 12, 31)
QUARTER_ENDS = {date(YEAR, 3, 31), date(YEAR, 6, 30), date(YEAR, 9, 30), date(YEAR, 12, 31)}


def section(title: str) -> str:
    start = RUNBOOK.index(f"\n### {title}")
    end = RUNBOOK.find("\n## ", start + 1)
    return RUNBOOK[start:] if end < 0 else RUNBOOK[start:end]


def blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, re.S)


def routine() -> tuple[str, str, str]:
    """The checkpoint and archive cron entries and the quarterly audit, as printed."""
    text = section("The routine: every day, every month, every quarter")
    entries = [line for line in blocks(text, "cron")[0].splitlines() if line.strip() and not line.startswith("#")]
    [checkpoint] = [e for e in entries if " journal checkpoint " in e]
    [archive] = [e for e in entries if " journal archive " in e]
    [audit] = blocks(text, "sh")
    return checkpoint, archive, re.sub(r"\\\n\s*", " ", audit).strip()


def resolve_commands() -> tuple[str, str]:
    """The runbook's `resolve` for an effect that happened (with its value) and one that did not."""
    text = RUNBOOK[RUNBOOK.index("## 4. Settle it"):RUNBOOK.index("## 5. Check")]
    commands = [re.sub(r"\\\n\s*", " ", b).strip() for b in blocks(text, "sh")]
    [applied] = [c for c in commands if "--applied --value" in c]
    [not_applied] = [c for c in commands if "--not-applied" in c]
    return applied, not_applied


class Year:
    """The paths of the runbook, here; what the commands print is checked as they run."""

    def __init__(self, tmp_path: Path, db: str) -> None:
        self.db = db
        self.archives = tmp_path / "archives"
        self.checkpoints = tmp_path / "checkpoints"
        self.archives.mkdir()
        self.checkpoints.mkdir()
        self.key = tmp_path / "audit-key.pem"
        made = invoke("journal", "keygen", "--output", str(self.key))
        assert made.exit_code == 0, made.output
        self.pub = tmp_path / "audit-key.pub"
        self.pub.write_text(made.stdout)
        self.cwd = tmp_path
        self.ended: dict[date, str] = {}  # the real time at which each simulated day ended

    def here(self, command: str, day: date) -> str:
        """``command`` with the runbook's paths put here, and ``date -u`` answering ``day``."""
        for path, ours in (("/srv/agent/airlock-journal.db", shlex.quote(self.db)),
                           ("/srv/agent/archives", str(self.archives)),
                           ("/srv/audit/checkpoints", str(self.checkpoints)),
                           ("/etc/airlock/audit-key.pem", str(self.key))):
            command = command.replace(path, ours)
        command = command.replace(r"\%", "%")  # cron's escape
        command = command.replace("$(date -u +%F)", day.isoformat()).replace("$(date -u +%Y-%m)", day.strftime("%Y-%m"))
        if "--before 90d" in command:
            began = day - timedelta(days=90)  # events recorded before this simulated day are 90 days old
            command = command.replace("--before 90d", f"--before {self.ended[began - timedelta(days=1)]}")
        return command

    def cron(self, entry: str, day: date) -> Any:
        """A cron entry run on ``day``: its schedule and user taken off, the command in this process."""
        command = self.here(entry, day)
        assert "$(" not in command and "`" not in command, command  # nothing left for a shell to do
        words = shlex.split(command)
        assert words[6:8] == ["airlock", "journal"], words
        return invoke(*words[7:])

    def shell(self, command: str, day: date) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if k != "AIRLOCK_JOURNAL"}
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "/usr/bin:/bin")])
        return subprocess.run(["bash", "-e", "-o", "pipefail", "-c", self.here(command, day)], cwd=self.cwd, env=env,
                              capture_output=True, text=True, timeout=600)


class Agent:
    """The agent's calls over the year, and what the backend did: every charge it made."""

    def __init__(self, journal: Any) -> None:
        self.tools = Tools(journal)
        self.journal = journal
        # A call id, its arguments, and the value its retries must get back.
        self.committed: dict[str, tuple[dict[str, Any], Any]] = {}
        self.in_doubt: dict[str, tuple[date, int]] = {}  # a call id left unknown: the day, and its cents
        self.made = 0  # charges the tool made, as the backend counts them

    def day(self, day: date, n: int) -> None:
        """Two charges, each retried once (a lost answer, replayed); every ninth day a third, whose
        answer times out: unknown, and its retry refused."""
        for k in range(2):
            call_id = f"{day.isoformat()}-{k}"
            value = self.tools.call(call_id, self.tools.charge, account=f"acct_{k}", cents=n * 10 + k)
            self.made += 1
            assert self.tools.call(call_id, self.tools.charge, account=f"acct_{k}", cents=n * 10 + k) == value
            self.committed[call_id] = ({"account": f"acct_{k}", "cents": n * 10 + k}, value)
        if n % 9 == 0:
            call_id = f"{day.isoformat()}-doubt"
            self.tools.fail_with = TimeoutError("the backend did not answer")
            with contextlib.suppress(TimeoutError):
                self.tools.call(call_id, self.tools.charge, account="acct_9", cents=n)
            self.made += 1
            refused = self.tools.call(call_id, self.tools.charge, account="acct_9", cents=n)
            assert is_refusal(refused) and refused["block_reason"] == "effect_status_unknown"
            self.in_doubt[call_id] = (day, n)
        assert len(self.tools.payments.charges) == self.made  # no retry ran the tool again

    def retry_old(self, day: date) -> None:
        """Retries of calls long archived: each replayed (the tool does not run) or refused."""
        old = [c for c in self.committed if date.fromisoformat(c[:10]) == day - timedelta(days=200)]
        assert old
        for call_id in old:
            arguments, value = self.committed[call_id]
            assert self.tools.call(call_id, self.tools.charge, **arguments) == value
        assert len(self.tools.payments.charges) == self.made


@pytest.fixture
def db(journal_kind: JournalFactory, tmp_path: Path) -> str:
    """Where the journal of every store (tests/conftest.py) is to be: a file, or a database of its own."""
    return journal_kind.target(tmp_path, "airlock-journal.db", own_database=True)


def test_a_year_of_the_runbooks_routine(journal_kind: JournalFactory, db: str, tmp_path: Path) -> None:
    checkpoint_entry, archive_entry, audit = routine()
    applied, not_applied = resolve_commands()
    year = Year(tmp_path, db)
    audits: list[str] = []
    with journal_kind.open(db, **journal_kind.quick) as journal:
        agent = Agent(journal)
        day, n = FIRST_DAY, 0
        while day <= LAST_DAY:
            n += 1
            # 00:05: the day's checkpoint.
            made = year.cron(checkpoint_entry, day)
            assert made.exit_code == 0, made.output
            assert (year.checkpoints / f"checkpoint-{day.isoformat()}.json").exists()
            # 03:00 on the 1st: the month's archive, of the events older than 90 days.
            if day.day == 1 and day.year == YEAR:
                archived = year.cron(archive_entry, day)
                assert archived.exit_code == 0, archived.output
                assert archived.stdout.startswith("Archived "), archived.output
                assert (year.archives / f"airlock-{day.strftime('%Y-%m')}.jsonl.manifest.json").exists()
            agent.day(day, n)
            if n % 30 == 0 and day - timedelta(days=200) >= FIRST_DAY:
                agent.retry_old(day)
            # Calls in doubt are settled some 20 days on (their events archived or not), as the
            # runbook's section 4 says: one the backend has, with its receipt; one it has not.
            for call_id, (since, cents) in list(agent.in_doubt.items()):
                if day - since >= timedelta(days=20):
                    command = applied if len(agent.in_doubt) % 2 else not_applied
                    words = shlex.split(command.replace("CALL_ID", call_id))
                    settled = invoke(*words[1:], env={"AIRLOCK_JOURNAL": db})
                    assert settled.exit_code == 0, settled.output
                    del agent.in_doubt[call_id]
                    again = agent.tools.call(call_id, agent.tools.charge, account="acct_9", cents=cents)
                    if "--not-applied" in command:
                        agent.made += 1  # released: the retry runs the tool, once, as attempt 2
                        agent.committed[call_id] = ({"account": "acct_9", "cents": cents}, again)
                    else:
                        assert again == orjson.loads(words[words.index("--value") + 1])  # the operator's receipt
                        agent.committed[call_id] = ({"account": "acct_9", "cents": cents}, again)
                    assert len(agent.tools.payments.charges) == agent.made
            year.ended[day] = datetime.now(UTC).isoformat()
            # The quarter's audit: the archives, the journal and every checkpoint, as one.
            if day in QUARTER_ENDS:
                checked = year.shell(audit.replace("audit-key.pub", str(year.pub)), day)
                assert checked.returncode == 0, checked.stderr
                kept = len(list(year.checkpoints.glob("checkpoint-*.json")))
                head = journal.head()
                assert checked.stdout == f"OK: {head[0]} events, head {head[1]}\n", checked.stdout
                assert re.fullmatch(rf"Each of the {kept} checkpoints \(seq \d+ to \d+\) matches: \d+ in the "
                                    r"archives, \d+ in the journal\.\n", checked.stderr), checked.stderr
                audits.append(checked.stderr)
            day += timedelta(days=1)

    # Twelve signed archives, each verifying alone against its manifest; four audits, the later
    # ones finding more checkpoints in the archives.
    archives = sorted(year.archives.glob("airlock-*.jsonl"))
    assert [a.name for a in archives] == [f"airlock-{YEAR}-{m:02d}.jsonl" for m in range(1, 13)]
    for archive in archives:
        alone = invoke("journal", "verify", "--export", str(archive), "--public-key", str(year.pub))
        assert alone.exit_code == 0, alone.output
    in_archives = [int(re.search(r"(\d+) in the archives", said).group(1)) for said in audits]  # type: ignore[union-attr]
    assert len(audits) == 4 and in_archives == sorted(in_archives) and in_archives[0] > 0
    # The journal keeps the last 90 days or so; every call of the year keeps its row.
    with open_journal(db, readonly=True, create=False) as j:
        start = j.archived_head()[0]
        assert 0 < start < j.head()[0]
        assert j.stats().calls == len(agent.committed) + len(agent.in_doubt)

    # A checkpoint rewritten after the fact (or an archive changed) fails the audit, naming it.
    first = year.checkpoints / f"checkpoint-{YEAR}-01-15.json"
    forged = {**orjson.loads(first.read_bytes()), "hash": "0" * 63 + "1"}
    first.write_bytes(orjson.dumps(forged))
    failed = year.shell(audit.replace("audit-key.pub", str(year.pub)), LAST_DAY)
    assert failed.returncode == 1
    assert f"{first} is not a checkpoint that can be used: its signature does not match its contents" in failed.stderr
