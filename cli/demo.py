"""``airlock demo``: an agent pays through a backend whose answers get lost, and nobody is charged twice."""

from __future__ import annotations

import contextlib
import io
import shlex
from typing import Any

import click
import orjson

from guard import Airlock, AirlockContext, SecurityPolicy, get_current_context, is_refusal
from guard.approvals import ApprovalQueue
from guard.effect_guard import EffectGuard, reversibility
from guard.reconcile import Applied, InDoubtCall, NotApplied, reconciled_by
from journal import Journal, open_journal

from . import render
from .options import describe, echo, journal_target

DEFAULT_DEMO_DB = "airlock-demo.db"
AGENT = "billing-agent"


class PaymentBackend:
    """A payment provider in this process: a ledger of charges, looked up by idempotency key,
    behind a network that can lose an answer after the charge was made."""

    def __init__(self) -> None:
        self.ledger: list[dict[str, Any]] = []
        self.refunds: list[dict[str, Any]] = []
        self.lose_next_answer = False

    def refund(self, charge_id: str, cents: int) -> dict[str, Any]:
        receipt = {"refund_id": f"re_{len(self.refunds) + 1}", "charge_id": charge_id, "cents": cents}
        self.refunds.append(receipt)
        return receipt

    def charge(self, account: str, cents: int, idempotency_key: str) -> dict[str, Any]:
        receipt = {"charge_id": f"ch_{len(self.ledger) + 1}", "account": account, "cents": cents,
                   "status": "succeeded"}
        self.ledger.append({**receipt, "idempotency_key": idempotency_key})
        if self.lose_next_answer:
            self.lose_next_answer = False
            raise TimeoutError("no answer within 5s")
        return receipt

    def charge_made(self, call: InDoubtCall) -> Applied | NotApplied:
        """The check of ``charge``: is there a charge with the call's idempotency key? It only asks."""
        found = self.lookup(call.idempotency_key or "")
        if found is None:
            return NotApplied(evidence="the backend has no charge with this key")
        return Applied(value=found, evidence=f"the backend has {found['charge_id']} for this key")

    def balance(self, account: str) -> int:
        return sum(entry["cents"] for entry in self.ledger if entry["account"] == account)

    def lookup(self, idempotency_key: str) -> dict[str, Any] | None:
        """What an operator asks the provider: was a charge with this key made?"""
        for entry in self.ledger:
            if entry["idempotency_key"] == idempotency_key:
                return {k: v for k, v in entry.items() if k != "idempotency_key"}
        return None


def _run_number(j: Journal) -> int:
    """The first run whose tool call ids this journal has not seen, so a rerun starts fresh.

    A run is seen when the projection has a row for one of its calls: archiving moves a call's
    events out of the journal but keeps its row (and a retry of it is replayed or refused), so
    the rows, not the events, tell which ids are taken. The events are asked too, for an id the
    journal only refused (no row)."""
    run = 1
    while any(j.call(f"call_r{run}_{n}") is not None for n in range(1, 6)) or j.call_events(f"call_r{run}_1"):
        run += 1
    return run


def _money(cents: int) -> str:
    return f"{cents // 100}.{cents % 100:02d}"


class _Script:
    """One run of the demo: the agent's guarded tools on the journal and the backend, and how its
    lines are printed."""

    def __init__(self, j: Journal, backend: PaymentBackend, colour: bool) -> None:
        self.journal = j
        self.backend = backend
        self.colour = colour
        policy = SecurityPolicy(allowed_tools=["charge", "read_balance"], effect_guard=EffectGuard(store=j))

        @Airlock(policy=policy)
        def charge(account: str, cents: int) -> dict[str, Any]:
            context = get_current_context()
            assert context is not None and context.idempotency_key is not None
            return backend.charge(account, cents, context.idempotency_key)

        @reversibility("reversible")
        @Airlock(policy=policy)
        def read_balance(account: str) -> int:
            return backend.balance(account)

        def with_check() -> Any:
            # The same tool (its name is the function's) for an agent whose charge carries a check.
            @reconciled_by(backend.charge_made)
            @Airlock(policy=policy)
            def charge(account: str, cents: int) -> dict[str, Any]:
                context = get_current_context()
                assert context is not None and context.idempotency_key is not None
                return backend.charge(account, cents, context.idempotency_key)

            return charge

        self.charge, self.read_balance, self.charge_checked = charge, read_balance, with_check()
        # A refund needs an operator's approval, asked for in the journal and given from the CLI.
        approved = SecurityPolicy(allowed_tools=["refund"], escalate_tools={"refund": "gives money back"},
                                  approver=ApprovalQueue(ttl=3600), effect_guard=EffectGuard(store=j))

        @Airlock(policy=approved)
        def refund(charge_id: str, cents: int) -> dict[str, Any]:
            return backend.refund(charge_id, cents)

        self.refund = refund

    def call(self, tool_call_id: str, tool: Any, **arguments: Any) -> Any:
        """What the host does with the model's tool call: run it under the call's id."""
        with AirlockContext(agent_id=AGENT, metadata={"tool_call_id": tool_call_id}):
            return tool(**arguments)

    def recorded(self, tool_call_id: str) -> str:
        record = self.journal.call(tool_call_id)
        return "nothing" if record is None else record.status

    def heading(self, text: str) -> None:
        echo(click.style(text, bold=True) if self.colour else text)

    def say(self, who: str, text: str, status: str | None = None) -> None:
        label = f"   {who + ':':9}"
        echo(f"{label}{render.paint(text, status, self.colour) if status else text}")


