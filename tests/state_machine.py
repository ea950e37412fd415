"""A hypothesis state machine that drives the guard against a plain model of the replay table.

``make_state_machine(factory)`` builds a ``RuleBasedStateMachine`` for one store: each run gets a
fresh store from ``factory(path)``; after every step it checks that the call's result is what the
model says, that no non-reversible call took effect twice, and that the store's projection equals
the fold of its log.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, multiple, rule

from guard import Airlock, AirlockContext, SecurityPolicy, is_refusal
from guard.effect_guard import EffectGuard, reversibility
from guard.store import CallRecord, apply

OUTCOMES = ("value", "ambiguous", "other_error", "generator", "interrupt", "unstorable")
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
    return outcome != "other_error"


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
            policy = SecurityPolicy(effect_guard=EffectGuard(store=self.store))
            self.tools: dict[str, Callable[..., Any]] = {}
            for name, tag in TOOLS.items():
                self.tools[name] = reversibility(tag)(Airlock(policy=policy)(self._make_tool(name)))

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
                machine.counter += 1
                if outcome == "value":
                    return {"n": machine.counter, "pair": (account, cents)}
                if outcome == "ambiguous":
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
            elif outcome == "ambiguous":
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

        # -- invariants ------------------------------------------------------------------------

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
