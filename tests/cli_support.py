"""Journals for the CLI tests, seeded by running guarded tools through the real guard, and ways to
look at a journal file from outside (a fresh sqlite3 connection, a digest of its files)."""

from __future__ import annotations

import hashlib
import os
import sqlite3
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from click.testing import CliRunner, Result

from cli.main import main
from guard import Airlock, AirlockContext, SecurityPolicy
from guard.effect_guard import EffectGuard, reversibility
from journal import SQLiteJournal

AIRLOCK = str(Path(sys.executable).with_name("airlock"))
ROOT = Path(__file__).resolve().parents[1]


def invoke(*args: str, env: dict[str, str | None] | None = None, input: str | None = None) -> Result:
    """Run ``airlock ARGS`` in this process; stdout and stderr stay apart."""
    return CliRunner().invoke(main, list(args), env={"AIRLOCK_JOURNAL": None, **(env or {})}, input=input,
                              catch_exceptions=False)


def run_airlock(
    *args: str, cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run the installed ``airlock`` script in a real process."""
    full_env = {k: v for k, v in os.environ.items() if k != "AIRLOCK_JOURNAL"}
    full_env.update(env or {})
    return subprocess.run([AIRLOCK, *args], cwd=cwd, env=full_env, capture_output=True, text=True, timeout=60)


class Payments:
    """A payment backend that counts its charges."""

    def __init__(self) -> None:
        self.charges: list[tuple[str, int]] = []

    def charge(self, account: str, cents: int) -> dict[str, Any]:
        self.charges.append((account, cents))
        return {"charge_id": f"ch_{len(self.charges)}", "cents": cents}


class Tools:
    """``charge`` (irreversible) and ``read_balance`` (reversible), guarded on one journal."""

    def __init__(self, journal: Any, payments: Payments | None = None) -> None:
        self.payments = payments or Payments()
        self.journal = journal
        self.fail_with: BaseException | None = None
        policy = SecurityPolicy(allowed_tools=["charge", "read_balance"], effect_guard=EffectGuard(store=journal))
        payments_ = self.payments

        @Airlock(policy=policy)
        def charge(account: str, cents: int) -> dict[str, Any]:
            receipt = payments_.charge(account, cents)
            if self.fail_with is not None:
                error, self.fail_with = self.fail_with, None
                raise error
            return receipt

        @reversibility("reversible")
        @Airlock(policy=policy)
        def read_balance(account: str) -> int:
            return sum(c for a, c in payments_.charges if a == account)

        @Airlock(policy=policy)
        def refund(account: str, cents: int) -> None:  # not allowed: every call is refused
            raise AssertionError("a refused tool ran")

        self.charge, self.read_balance, self.refund = charge, read_balance, refund

    def call(self, tool_call_id: str | None, tool: Callable[..., Any], *, agent: str = "agent-1", **kw: Any) -> Any:
        metadata = {} if tool_call_id is None else {"tool_call_id": tool_call_id}
        with AirlockContext(agent_id=agent, metadata=metadata):
            return tool(**kw)


def seed(path: Path) -> Tools:
    """A SQLite journal at ``path`` seeded by :func:`seed_into`."""
    with SQLiteJournal(path) as journal:
        return seed_into(journal)


def seed_into(journal: Any) -> Tools:
    """One call of each kind of story, run through the guard on ``journal``:

    - ``call-ok``: charge committed, then replayed once
    - ``call-timeout``: charge timed out (unknown), its retry refused effect_status_unknown
    - ``call-failed``: charge failed with ValueError (released)
    - ``call-read``: read_balance committed, by agent-2
    - ``call-refused``: refund, refused policy_violation (events only, no call)
    """
    tools = Tools(journal)
    tools.call("call-ok", tools.charge, account="acct_1", cents=500)
    tools.call("call-ok", tools.charge, account="acct_1", cents=500)
    tools.fail_with = TimeoutError("backend did not answer")
    with suppress(TimeoutError):
        tools.call("call-timeout", tools.charge, account="acct_2", cents=700)
    tools.call("call-timeout", tools.charge, account="acct_2", cents=700)
    tools.fail_with = ValueError("card declined")
    with suppress(ValueError):
        tools.call("call-failed", tools.charge, account="acct_3", cents=900)
    tools.call("call-read", tools.read_balance, agent="agent-2", account="acct_1")
    tools.call("call-refused", tools.refund, account="acct_1", cents=500)
    return tools


def _reader(path: Path) -> sqlite3.Connection:
    # read-only, so that closing it never checkpoints the WAL into the file under test
    return sqlite3.connect(f"file:{path}?mode=ro", uri=True)


def count_events(path: Path) -> int:
    """How many events the file holds, read through a fresh connection."""
    return int(rows(path, "SELECT count(*) FROM events")[0][0])


def rows(path: Path, sql: str, *params: Any) -> list[tuple[Any, ...]]:
    conn = _reader(path)
    try:
        return list(conn.execute(sql, params))
    finally:
        conn.close()


def digest(path: Path) -> tuple[str, str]:
    """sha256 of the journal file and of its write-ahead log: what the journal holds.

    A missing WAL and an empty one hold the same (nothing); the -shm file is only SQLite's index
    of the WAL and is left out.
    """
    wal = path.with_name(path.name + "-wal")
    wal_bytes = wal.read_bytes() if wal.exists() else b""
    return hashlib.sha256(path.read_bytes()).hexdigest(), hashlib.sha256(wal_bytes).hexdigest()


_PENDING_SCRIPT = textwrap.dedent(
    """
    import os, sys
    from guard import Airlock, AirlockContext, SecurityPolicy
    from guard.effect_guard import EffectGuard
    from journal import SQLiteJournal

    journal = SQLiteJournal(sys.argv[1])
    policy = SecurityPolicy(effect_guard=EffectGuard(store=journal))

    @Airlock(policy=policy)
    def charge(account: str, cents: int) -> None:
        if sys.argv[3] == "die":
            os._exit(3)  # the process dies mid-effect: the call stays pending
        print("running", flush=True)
        sys.stdin.read()  # hold the call open until the test closes stdin

    with AirlockContext(agent_id="agent-1", metadata={"tool_call_id": sys.argv[2]}):
        charge(account="acct_9", cents=100)
    """
)


def leave_pending(path: Path, call_id: str) -> None:
    """A call left pending by a process that died mid-effect (its owner is gone)."""
    done = subprocess.run([sys.executable, "-c", _PENDING_SCRIPT, str(path), call_id, "die"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 3, done.stderr


@contextmanager
def pending_with_live_owner(path: Path, call_id: str) -> Iterator[int]:
    """A call pending while its owner process is still running the tool; yields the owner's pid."""
    proc = subprocess.Popen([sys.executable, "-c", _PENDING_SCRIPT, str(path), call_id, "hold"],
                            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "running"
        yield proc.pid
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(timeout=60)


def run_on_terminal(*args: str, stream: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """Run the installed ``airlock`` with its ``stream`` (``stdout`` or ``stderr``) on a
    pseudo-terminal; returns the exit code, what reached the terminal, and the other stream."""
    import pty

    master, slave = pty.openpty()
    full_env = {k: v for k, v in os.environ.items() if k not in ("AIRLOCK_JOURNAL", "NO_COLOR")}
    full_env.update(env or {})
    other = subprocess.PIPE
    proc = subprocess.Popen(
        [AIRLOCK, *args], env=full_env,
        stdout=slave if stream == "stdout" else other, stderr=slave if stream == "stderr" else other,
    )
    os.close(slave)
    seen = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # the terminal closed: the process has exited
            break
        if not chunk:
            break
        seen += chunk
    os.close(master)
    piped = proc.stdout if stream == "stderr" else proc.stderr
    assert piped is not None
    rest = piped.read().decode()
    proc.wait(timeout=60)
    return proc.returncode, seen.decode().replace("\r\n", "\n"), rest
