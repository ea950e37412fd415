"""``airlock demo``: an agent pays through a backend whose answers get lost, and nobody is charged twice."""

from __future__ import annotations

import shlex
from typing import Any

import click
import orjson

from guard import Airlock, AirlockContext, SecurityPolicy, get_current_context, is_refusal
from guard.effect_guard import EffectGuard, reversibility
from journal import open_journal

from . import render
from .options import describe, echo, journal_target

DEFAULT_DEMO_DB = "airlock-demo.db"
AGENT = "billing-agent"


class PaymentBackend:
    """A payment provider in this process: a ledger of charges, looked up by idempotency key,
    behind a network that can lose an answer after the charge was made."""

    def __init__(self) -> None:
        self.ledger: list[dict[str, Any]] = []
        self.lose_next_answer = False

    def charge(self, account: str, cents: int, idempotency_key: str) -> dict[str, Any]:
        receipt = {"charge_id": f"ch_{len(self.ledger) + 1}", "account": account, "cents": cents,
                   "status": "succeeded"}
        self.ledger.append({**receipt, "idempotency_key": idempotency_key})
        if self.lose_next_answer:
            self.lose_next_answer = False
            raise TimeoutError("no answer within 5s")
        return receipt

    def balance(self, account: str) -> int:
        return sum(entry["cents"] for entry in self.ledger if entry["account"] == account)

    def lookup(self, idempotency_key: str) -> dict[str, Any] | None:
        """What an operator asks the provider: was a charge with this key made?"""
        for entry in self.ledger:
            if entry["idempotency_key"] == idempotency_key:
                return {k: v for k, v in entry.items() if k != "idempotency_key"}
        return None


def _run_number(j: Any) -> int:
    """The first run whose tool call ids this journal has not seen, so a rerun starts fresh."""
    run = 1
    while j.call_events(f"call_r{run}_1"):
        run += 1
    return run


def _money(cents: int) -> str:
    return f"{cents // 100}.{cents % 100:02d}"


@click.command()
@click.option("--db", default=DEFAULT_DEMO_DB, show_default=True, metavar="PATH_OR_URL", callback=journal_target,
              help="The journal to record the demo's calls in; created if missing, reusable.")
def demo(db: str) -> None:
    """Watch the journal stop a second charge when a payment's answer gets lost.

    A scripted agent pays two invoices through an in-process payment backend. The first
    answer is lost on its way back to the model, which retries: the journal replays the
    stored receipt. The second charge times out: the call is recorded unknown and the retry
    is refused, so nobody is charged twice. It ends with what an operator sees and the
    command that settles the unknown call. The journal is kept (./airlock-demo.db unless
    --db says otherwise) so you can explore it with `airlock journal`; every run adds new calls.

    Example:

    \b
        airlock demo

    \b
        airlock journal show --db airlock-demo.db
    """
    colour = render.use_colour()

    def heading(text: str) -> None:
        echo(click.style(text, bold=True) if colour else text)

    def say(who: str, text: str, status: str | None = None) -> None:
        label = f"   {who + ':':9}"
        echo(f"{label}{render.paint(text, status, colour) if status else text}")

    backend = PaymentBackend()
    with open_journal(db) as j:
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

        def call(tool_call_id: str, tool: Any, **arguments: Any) -> Any:
            with AirlockContext(agent_id=AGENT, metadata={"tool_call_id": tool_call_id}):
                return tool(**arguments)

        def recorded(tool_call_id: str) -> str:
            record = j.call(tool_call_id)
            return "nothing" if record is None else record.status

        shown = describe(db)  # a URL's password is never printed
        run = _run_number(j)
        first, second, third = (f"call_r{run}_{n}" for n in (1, 2, 3))
        heading(f"airlock demo: run {run}, journal {shown}")
        echo()

        heading(f"1. Pay invoice A-{run}: charge(account='acct_alice', cents=1250), tool call {first}")
        receipt = call(first, charge, account="acct_alice", cents=1250)
        say("backend", f"charged {receipt['charge_id']} ({_money(receipt['cents'])} from acct_alice)")
        say("journal", f"{recorded(first)}, with the receipt", recorded(first))
        say("host", "the connection to the model drops: the receipt never reaches it")
        say("model", f"retries tool call {first}")
        replay = call(first, charge, account="acct_alice", cents=1250)
        say("journal", f"replayed the stored receipt of {replay['charge_id']} to the model", "replayed")
        say("backend", f"not called again; {len(backend.ledger)} charge so far")
        echo()

        heading(f"2. Pay invoice B-{run}: charge(account='acct_bob', cents=4200), tool call {second}")
        backend.lose_next_answer = True
        try:
            call(second, charge, account="acct_bob", cents=4200)
        except TimeoutError as e:
            say("backend", f"charged ch_{len(backend.ledger)}, but the answer is lost ({type(e).__name__}: {e})")
        say("journal", f"{recorded(second)}: it may or may not have happened", recorded(second))
        say("model", f"retries tool call {second}")
        refusal = call(second, charge, account="acct_bob", cents=4200)
        if not is_refusal(refusal):
            raise click.ClickException(f"the retry of {second} was not refused: {refusal!r}")
        say("journal", f"refused {refusal['block_reason']}: the tool was not run again", "refused")
        say("backend", f"not called again; {len(backend.ledger)} charges so far")
        echo()

        heading(f"3. Check: read_balance(account='acct_bob'), tool call {third} (a reversible tool)")
        say("backend", f"acct_bob was charged {_money(call(third, read_balance, account='acct_bob'))}")
        echo()

        heading(f"The backend's ledger: {len(backend.ledger)} charges for 2 intended payments")
        for entry in backend.ledger:
            echo(f"   {entry['charge_id']}  {entry['account']:<10}  {_money(entry['cents']):>6}  "
                       f"key {entry['idempotency_key'][:12]}{render.ELLIPSIS}")
        if len(backend.ledger) != 2:
            raise click.ClickException(f"expected 2 charges, the backend made {len(backend.ledger)}")
        echo()

        show_command = f"airlock journal show --db {shlex.quote(shown)} --limit 3"
        heading(f"What `{show_command}` shows the operator:")
        records = j.calls(limit=3)
        for line in render.calls_table(records, width=render.terminal_width(), colour=colour):
            echo(f"   {line}")
        echo()

        unknown = j.call(second)
        assert unknown is not None and unknown.idempotency_key is not None
        found = backend.lookup(unknown.idempotency_key)
        heading(f"{second} stays unknown until someone asks the backend about key "
                f"{unknown.idempotency_key[:12]}{render.ELLIPSIS}")
        if found is not None:
            echo(f"   The backend has {found['charge_id']} for that key, so the operator settles it with:")
            value = orjson.dumps(found).decode()
            reason = f"backend ledger has {found['charge_id']} for this idempotency key"
            echo(f"   airlock journal resolve {second} --db {shlex.quote(shown)} --applied \\\n"
                       f"       --value {shlex.quote(value)} \\\n"
                       f"       --reason {shlex.quote(reason)}")