@click.command()
@click.option("--db", default=DEFAULT_DEMO_DB, show_default=True, metavar="PATH_OR_URL", callback=journal_target,
              help="The journal to record the demo's calls in; created if missing, reusable.")
@click.option("--approvals", "with_approvals", is_flag=True,
              help="Also a refund that waits for an operator's approval, given with `airlock journal approve`.")
def demo(db: str, with_approvals: bool) -> None:
    """Watch the journal stop a second charge when a payment's answer gets lost.

    A scripted agent pays three invoices through an in-process payment backend. The first
    answer is lost on its way back to the model, which retries: the journal replays the
    stored receipt. The second charge times out: the call is recorded unknown and the retry
    is refused, so nobody is charged twice. With --approvals, a refund also waits for an
    operator's approval, given with `airlock journal approve`, and then runs once. It ends
    with what an operator sees and the command that settles the unknown call. The journal is
    kept (./airlock-demo.db unless --db says otherwise) so you can explore it with
    `airlock journal`; every run adds new calls.

    Example:

    \b
        airlock demo

    \b
        airlock demo --approvals

    \b
        airlock journal show --db airlock-demo.db
    """
    with open_journal(db) as j:
        script = _Script(j, PaymentBackend(), render.use_colour())
        shown = describe(db)  # a URL's password is never printed
        run = _run_number(j)
        first, second, third, fourth, fifth = (f"call_r{run}_{n}" for n in (1, 2, 3, 4, 5))
        script.heading(f"airlock demo: run {run}, journal {shown}")
        echo()
        _lost_receipt(script, run, first)
        _lost_answer(script, run, second)
        _balance(script, third)
        _backend_answers(script, run, fourth)
        if with_approvals:
            _approved_refund(script, run, fifth, db)
        _ledger(script)
        _what_the_operator_sees(script, shown, second, with_approvals)


def _lost_receipt(script: _Script, run: int, call_id: str) -> None:
    """Step 1: the charge is made, its receipt lost on the way to the model; the retry is replayed."""
    say, backend = script.say, script.backend
    script.heading(f"1. Pay invoice A-{run}: charge(account='acct_alice', cents=1250), tool call {call_id}")
    receipt = script.call(call_id, script.charge, account="acct_alice", cents=1250)
    say("backend", f"charged {receipt['charge_id']} ({_money(receipt['cents'])} from acct_alice)")
    say("journal", f"{script.recorded(call_id)}, with the receipt", script.recorded(call_id))
    say("host", "the connection to the model drops: the receipt never reaches it")
    say("model", f"retries tool call {call_id}")
    replay = script.call(call_id, script.charge, account="acct_alice", cents=1250)
    say("journal", f"replayed the stored receipt of {replay['charge_id']} to the model", "replayed")
    say("backend", f"not called again; {len(backend.ledger)} charge so far")
    echo()


def _lost_then_retried(script: _Script, call_id: str, tool: Any, **arguments: Any) -> Any:
    """A charge whose answer is lost after it was made, and the model's retry; what the retry got."""
    say, backend = script.say, script.backend
    backend.lose_next_answer = True
    try:
        script.call(call_id, tool, **arguments)
    except TimeoutError as e:
        say("backend", f"charged ch_{len(backend.ledger)}, but the answer is lost ({type(e).__name__}: {e})")
    say("journal", f"{script.recorded(call_id)}: it may or may not have happened", script.recorded(call_id))
    say("model", f"retries tool call {call_id}")
    return script.call(call_id, tool, **arguments)


def _lost_answer(script: _Script, run: int, call_id: str) -> None:
    """Step 2: the charge times out after it was made: the call is unknown, and its retry refused."""
    say, backend = script.say, script.backend
    script.heading(f"2. Pay invoice B-{run}: charge(account='acct_bob', cents=4200), tool call {call_id}")
    refusal = _lost_then_retried(script, call_id, script.charge, account="acct_bob", cents=4200)
    if not is_refusal(refusal):
        raise click.ClickException(f"the retry of {call_id} was not refused: {refusal!r}")
    say("journal", f"refused {refusal['block_reason']}: the tool was not run again", "refused")
    say("backend", f"not called again; {len(backend.ledger)} charges so far")
    echo()


def _balance(script: _Script, call_id: str) -> None:
    """Step 3: a reversible tool, which runs whenever it is called."""
    script.heading(f"3. Check: read_balance(account='acct_bob'), tool call {call_id} (a reversible tool)")
    balance = script.call(call_id, script.read_balance, account="acct_bob")
    script.say("backend", f"acct_bob was charged {_money(balance)}")
    echo()


