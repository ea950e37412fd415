"""What the console's tests share: a journal seeded with every story a page shows, a call pending
with a live owner, and ``airlock journal serve`` run in a real process.

No test is defined here; tests/test_console.py (routes) and tests/test_console_browser.py
(Chromium) import these.
"""

from __future__ import annotations

import os
import queue
import re
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from guard import Airlock, AirlockContext, SecurityPolicy
from guard.approvals import ApprovalQueue, decide_request
from guard.effect_guard import EffectGuard
from tests.cli_support import AIRLOCK, ROOT, Tools, seed_into

# Put into every argument and value of the call "call-secret" (and its request for approval):
# with --redact arguments,value, no page and no export may hold them.
SECRET_ARGUMENT = "argument-s3cret-7f3a"
SECRET_VALUE = "value-s3cret-91c2"


def seed_console(journal: Any) -> Tools:
    """``seed_into``'s stories (call-ok, call-timeout, call-failed, call-read, call-refused), and:

    - ``call-secret``: a committed charge whose argument and value hold the secret markers
    - ``call-approve``, ``call-deny``: charges waiting for approval (open requests)
    - ``call-approved``: a request approved by bob; ``call-denied``: denied by carol
    - ``call-asks-secret``: an open request whose arguments hold the secret marker
    """
    tools = seed_into(journal)
    tools.call("call-secret", tools.charge, account=SECRET_ARGUMENT, cents=100)
    # The value the backend gave holds the marker too: committed with it.
    payments = tools.payments
    original = payments.charge
    payments.charge = lambda account, cents: {"charge_id": SECRET_VALUE, "cents": cents}  # type: ignore[method-assign]
    try:
        tools.call("call-secret-value", tools.charge, account="acct_8", cents=800)
    finally:
        payments.charge = original  # type: ignore[method-assign]
    policy = SecurityPolicy(escalate_tools={"charge": "moves money"}, approver=ApprovalQueue(ttl=3600),
                            effect_guard=EffectGuard(store=journal))

    @Airlock(policy=policy)
    def charge(account: str, cents: int) -> dict[str, Any]:
        return {"charge_id": f"ch_{account}", "cents": cents}

    for call_id, account in (("call-approve", "acct_20"), ("call-deny", "acct_21"), ("call-approved", "acct_22"),
                             ("call-denied", "acct_23"), ("call-asks-secret", SECRET_ARGUMENT)):
        with AirlockContext(agent_id="agent-3", metadata={"tool_call_id": call_id}):
            charge(account=account, cents=2500)
    decide_request(journal, "call-approved", approve=True, operator="bob", reason="customer agreed")
    decide_request(journal, "call-denied", approve=False, operator="carol", reason="over the limit")
    return tools


_PENDING_SCRIPT = textwrap.dedent(
    """
    import os, sys
    from guard import Airlock, AirlockContext, SecurityPolicy
    from guard.effect_guard import EffectGuard
    from journal import open_journal

    journal = open_journal(sys.argv[1])
    policy = SecurityPolicy(effect_guard=EffectGuard(store=journal))

    @Airlock(policy=policy)
    def charge(account: str, cents: int) -> None:
        os._exit(3)  # the process dies mid-effect: the call stays pending, its owner gone

    with AirlockContext(agent_id="agent-9", metadata={"tool_call_id": sys.argv[2]}):
        charge(account="acct_9", cents=100)
    """
)


def leave_pending(target: str, call_id: str) -> None:
    """A call left pending by a process that died mid-effect, in the journal ``target`` (a
    SQLite path or a PostgreSQL URL): its owner is gone."""
    done = subprocess.run([sys.executable, "-c", _PENDING_SCRIPT, target, call_id], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, done.stderr


@contextmanager
def pending_in_this_process(journal: Any, call_id: str) -> Iterator[None]:
    """A charge pending while this process runs it (its owner is alive), held until the block ends."""
    release = threading.Event()
    started = threading.Event()
    policy = SecurityPolicy(effect_guard=EffectGuard(store=journal))

    @Airlock(policy=policy)
    def charge(account: str, cents: int) -> dict[str, Any]:
        started.set()
        release.wait(120)
        return {"charge_id": "ch_live", "cents": cents}

    def run() -> None:
        with AirlockContext(agent_id="agent-live", metadata={"tool_call_id": call_id}):
            charge(account="acct_live", cents=300)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    assert started.wait(60), "the held call never started"
    try:
        yield
    finally:
        release.set()
        worker.join(60)


@dataclass
class Served:
    """``airlock journal serve`` running in a process of its own."""

    process: subprocess.Popen[str]
    url: str  # the one-time sign-in URL it printed
    output: list[str]

    @property
    def base(self) -> str:
        return self.url.split("/?token=")[0]


_URL = re.compile(r"(http://\S+/\?token=\S+)")


@contextmanager
def serving(*args: str, env: dict[str, str] | None = None, deadline: float = 60.0) -> Iterator[Served]:
    """Run ``airlock journal serve --port 0 ARGS`` and yield it once it printed its URL; stop it
    (SIGTERM, then SIGKILL after a generous wait) when the block ends."""
    full_env = {k: v for k, v in os.environ.items() if k != "AIRLOCK_JOURNAL"}
    full_env.update(env or {})
    process = subprocess.Popen([AIRLOCK, "journal", "serve", "--port", "0", *args], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, env=full_env, cwd=ROOT)
    lines: queue.Queue[str | None] = queue.Queue()
    output: list[str] = []

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    url = None
    ends = time.monotonic() + deadline
    try:
        while url is None:
            try:
                line = lines.get(timeout=max(0.1, ends - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"serve printed no URL in {deadline} s: {''.join(output)}") from None
            if line is None:
                raise AssertionError(f"serve ended (exit {process.wait(30)}): {''.join(output)}")
            output.append(line)
            found = _URL.search(line)
            if found:
                url = found.group(1)
        yield Served(process, url, output)
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(30)
