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
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, multiple, rule

from guard import Airlock, AirlockContext, SecurityPolicy, is_refusal
from guard.effect_guard import EffectGuard, reversibility
from guard.leases import LeaseStore
from guard.reconcile import Applied, InDoubtCall, NotApplied, reconciled_by
from guard.store import CallRecord, apply

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
