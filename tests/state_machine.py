"""A hypothesis state machine that drives the guard against a plain model of the replay table.

``make_state_machine(factory)`` builds a ``RuleBasedStateMachine`` for one store: each run gets a
fresh store from ``factory(path)``; after every step it checks that the call's result is what the
model says, that no non-reversible call took effect twice, and that the store's projection equals
the fold of its log. The non-reversible tools carry a check (``@reconciled_by``) that answers as
the backend would (applied with a value, or not applied), cannot tell, or raises; a retry of a call
in doubt asks it, and a bulk ``reconcile`` settles the journals' calls in doubt.

On a store that keeps leases, two hostile steps: a reconciler killed mid-check (its claim stays
in the leases table, live, so no other check may take the call meanwhile) and a stale lease row
(another holder's, run out) on a call; and a call whose tool is still running in another thread
(a live owner, without a lease) while both are left on it: no retry, check or bulk reconcile may
run it again.

``make_approval_state_machine(factory)`` adds, on a store that keeps approvals (SPEC section 10),
an escalated tool, ``refund``, whose approver is an ``ApprovalQueue`` of a quorum drawn 1 or 2,
sharing the store with the tools above (every rule and invariant above runs too). Its calls are
asked, retried (alone or from threads at once), approved, denied and expired against a model of
the request table of docs/approvals.md; after every step the log must show that every run of the
tool, and every replay, consumed a grant of its own, quorum-approved and never consumed before.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
)

from guard import Airlock, AirlockContext, SecurityPolicy, is_refusal
from guard.approvals import ApprovalQueue, NotDecidable, apply_approval, decide_request, expire_overdue, fold_approvals
from guard.context import get_current_context
from guard.effect_guard import EffectGuard, reversibility
from guard.leases import LeaseStore
from guard.reconcile import Applied, InDoubtCall, NotApplied, reconciled_by
from guard.store import CallRecord, EffectEvent, apply, utc_now

# "lost_before": a timeout before the backend was reached (no effect, recorded unknown).
OUTCOMES = ("value", "ambiguous", "other_error", "generator", "interrupt", "unstorable", "lost_before")
CHECK_MODES = ("truth", "cannot_tell", "raises")
TOOLS = {"pay": "irreversible", "ship": "costly", "lookup": "reversible"}


class Interrupted(BaseException):
    """Stands for cancellation: a BaseException that is no Exception."""


@dataclass
class ModelCall:
    tool: str
    args: dict[str, Any]
    status: str
    attempt: int
    value: Any = None
    has_value: bool = False


@dataclass
class Effects:
    """Effects counted outside the store: (call_id, tool) -> times the tool took effect."""

    took_effect: dict[str, int] = field(default_factory=dict)


def _effective(outcome: str) -> bool:
    # A tool that raised an ordinary error is taken to have had no effect (that is what `released` says).
    return outcome not in ("other_error", "lost_before")


def make_state_machine(factory: Callable[[Path], Any]) -> type[RuleBasedStateMachine]:
    """A state machine class that runs every example on a fresh store made by ``factory``."""

    class GuardMachine(RuleBasedStateMachine):
        call_ids = Bundle("call_ids")

        def __init__(self) -> None:
            super().__init__()
            self.dir = Path(tempfile.mkdtemp(prefix="airlock-sm-"))
            self.store = factory(self.dir)
            self.model: dict[str, ModelCall] = {}
            self.effects = Effects()
            self.next_outcome = "value"
            self.counter = 0
            self.check_mode = "truth"
            self.settles = callable(getattr(self.store, "settle", None))
            self.claimed: set[str] = set()  # calls a killed reconciler's live claim still holds
            self.gate: threading.Event | None = None  # holds the tool of a call running in a thread
            policy = SecurityPolicy(effect_guard=EffectGuard(store=self.store))
            self.tools: dict[str, Callable[..., Any]] = {}
            for name, tag in TOOLS.items():
                tool = reversibility(tag)(Airlock(policy=policy)(self._make_tool(name)))
                self.tools[name] = tool if tag == "reversible" else reconciled_by(self.check)(tool)

        def check(self, call: InDoubtCall) -> Any:
            """The backend's answer about ``call``: the truth, nothing yet, or an error."""
            if self.check_mode == "raises":
                raise ConnectionError("the backend is down")
            if self.check_mode == "cannot_tell":
                return None
            if self.effects.took_effect.get(call.call_id, 0):
                return Applied(value={"found": call.call_id}, evidence="the backend has it")
            return NotApplied(evidence="the backend has no such operation")

        def settled(self, entry: ModelCall) -> bool:
            """Settle a model call in doubt as the check would; False when the check does not say."""
            if self.check_mode != "truth" or not self.settles:
                return False
            call_id = next(k for k, v in self.model.items() if v is entry)
            if call_id in self.claimed:
                return False  # a killed reconciler's claim holds it: no check may take it
            if self.effects.took_effect.get(call_id, 0):
                entry.status, entry.value, entry.has_value = "committed", {"found": call_id}, True
            else:
                entry.status = "released"
            return True

        def teardown(self) -> None:
            close = getattr(self.store, "close", None)
            if close is not None:
                close()
            shutil.rmtree(self.dir, ignore_errors=True)

        def _make_tool(self, name: str) -> Callable[..., Any]:
            machine = self

            def tool(account: str, cents: int) -> Any:
                outcome = machine.next_outcome
                call_id = machine.current_id
                if _effective(outcome):
                    machine.effects.took_effect[call_id] = machine.effects.took_effect.get(call_id, 0) + 1
                gate = machine.gate
                if gate is not None and call_id == machine.running_id:
                    gate.wait()  # a live owner: its tool runs until the step lets it finish
                machine.counter += 1
                if outcome == "value":
                    return {"n": machine.counter, "pair": (account, cents)}
                if outcome in ("ambiguous", "lost_before"):
                    raise TimeoutError("response lost")
                if outcome == "other_error":
                    raise ValueError("declined")
                if outcome == "generator":
                    return iter([1, 2])
                if outcome == "interrupt":
                    raise Interrupted()
                return object()

            tool.__name__ = name
            return tool

        # -- the model of the replay table (section 2.6) ----------------------------------------

        def expected(self, call_id: str, tool: str, args: dict[str, Any]) -> tuple[str, Any]:
            prior = self.model.get(call_id)
            if prior is None:
                return ("run", None)
            if prior.tool != tool or prior.args != args:
                return ("refuse", "policy_violation")
            if prior.status == "committed":
                return ("replay", prior.value) if prior.has_value else ("refuse", "replay_value_unavailable")
            if prior.status == "released" or TOOLS[tool] == "reversible":
                return ("run", None)
            if self.settled(prior):  # the retry asked the tool's check first
                return self.expected(call_id, tool, args)
            return ("refuse", "effect_status_unknown")

        def call(self, call_id: str, tool: str, args: dict[str, Any], outcome: str) -> None:
            self.current_id = call_id
            self.next_outcome = outcome
            want, detail = self.expected(call_id, tool, args)
            raised: BaseException | None = None
            result: Any = None
            with AirlockContext(agent_id="agent", metadata={"tool_call_id": call_id}):
                try:
                    result = self.tools[tool](**args)
                except (TimeoutError, ValueError, Interrupted) as e:
                    raised = e
            if want == "refuse":
                assert raised is None and is_refusal(result), (want, detail, result, raised)
                assert result["block_reason"] == detail, (detail, result)
                return
            if want == "replay":
                assert raised is None and not is_refusal(result), result
                assert result == detail
                return
            # The tool ran: what the caller got, and what the model now records.
            prior = self.model.get(call_id)
            attempt = 1 if prior is None else prior.attempt + 1
            entry = ModelCall(tool, args, "pending", attempt)
            if outcome == "value":
                assert raised is None and result["pair"] == (args["account"], args["cents"]), result
                entry.status, entry.has_value = "committed", True
                entry.value = orjson.loads(orjson.dumps(result, option=orjson.OPT_SORT_KEYS))
            elif outcome == "unstorable":
                assert raised is None and type(result) is object
                entry.status = "committed"
            elif outcome == "generator":
                assert raised is None and list(result) == [1, 2]
                entry.status = "unknown"
            elif outcome in ("ambiguous", "lost_before"):
                assert isinstance(raised, TimeoutError)
                entry.status = "unknown"
            elif outcome == "interrupt":
                assert isinstance(raised, Interrupted)
                entry.status = "unknown"
            else:
                assert isinstance(raised, ValueError)
                entry.status = "released"
            self.model[call_id] = entry

        # -- rules -----------------------------------------------------------------------------

        @rule(
            target=call_ids,
            tool=st.sampled_from(sorted(TOOLS)),
            cents=st.integers(0, 3),
            outcome=st.sampled_from(OUTCOMES),
        )
        def new_call(self, tool: str, cents: int, outcome: str) -> Any:
            call_id = f"call-{len(self.model)}-{self.counter}"
            self.call(call_id, tool, {"account": "acct", "cents": cents}, outcome)
            return multiple(call_id)

        @rule(
            call_id=call_ids,
            same_tool=st.booleans(),
            same_args=st.booleans(),
            outcome=st.sampled_from(OUTCOMES),
        )
        def retry(self, call_id: str, same_tool: bool, same_args: bool, outcome: str) -> None:
            prior = self.model.get(call_id)
            if prior is None:
                return
            tool = prior.tool if same_tool else sorted(set(TOOLS) - {prior.tool})[0]
            args = dict(prior.args) if same_args else {"account": "acct", "cents": prior.args["cents"] + 10}
            self.call(call_id, tool, args, outcome)

        @rule(call_id=consumes(call_ids), outcome=st.sampled_from(OUTCOMES))
        def retry_same_until_settled(self, call_id: str, outcome: str) -> None:
            prior = self.model.get(call_id)
            if prior is not None:
                self.call(call_id, prior.tool, dict(prior.args), outcome)

        @rule(mode=st.sampled_from(CHECK_MODES))
        def backend_answers(self, mode: str) -> None:
            self.check_mode = mode

        @rule()
        def reconcile_in_bulk(self) -> None:
            self._bulk()

        def _bulk(self) -> dict[str, Any]:
            """A bulk reconcile, checked against the model; every call's result."""
            reconcile = getattr(self.store, "reconcile", None)
            if reconcile is None:
                return {}
            checks = {name: self.check for name, tag in TOOLS.items() if tag != "reversible"}
            results = {r.call_id: r for r in reconcile(checks)}
            for call_id, entry in self.model.items():
                if entry.status not in ("pending", "unknown"):
                    assert call_id not in results
                    continue
                result = results[call_id]
                if TOOLS[entry.tool] == "reversible" or call_id in self.claimed:
                    assert result.outcome == "skipped"
                elif self.settled(entry):
                    assert result.outcome == ("applied" if entry.status == "committed" else "not_applied")
                    assert result.seq is not None
                else:
                    assert result.outcome == ("still_unknown" if self.check_mode == "cannot_tell" else "error")
            return results

        @rule(call_id=call_ids)
        def reconciler_killed_mid_check(self, call_id: str) -> None:
            if not isinstance(self.store, LeaseStore):
                return
            entry = self.model.get(call_id)
            # A reconciler claims a call, then is killed before it drops its claim, which stays live.
            took = self.store.claim_lease(call_id, f"killed-{uuid.uuid4().hex}", 3600.0)
            assert took == (entry is not None and call_id not in self.claimed), (call_id, entry)
            if took:
                self.claimed.add(call_id)

        @rule(call_id=call_ids)
        def stale_lease_row(self, call_id: str) -> None:
            if isinstance(self.store, LeaseStore):
                self.store.take_lease(call_id, f"stale-{uuid.uuid4().hex}", 0.0)  # run out at once

        @rule(tool=st.sampled_from(sorted(t for t, tag in TOOLS.items() if tag != "reversible")),
              cents=st.integers(0, 3))
        def live_owner_left_alone(self, tool: str, cents: int) -> None:
            """A call whose tool runs in another thread (no lease), with a stale row and a killed
            reconciler's run-out claim left on it: a retry is refused, a bulk reconcile skips it."""
            if not isinstance(self.store, LeaseStore):
                return
            call_id = f"live-{len(self.model)}-{self.counter}"
            args = {"account": "acct", "cents": cents}
            self.gate, self.running_id = threading.Event(), call_id
            self.current_id, self.next_outcome = call_id, "value"
            results: list[Any] = []

            def owner() -> None:
                with AirlockContext(agent_id="agent", metadata={"tool_call_id": call_id}):
                    results.append(self.tools[tool](**args))

            thread = threading.Thread(target=owner)
            thread.start()
            try:
                while self.effects.took_effect.get(call_id, 0) == 0:
                    assert thread.is_alive(), results
                    self.gate.wait(0.01)
                self.store.take_lease(call_id, f"stale-{uuid.uuid4().hex}", 0.0)
                assert self.store.claim_lease(call_id, f"killed-{uuid.uuid4().hex}", 0.0) is False
                assert self.store.owner_states([self.store.get(call_id)])[call_id].alive is True
                with AirlockContext(agent_id="agent", metadata={"tool_call_id": call_id}):
                    retried = self.tools[tool](**args)
                assert is_refusal(retried) and retried["block_reason"] == "effect_status_unknown", retried
                bulk = self._bulk()
                if bulk:
                    assert bulk[call_id].outcome == "skipped", bulk[call_id]
            finally:
                self.gate.set()
                thread.join()
                self.gate = None
            assert results and results[0]["pair"] == ("acct", cents), results
            entry = ModelCall(tool, args, "committed", 1, has_value=True)
            entry.value = orjson.loads(orjson.dumps(results[0], option=orjson.OPT_SORT_KEYS))
            self.model[call_id] = entry

        # -- invariants ------------------------------------------------------------------------

        @invariant()
        def chain_verifies(self) -> None:
            verify = getattr(self.store, "verify", None)
            if verify is not None:
                assert verify().ok

        @invariant()
        def no_double_effect(self) -> None:
            for call_id, count in self.effects.took_effect.items():
                entry = self.model.get(call_id)
                if entry is not None and TOOLS[entry.tool] != "reversible":
                    assert count <= 1, f"{call_id} ({entry.tool}) took effect {count} times"

        @invariant()
        def store_matches_model(self) -> None:
            for call_id, entry in self.model.items():
                record = self.store.get(call_id)
                assert record is not None, call_id
                assert (record.status, record.attempt, record.tool) == (entry.status, entry.attempt, entry.tool)

        @invariant()
        def projection_is_fold_of_log(self) -> None:
            folded: dict[str, CallRecord | None] = {}
            for event in self.store.events():
                effect = event.to_effect_event() if hasattr(event, "to_effect_event") else event
                if effect.call_id is not None:
                    folded[effect.call_id] = apply(folded.get(effect.call_id), effect, effect.seq)
            for call_id in self.model:
                got, want = self.store.get(call_id), folded.get(call_id)
                assert want is not None
                assert (got.status, got.attempt, got.value, got.idempotency_key, got.last_seq) == (
                    want.status, want.attempt, want.value, want.idempotency_key, want.last_seq
                )

    return GuardMachine


