"""What the journal contract suite builds its journals from: a fixed history written the same way
on every store, and guarded calls in a child process that the test can kill. (Plain SQL on a
journal's own database is each store's own: tests/journals.py.)"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import orjson

from guard.store import CallRecord, Decision, EffectEvent, Verdict
from journal.chain import verify_lines
from journal.events import VerifyReport

ROOT = Path(__file__).resolve().parents[1]

# The fixed history's events are written by a process of a host that is not this one, one
# microsecond apart from a moment taken when it is written: so two stores given it hold the same
# bytes (a PostgreSQL journal moves a time at or before one this process already stamped to just
# after it, so the history starts now), and anything written after it is later.
OWNER = {"host": "contract-host", "pid": 4242}
KEY = "a" * 64

# What the history leaves, newest first.
CALLS_NEWEST_FIRST = ["c-retry", "c-pending", "c-read", "c-released", "c-unknown", "c-ok"]
STATUS = {"c-retry": "committed", "c-pending": "pending", "c-read": "committed", "c-released": "released",
          "c-unknown": "unknown", "c-ok": "committed"}
AGENT = {"c-retry": "agent-1", "c-pending": "agent-3", "c-read": "agent-2", "c-released": "agent-2",
         "c-unknown": "agent-1", "c-ok": "agent-1"}


class History:
    """Fifteen events of six calls and a refusal, event ``n`` (from 0) stamped :meth:`at` ``(n)``."""

    def __init__(self, base: datetime | None = None) -> None:
        self.base = base if base is not None else datetime.now(UTC)
        event = self._event
        # (how the store takes it, the event): "run" is a begin that decides to run, "replay" one
        # that replays, "append" an outcome or a refusal.
        self.steps: list[tuple[str, EffectEvent]] = [
            ("run", event("pending", "c-ok", 0)),
            ("append", event("committed", "c-ok", 1, value='{"charge_id":"ch_1"}')),
            ("replay", event("replayed", "c-ok", 2)),
            ("run", event("pending", "c-unknown", 3)),
            ("append", event("unknown", "c-unknown", 4, error={"type": "TimeoutError", "message": "no answer"})),
            ("run", event("pending", "c-released", 5, agent="agent-2")),
            ("append", event("released", "c-released", 6, agent="agent-2",
                             error={"type": "ValueError", "message": "card declined"})),
            ("run", event("pending", "c-read", 7, tool="read_balance", agent="agent-2")),
            ("append", event("committed", "c-read", 8, tool="read_balance", agent="agent-2", value="500")),
            ("append", event("refused", "c-refused", 9, tool="refund", attempt=0,
                             reason={"code": "policy_violation", "message": "refund is not allowed"})),
            ("run", event("pending", "c-pending", 10, agent="agent-3")),
            ("run", event("pending", "c-retry", 11)),
            ("append", event("released", "c-retry", 12, error={"type": "ValueError", "message": "try again"})),
            ("run", event("pending", "c-retry", 13, attempt=2)),
            ("append", event("committed", "c-retry", 14, attempt=2,
                             value='{"charge_id":"ch_2","note":"a, \\"b\\""}')),
        ]

    def at(self, n: int) -> datetime:
        return self.base + timedelta(microseconds=n)

    def _event(self, kind: str, call_id: str | None, n: int, *, tool: str = "charge", agent: str | None = "agent-1",
               attempt: int = 1, **fields: Any) -> EffectEvent:
        arguments = '{"account":"acct_1","cents":500}' if tool == "charge" else '{"account":"acct_1"}'
        return EffectEvent(kind=kind, call_id=call_id, tool=tool, at=self.at(n), agent_id=agent,
                           idempotency_key=KEY, arguments=arguments, attempt=attempt, owner=OWNER, **fields)

    def write(self, journal: Any) -> None:
        """Write the history into ``journal`` through its own ``begin`` and ``append``."""
        for how, event in self.steps:
            if how == "append":
                journal.append(event)
                continue
            verdict = Verdict.RUN if how == "run" else Verdict.REPLAY
            assert event.call_id is not None
            decision = journal.begin(event.call_id, lambda record, e=event, v=verdict: Decision(v, e, record))
            assert decision.verdict is verdict


def begin_pending(journal: Any, call_id: str, *, tool: str = "charge", owner: Any = None) -> CallRecord:
    """A call left ``pending`` (by this process unless ``owner`` is given); its record."""
    event = EffectEvent(kind="pending", call_id=call_id, tool=tool, arguments='{"cents":5}', attempt=1,
                        idempotency_key=KEY, agent_id="agent-1")
    if owner is not None:
        event.owner = owner
    journal.begin(call_id, lambda record: Decision(Verdict.RUN, event, record))
    record: CallRecord | None = journal.call(call_id)
    assert record is not None
    return record


def exported(journal: Any, **filters: Any) -> bytes:
    """The whole JSON Lines export of ``journal`` with ``filters``."""
    return b"".join(lines for lines, _ in journal.export_lines(**filters))


def exported_csv(journal: Any, **filters: Any) -> bytes:
    return b"".join(lines for lines, _ in journal.export_csv(**filters))


def verify_export(data: bytes, allow_gaps: bool = False) -> VerifyReport:
    return verify_lines([orjson.loads(line) for line in data.splitlines()], allow_gaps=allow_gaps)


_CHILD = textwrap.dedent(
    """
    import sys
    from guard import Airlock, AirlockContext, SecurityPolicy
    from guard.effect_guard import EffectGuard
    from journal import open_journal

    journal = open_journal(sys.argv[1])
    lease = float(sys.argv[3]) or None

    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=journal, lease=lease)))
    def charge(account: str, cents: int) -> None:
        print("running", flush=True)
        sys.stdin.read()  # the tool runs until the test ends it

    with AirlockContext(agent_id="agent-1", metadata={"tool_call_id": sys.argv[2]}):
        charge(account="acct_9", cents=100)
    """
)


@contextmanager
def running_in_child(target: str, call_id: str, lease: float = 0.0) -> Iterator[subprocess.Popen[str]]:
    """A guarded ``charge`` of ``call_id`` running in another process on the journal ``target``
    (with a lease of ``lease`` seconds when given): ``pending``, its owner alive, until the test
    kills it (:func:`kill`) or leaves the block."""
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, target, call_id, str(lease)], cwd=ROOT,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "running"
        yield proc
    finally:
        if proc.poll() is None:
            kill(proc)


def kill(proc: subprocess.Popen[str]) -> None:
    """SIGKILL the child mid-effect and reap it: its call stays ``pending``, its owner gone."""
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    for stream in (proc.stdin, proc.stdout):
        if stream is not None:
            stream.close()


def leave_pending(target: str, call_id: str) -> None:
    """A call left ``pending`` by a process that was killed while its tool ran (no lease)."""
    with running_in_child(target, call_id) as proc:
        kill(proc)