def _backend_answers(script: _Script, run: int, call_id: str) -> None:
    """Step 4: the same lost answer, for a tool with a check: the retry asks the backend itself."""
    say, backend = script.say, script.backend
    script.heading(f"4. Pay invoice C-{run}: charge(account='acct_carol', cents=990), tool call {call_id}, "
                   "a tool with a check")
    receipt = _lost_then_retried(script, call_id, script.charge_checked, account="acct_carol", cents=990)
    if is_refusal(receipt):
        raise click.ClickException(f"the check did not settle {call_id}: {receipt!r}")
    record = script.journal.call(call_id)
    assert record is not None and record.reason is not None
    say("journal", f"asked the backend first: {record.reason['message']}", "committed")
    say("journal", f"settled it {record.status} by {record.actor}, and replayed {receipt['charge_id']}", "replayed")
    say("backend", f"not called again; {len(backend.ledger)} charges so far")
    echo()


def _approved_refund(script: _Script, run: int, call_id: str, db: str) -> None:
    """Step 5: a refund that waits for an operator: refused approval_pending, approved from the CLI,
    then run once by the agent's retry."""
    from .approvals import approve

    say, backend = script.say, script.backend
    script.heading(f"5. Refund ch_1 of invoice A-{run}: refund(charge_id='ch_1', cents=1250), tool call {call_id}, "
                   "which needs an operator's approval")
    waiting = script.call(call_id, script.refund, charge_id="ch_1", cents=1250)
    if not is_refusal(waiting) or waiting["block_reason"] != "approval_pending":
        raise click.ClickException(f"the refund {call_id} did not wait for approval: {waiting!r}")
    say("journal", f"refused {waiting['block_reason']}: request {waiting['metadata']['request_id']} waits "
                   "for an operator", "refused")
    say("model", "tells the user the refund waits for approval, and retries later")
    command = ["approve", call_id, "--operator", "demo-operator", "--reason", "refund agreed with alice",
               "--db", db]
    say("ops", f"airlock journal {' '.join(shlex.quote(a) for a in command[:-2])}")
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):  # the command's own lines, shown as the operator sees them
            approve.main(command[1:], prog_name="airlock journal approve", standalone_mode=False)
    except click.ClickException as e:
        raise click.ClickException(f"the approval of {call_id} failed: {e.format_message()}") from e
    for line in printed.getvalue().splitlines():
        echo(f"   {'':9}{line}")
    say("model", f"retries tool call {call_id}")
    receipt = script.call(call_id, script.refund, charge_id="ch_1", cents=1250)
    if is_refusal(receipt):
        raise click.ClickException(f"the approved refund {call_id} was refused: {receipt!r}")
    say("backend", f"refunded {receipt['refund_id']} ({_money(receipt['cents'])} of ch_1); "
                   f"{len(backend.refunds)} refund in all", "committed")
    echo()


def _ledger(script: _Script) -> None:
    """The backend's charges: two, for two payments, however many times the model retried."""
    backend = script.backend
    script.heading(f"The backend's ledger: {len(backend.ledger)} charges for 3 intended payments")
    for entry in backend.ledger:
        echo(f"   {entry['charge_id']}  {entry['account']:<10}  {_money(entry['cents']):>6}  "
             f"key {entry['idempotency_key'][:12]}{render.ELLIPSIS}")
    if len(backend.ledger) != 3:
        raise click.ClickException(f"expected 3 charges, the backend made {len(backend.ledger)}")
    echo()


def _what_the_operator_sees(script: _Script, shown: str, second: str, with_approvals: bool) -> None:
    """The end: the calls as `airlock journal show` lists them, and how the unknown call is settled."""
    shown_calls = 5 if with_approvals else 4
    show_command = f"airlock journal show --db {shlex.quote(shown)} --limit {shown_calls}"
    script.heading(f"What `{show_command}` shows the operator:")
    records = script.journal.calls(limit=shown_calls)
    for line in render.calls_table(records, width=render.terminal_width(), colour=script.colour):
        echo(f"   {line}")
    echo()

    unknown = script.journal.call(second)
    assert unknown is not None and unknown.idempotency_key is not None
    found = script.backend.lookup(unknown.idempotency_key)
    script.heading(f"{second} stays unknown until someone asks the backend about key "
                   f"{unknown.idempotency_key[:12]}{render.ELLIPSIS}")
    if found is not None:
        echo(f"   The backend has {found['charge_id']} for that key, so the operator settles it with:")
        value = orjson.dumps(found).decode()
        reason = f"backend ledger has {found['charge_id']} for this idempotency key"
        echo(f"   airlock journal resolve {second} --db {shlex.quote(shown)} --applied \\\n"
             f"       --value {shlex.quote(value)} \\\n"
             f"       --reason {shlex.quote(reason)}")
    echo("   Or let the backend answer, as it did for invoice C: put a check on the tool with\n"
         "   @reconciled_by(check), and the next retry asks it; `airlock journal reconcile --with MODULE`\n"
         "   asks it for every call in doubt (docs/runbook.md, \"Let the backend answer\").")