# -- approvals that wait for a human (SPEC section 10) -------------------------------------------

ESCALATION = "gives money back"
OPERATORS = ("alice", "bob", "carol")
# What the escalated tool does when it runs: a value, an ordinary error (released), a lost
# response (unknown: a grant then finds the call in doubt and is kept), a value no store can keep
# (committed without one: a grant then finds nothing to replay and is kept).
REFUND_OUTCOMES = ("value", "other_error", "ambiguous", "unstorable")
OUTCOME_KIND = {"value": "committed", "unstorable": "committed", "other_error": "released", "ambiguous": "unknown"}
SHORT_TTL = 0.05  # the ttl of the requests a rule marks to expire; every other request has an hour
# Drawn more often than not, so that requests live long enough to be granted and used.
MOSTLY = st.sampled_from((True, True, True, False))
RARELY = st.sampled_from((False, False, False, True))


@dataclass
class ModelRequest:
    """The model of a call's latest request (docs/approvals.md, "The model")."""

    args: dict[str, Any]
    replay: bool | None  # None: made in a race while the winner's attempt may still have been pending
    overdue: bool = False  # open, past its expires_at (only a request a rule marked short)
    status: str = "open"
    approvers: list[str] = field(default_factory=list)
    answered: bool = False
    denial: str | None = None
    request_id: str | None = None


@dataclass
class RefundCall:
    """The model of one call of the escalated tool: the replay table's record and the request."""

    record: ModelCall | None = None
    request: ModelRequest | None = None
    foreign: bool = False  # another (unescalated) tool ran under this id before any grant

    def bound_args(self) -> dict[str, Any] | None:
        if self.record is not None:
            return self.record.args
        return None if self.request is None else self.request.args


def make_approval_state_machine(factory: Callable[[Path], Any]) -> type[RuleBasedStateMachine]:
    """The machine of :func:`make_state_machine` with an escalated tool whose approver is an
    ``ApprovalQueue`` on the same store (which must keep approvals)."""

    base = make_state_machine(factory)

    class ApprovalMachine(base):  # type: ignore[misc,valid-type]
        refund_ids = Bundle("refund_ids")
        # The replay table's machine runs on every store too: of its rules, this one keeps those
        # that put other tools' calls beside the refunds (new calls, retries, a bulk reconcile,
        # which must leave the refunds alone), not the hostile lease steps nor the backend's
        # moods, which would only take steps from the approvals. Every invariant is kept.
        reconciler_killed_mid_check = stale_lease_row = live_owner_left_alone = None
        backend_answers = retry_same_until_settled = None

        def __init__(self) -> None:
            super().__init__()
            self.refunds: dict[str, RefundCall] = {}
            self.refund_runs: dict[str, list[int | None]] = {}  # call id -> the attempt of each run
            self.refund_lock = threading.Lock()
            self.refund_outcome = "value"
            self.quorum = 1
            self.decisions = 0

        @initialize(target=refund_ids, quorum=st.sampled_from((1, 2)), cents=st.integers(0, 3))
        def escalate(self, quorum: int, cents: int) -> Any:
            """The escalated tool, in two wrappers that differ only in the ttl of the requests they
            make: ``refund`` (an hour) and ``refund_soon`` (SHORT_TTL, for the requests a rule
            marks to expire); and its first call, asked."""
            self.quorum = quorum
            guard = EffectGuard(store=self.store)
            self.refund, self.refund_soon = (
                reversibility("irreversible")(Airlock(policy=SecurityPolicy(
                    escalate_tools={"refund": ESCALATION}, approver=ApprovalQueue(ttl=ttl, quorum=quorum),
                    effect_guard=guard))(self._make_refund()))
                for ttl in (3600.0, SHORT_TTL)
            )
            return self.ask_refund(cents, False)

        def _make_refund(self) -> Callable[..., Any]:
            machine = self

            def refund(account: str, cents: int) -> Any:
                context = get_current_context()
                assert context is not None and context.tool_call_id is not None
                with machine.refund_lock:
                    machine.refund_runs.setdefault(context.tool_call_id, []).append(
                        getattr(context, "attempt", None))
                    machine.counter += 1
                    n = machine.counter
                outcome = machine.refund_outcome
                if outcome == "value":
                    return {"n": n, "pair": (account, cents)}
                if outcome == "ambiguous":
                    raise TimeoutError("response lost")
                if outcome == "other_error":
                    raise ValueError("declined")
                return object()

            refund.__name__ = "refund"
            return refund

        # -- the model of the request table (docs/approvals.md) ---------------------------------

        def predict(self, entry: RefundCall, args: dict[str, Any], outcome: str, short: bool,
                    in_race: bool = False) -> tuple[str, Any, list[str]]:
            """What one attempt of ``refund(**args)`` does: ("run", outcome), ("replay", value) or
            ("refuse", code), and the kinds of the events it appends; the model is moved on."""
            rec, req = entry.record, entry.request
            if rec is not None and (rec.tool != "refund" or rec.args != args):
                return "refuse", "policy_violation", ["refused"]  # section 2.6: the id is taken
            if rec is None and req is not None and req.status in ("open", "approved") and req.args != args:
                return "refuse", "policy_violation", ["refused"]  # the id waits for other arguments
            kinds: list[str] = []
            if req is not None and req.status == "open" and req.overdue:
                kinds.append("expired")
                req.status, req.answered = "expired", False
            if req is not None and req.status == "approved" and req.args == args:
                assert rec is None or rec.tool == "refund"
                if rec is None or rec.status == "released":
                    req.status = "consumed"
                    entry.record = ModelCall("refund", dict(args), OUTCOME_KIND[outcome],
                                             1 if rec is None else rec.attempt + 1,
                                             has_value=outcome == "value")
                    return "run", outcome, [*kinds, "approval_consumed", "pending", OUTCOME_KIND[outcome]]
                if rec.status == "committed" and rec.has_value:
                    req.status = "consumed"
                    return "replay", rec.value, [*kinds, "approval_consumed", "replayed"]
                # The grant is kept: nothing to replay, or the call is in doubt (no check here).
                code = "replay_value_unavailable" if rec.status == "committed" else "effect_status_unknown"
                return "refuse", code, [*kinds, "refused"]
            if req is not None and req.status == "denied":
                # With no record, also for other arguments (the table of docs/approvals.md says
                # policy_violation for "any, with other arguments"; the guard checks the arguments
                # of an open or approved request only). Refused either way.
                return "refuse", "escalation_denied", [*kinds, "refused"]
            if req is not None and req.status == "expired" and not req.answered:
                req.answered = True
                return "refuse", "escalation_denied", [*kinds, "refused"]
            if req is None or req.status in ("expired", "consumed") or req.args != args:
                # A new request. With no record, an expired one's id may be asked again for other
                # arguments: a call that never ran has no row (section 2.6 binds the id at pending).
                replay = None if in_race else (rec is not None and rec.status == "committed")
                entry.request = ModelRequest(dict(args), replay, overdue=short)
                kinds.append("approval_requested")
            return "refuse", "approval_pending", [*kinds, "refused"]

        def invoke(self, call_id: str, args: dict[str, Any], short: bool = False) -> tuple[Any, BaseException | None]:
            tool = self.refund_soon if short else self.refund
            with AirlockContext(agent_id="agent", metadata={"tool_call_id": call_id}):
                try:
                    return tool(**args), None
                except (TimeoutError, ValueError) as e:
                    return None, e

        def kinds_of(self, call_id: str) -> list[str]:
            return [e.kind for e in self.store.events(call_id=call_id)]

        def learn_request(self, call_id: str, entry: RefundCall) -> None:
            """The id of the call's latest request (made by the step just taken), and, when the
            rule marked it short, a bounded wait until it is overdue."""
            assert entry.request is not None
            latest = self.store.approval_requests(call_id=call_id, limit=1)
            assert latest and latest[0].status == "open", latest
            entry.request.request_id = latest[0].request_id
            if entry.request.overdue:
                deadline = time.monotonic() + 30
                while not latest[0].overdue(utc_now()):
                    assert time.monotonic() < deadline, "a request of a short ttl never came to be overdue"
                    time.sleep(0.005)

        def check_result(self, entry: RefundCall, want: str, detail: Any, result: Any,
                         raised: BaseException | None, args: dict[str, Any], outcome: str) -> None:
            if want == "refuse":
                assert raised is None and is_refusal(result), (detail, result, raised)
                assert result["block_reason"] == detail, (detail, result)
                request = entry.request
                if detail == "approval_pending":
                    assert request is not None and result["metadata"]["request_id"] == request.request_id, result
                if detail == "escalation_denied" and request is not None and request.denial is not None:
                    assert request.denial in result["error"], result  # the operator's reason
                if detail == "escalation_denied" and request is not None and request.status == "expired":
                    assert "expired" in result["error"], result  # denied by default
                return
            if want == "replay":
                assert raised is None and not is_refusal(result) and result == detail, (detail, result)
                return
            assert entry.record is not None
            if outcome == "value":
                assert raised is None and result["pair"] == (args["account"], args["cents"]), result
                entry.record.value = orjson.loads(orjson.dumps(result, option=orjson.OPT_SORT_KEYS))
            elif outcome == "unstorable":
                assert raised is None and type(result) is object, result
            elif outcome == "ambiguous":
                assert isinstance(raised, TimeoutError), (result, raised)
            else:
                assert isinstance(raised, ValueError), (result, raised)

        def refund_call(self, call_id: str, args: dict[str, Any], outcome: str, short: bool) -> None:
            entry = self.refunds[call_id]
            before = self.kinds_of(call_id)
            asked = entry.request
            want, detail, kinds = self.predict(entry, args, outcome, short)
            self.refund_outcome = outcome
            runs = len(self.refund_runs.get(call_id, ()))
            result, raised = self.invoke(call_id, args, short)
            if entry.request is not asked:  # a new request: its id is learnt from the store
                self.learn_request(call_id, entry)
            self.check_result(entry, want, detail, result, raised, args, outcome)
            after = self.kinds_of(call_id)
            assert after[:len(before)] == before and after[len(before):] == kinds, (want, detail, kinds, after)
            assert len(self.refund_runs.get(call_id, ())) == runs + (want == "run")

        # -- rules -----------------------------------------------------------------------------

        @precondition(lambda self: len(self.refunds) < 4)  # a few calls, each taken further
        @rule(target=refund_ids, cents=st.integers(0, 3), short=RARELY)
        def ask_refund(self, cents: int, short: bool) -> Any:
            """A new call of the escalated tool: asked once, refused approval_pending."""
            call_id = f"refund-{len(self.refunds)}-{self.counter}"
            self.refunds[call_id] = RefundCall()
            self.refund_call(call_id, {"account": "acct", "cents": cents}, "value", short)
            return multiple(call_id)

        @rule(call_id=refund_ids, same_args=MOSTLY, outcome=st.sampled_from(REFUND_OUTCOMES), short=RARELY)
        def retry_refund(self, call_id: str, same_args: bool, outcome: str, short: bool) -> None:
            """A retry with the same arguments, or with others (the id is then someone else's);
            ``short``: a request it makes expires at once."""
            entry = self.refunds[call_id]
            bound = entry.bound_args()
            assert bound is not None
            args = dict(bound) if same_args else {"account": "acct", "cents": bound["cents"] + 10}
            self.refund_call(call_id, args, outcome, short)

        @rule(call_id=refund_ids, operator=st.sampled_from(OPERATORS), approve=MOSTLY)
        def operator_decides(self, call_id: str, operator: str, approve: bool) -> None:
            """``airlock journal approve`` / ``deny``: compare-and-set on the open request; the same
            operator approving twice counts once (NotDecidable, nothing appended)."""
            self.decide(call_id, operator, approve)

        @rule(call_id=refund_ids)
        def operators_grant(self, call_id: str) -> None:
            """As many distinct operators as the quorum still needs approve the open request."""
            req = self.refunds[call_id].request
            if req is None or req.status != "open" or req.overdue:
                return
            for operator in [o for o in OPERATORS if f"operator:{o}" not in req.approvers][:self.quorum - len(
                    req.approvers)]:
                self.decide(call_id, operator, True)
            assert req.status == "approved"

        def decide(self, call_id: str, operator: str, approve: bool) -> None:
            entry = self.refunds[call_id]
            req = entry.request
            before = self.kinds_of(call_id)
            self.decisions += 1
            reason = f"reason {self.decisions} of {operator}"
            decidable = req is not None and req.status == "open" and not req.overdue and not (
                approve and f"operator:{operator}" in req.approvers)
            try:
                event, got = decide_request(self.store, call_id, approve=approve, operator=operator, reason=reason)
            except NotDecidable:
                assert not decidable, (call_id, req)
                assert self.kinds_of(call_id) == before  # nothing appended
                return
            assert decidable and req is not None, (call_id, req)
            assert (event.kind, event.actor) == ("approved" if approve else "denied", f"operator:{operator}")
            if approve:
                req.approvers.append(f"operator:{operator}")
                if len(req.approvers) >= self.quorum:
                    req.status = "approved"
            else:
                req.status, req.denial = "denied", reason
            assert (got.request_id, got.status, list(got.approvers)) == (req.request_id, req.status, req.approvers)
            assert self.kinds_of(call_id) == [*before, event.kind]

        @precondition(lambda self: any(e.request is not None and e.request.status == "open" and e.request.overdue
                                       for e in self.refunds.values()))
        @rule()
        def expire_the_overdue(self) -> None:
            """What a listing does first: ``expired`` for every open request past its expiry."""
            overdue = {entry.request.request_id: entry.request for entry in self.refunds.values()
                       if entry.request is not None and entry.request.status == "open" and entry.request.overdue}
            got = expire_overdue(self.store)
            assert {r.request_id for r in got} == set(overdue), (got, overdue)
            for req in overdue.values():
                req.status, req.answered = "expired", False

        @rule(call_id=refund_ids, threads=st.integers(2, 3), outcome=st.sampled_from(REFUND_OUTCOMES))
        def concurrent_retries(self, call_id: str, threads: int, outcome: str) -> None:
            """The same retry from several threads at once: the steps are atomic, so they do what
            the same retries one after the other would; of any grant, one consumes it."""
            entry = self.refunds[call_id]
            args = entry.bound_args()
            assert args is not None
            before = self.kinds_of(call_id)
            runs = len(self.refund_runs.get(call_id, ()))
            predicted = [self.predict(entry, args, outcome, False, in_race=True) for _ in range(threads)]
            self.refund_outcome = outcome
            barrier = threading.Barrier(threads)
            results: list[tuple[Any, BaseException | None]] = []

            def retry() -> None:
                barrier.wait(30)
                got = self.invoke(call_id, args)
                with self.refund_lock:
                    results.append(got)

            workers = [threading.Thread(target=retry) for _ in range(threads)]
            for worker in workers:
                worker.start()
            for worker in workers:
                worker.join(120)
                assert not worker.is_alive(), "a retry never returned"
            assert len(results) == threads

            def shape(result: Any, raised: BaseException | None) -> str:
                if raised is not None:
                    return f"raised {type(raised).__name__}"
                if is_refusal(result):
                    return str(result["block_reason"])
                return "returned"

            want = {"run": {"value": "returned", "unstorable": "returned", "ambiguous": "raised TimeoutError",
                            "other_error": "raised ValueError"}[outcome], "replay": "returned"}
            assert sorted(shape(*r) for r in results) == sorted(
                want.get(w, str(d)) for w, d, _ in predicted), (predicted, results)
            ran = sum(w == "run" for w, _, _ in predicted)
            assert ran <= 1 and len(self.refund_runs.get(call_id, ())) == runs + ran
            for w, d, _ in predicted:
                if w == "replay":
                    assert any(r == (d, None) for r in results), (d, results)
            if ran and outcome == "value":
                value = next(r for r, e in results if e is None and not is_refusal(r))
                assert entry.record is not None
                entry.record.value = orjson.loads(orjson.dumps(value, option=orjson.OPT_SORT_KEYS))
            if entry.request is not None and entry.request.request_id is None:
                self.learn_request(call_id, entry)
            after = self.kinds_of(call_id)
            assert after[:len(before)] == before
            assert sorted(after[len(before):]) == sorted(k for _, _, ks in predicted for k in ks), (predicted, after)

        @rule(call_id=base.call_ids, cents=st.integers(0, 3))
        def refund_under_a_taken_id(self, call_id: str, cents: int) -> None:
            """The escalated tool under the id of another tool's call: refused by the replay table
            (policy_violation), and no request is made."""
            prior = self.model.get(call_id)
            if prior is None:
                return
            before = self.kinds_of(call_id)
            result, raised = self.invoke(call_id, {"account": "acct", "cents": cents})
            assert raised is None and is_refusal(result) and result["block_reason"] == "policy_violation", result
            assert self.kinds_of(call_id) == [*before, "refused"]

        @rule(call_id=consumes(refund_ids), outcome=st.sampled_from(("value", "other_error")))
        def other_tool_under_a_refund_id(self, call_id: str, outcome: str) -> None:
            """An unescalated tool (``lookup``) under the id of a refund: refused when the refund
            has run (section 2.6). While the id has only a request (no record), the replay table
            knows nothing of it and the other tool runs; the id is then that tool's (its retries
            are the replay table's), and the request's grant can never be used (every refund
            retry is refused policy_violation). The id leaves the refunds' bundle."""
            entry = self.refunds[call_id]
            args = {"account": "acct", "cents": 7}
            if entry.record is not None:
                before = self.kinds_of(call_id)
                with AirlockContext(agent_id="agent", metadata={"tool_call_id": call_id}):
                    result = self.tools["lookup"](**args)
                assert is_refusal(result) and result["block_reason"] == "policy_violation", result
                assert self.kinds_of(call_id) == [*before, "refused"]
                return
            self.call(call_id, "lookup", args, outcome)  # the replay table's model: a fresh id runs
            entry.record, entry.foreign = self.model[call_id], True
            bound = entry.request.args if entry.request is not None else args
            self.refund_call(call_id, dict(bound), "value", False)  # refused policy_violation

        # -- invariants ------------------------------------------------------------------------

        @invariant()
        def every_run_consumed_its_own_grant(self) -> None:
            """No run of the escalated tool, nor a replay of it, without a grant consumed for that
            attempt in the same step; a grant quorum-approved by distinct operators, consumed once;
            the tool ran as often as the log has its pending, each run the attempt of one."""
            by_call: dict[str, list[EffectEvent]] = {}
            for event in self.store.events():
                effect = event.to_effect_event() if hasattr(event, "to_effect_event") else event
                if effect.call_id in self.refunds:
                    by_call.setdefault(effect.call_id, []).append(effect)
            for call_id, entry in self.refunds.items():
                events = by_call.get(call_id, [])
                requests: dict[str, Any] = {}
                consumed: set[str] = set()
                pending_attempts: list[int] = []
                for i, event in enumerate(events):
                    if event.tool == "refund" and event.kind in ("pending", "replayed"):
                        grant = events[i - 1] if i else None
                        assert grant is not None and grant.kind == "approval_consumed", (call_id, event.kind, i)
                        assert grant.attempt == event.attempt, (call_id, grant.attempt, event.attempt)
                        if event.kind == "pending":
                            pending_attempts.append(event.attempt)
                    if event.kind == "approval_consumed":
                        rid = (event.reason or {}).get("request_id")
                        request = requests.get(rid)
                        assert request is not None and request.status == "approved", (call_id, rid, request)
                        assert len(set(request.approvers)) >= request.quorum == self.quorum, request
                        assert all(a.startswith("operator:") for a in request.approvers), request
                        assert rid not in consumed
                        consumed.add(rid)
                        assert i + 1 < len(events) and events[i + 1].kind in ("pending", "replayed"), (call_id, i)
                    if event.kind == "approval_requested":
                        folded = apply_approval(None, event, event.seq)
                        assert folded is not None
                        requests[folded.request_id] = folded
                    else:
                        rid = (event.reason or {}).get("request_id")
                        if rid in requests:
                            requests[rid] = apply_approval(requests[rid], event, event.seq)
                runs = self.refund_runs.get(call_id, [])
                assert runs == pending_attempts, (call_id, runs, pending_attempts)
                if not entry.foreign:
                    assert len(runs) == (0 if entry.record is None else entry.record.attempt), (call_id, runs)

        @invariant()
        def requests_match_the_model(self) -> None:
            latest: dict[str, Any] = {}
            for request in self.store.approval_requests():  # newest first
                latest.setdefault(request.call_id, request)
            for call_id, entry in self.refunds.items():
                req, got = entry.request, latest.get(call_id)
                if req is None:
                    assert got is None, got
                    continue
                assert got is not None and got.request_id == req.request_id, (call_id, got, req)
                assert (got.status, list(got.approvers), got.answered, got.quorum, got.tool) == (
                    req.status, req.approvers, req.answered, self.quorum, "refund"), (call_id, got, req)
                assert orjson.loads(got.arguments) == req.args, (got.arguments, req.args)
                assert got.overdue(utc_now()) == req.overdue or req.status != "open", (call_id, got, req)
                if req.replay is not None:
                    assert got.replay is req.replay, (call_id, got, req)
                if req.status == "denied":
                    assert got.decision_reason == req.denial
                record = self.store.get(call_id)
                if entry.record is None:
                    assert record is None, record
                elif not entry.foreign:
                    assert (record.status, record.attempt, record.tool) == (
                        entry.record.status, entry.record.attempt, "refund"), (call_id, record, entry.record)

        @invariant()
        def requests_are_the_fold_of_the_log(self) -> None:
            events = [(e.seq, e.to_effect_event() if hasattr(e, "to_effect_event") else e)
                      for e in self.store.events()]
            folded = fold_approvals(events)
            got = {r.request_id: r.to_json() for r in self.store.approval_requests()}
            assert got == {rid: r.to_json() for rid, r in folded.items()}

    ApprovalMachine.__name__ = ApprovalMachine.__qualname__ = "ApprovalMachine"
    return ApprovalMachine
