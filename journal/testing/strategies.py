"""Hypothesis strategies for sequences of tool calls, and a player that runs them through a guard.

hypothesis is imported inside the strategy functions only, so importing this module (and loading
the pytest plugin) does not need it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from guard import Airlock, AirlockContext, SecurityPolicy, is_refusal
from guard.effect_guard import EffectGuard, EffectStore, reversibility

if TYPE_CHECKING:
    from hypothesis.strategies import SearchStrategy

__all__ = ["OUTCOMES", "TOOLS", "CallStep", "PlayReport", "call_ids", "call_sequences", "json_values", "play"]

# The tools :func:`play` offers: name -> reversibility.
TOOLS: dict[str, str] = {"charge": "irreversible", "refund": "costly", "quote": "reversible"}
# What the tool does on one step: return its value; do its effect and lose the response
# (TimeoutError, ambiguous); fail before any effect (ValueError, the call is released).
OUTCOMES: tuple[str, ...] = ("value", "lost", "error")


@dataclass(frozen=True)
class CallStep:
    """One tool call as the model makes it: which id, which tool, which arguments, and how it ends."""

    call_id: str
    tool: str
    arguments: dict[str, Any]
    outcome: str = "value"


@dataclass
class PlayReport:
    """What :func:`play` saw: each step's result and the effects as the backend counted them."""

    results: list[Any] = field(default_factory=list)
    effects: Counter[tuple[str, str]] = field(default_factory=Counter)  # (tool, call_id) -> effects
    first_values: dict[str, Any] = field(default_factory=dict)  # call_id -> the value it first returned

    def double_effects(self) -> dict[tuple[str, str], int]:
        """Effects of a tool that is not reversible that happened more than once for one call id."""
        return {k: n for k, n in self.effects.items() if n > 1 and TOOLS.get(k[0]) != "reversible"}

    def refusals(self) -> Counter[str]:
        """How many steps were refused, by code."""
        return Counter(str(r["block_reason"]) for r in self.results if is_refusal(r))


def call_ids(pool: int = 6, *, nul: bool = True) -> SearchStrategy[str]:
    """Tool call ids from a small pool (so calls reuse them), some of them hostile text.

    ``nul=False`` leaves out the id with a NUL character (which PostgreSQL text cannot hold).
    """
    from hypothesis import strategies as st

    hostile = ["call'; DROP TABLE events; --", 'call"\\', "\u202ecall", "\U0001f4b3"]
    if nul:
        hostile.insert(2, "call\x00nul")
    plain = [f"call_{n}" for n in range(max(1, pool - len(hostile)))]
    return st.sampled_from(plain + hostile[: max(0, pool - len(plain))])


def json_values(max_leaves: int = 8) -> SearchStrategy[Any]:
    """JSON values: null, booleans, integers, finite floats, text, and lists and objects of them."""
    from hypothesis import strategies as st

    leaves = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text()
    return st.recursive(
        leaves, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
        max_leaves=max_leaves,
    )


def call_sequences(
    *, min_calls: int = 1, max_calls: int = 20, ids: SearchStrategy[str] | None = None,
    outcomes: tuple[str, ...] = OUTCOMES,
) -> SearchStrategy[list[CallStep]]:
    """Lists of :class:`CallStep` over :data:`TOOLS`: new calls, retries of an earlier id with the same
    tool and arguments, and reuses of an id for other arguments or another tool."""
    from hypothesis import strategies as st

    step = st.builds(
        CallStep,
        call_id=ids if ids is not None else call_ids(),
        tool=st.sampled_from(sorted(TOOLS)),
        arguments=st.fixed_dictionaries({"account": st.sampled_from(["acct_1", "acct_2"]),
                                         "cents": st.sampled_from([1, 500])}),
        outcome=st.sampled_from(outcomes),
    )
    return st.lists(step, min_size=min_calls, max_size=max_calls)


def play(steps: list[CallStep], store: EffectStore, *, agent_id: str | None = None) -> PlayReport:
    """Run ``steps`` one after another through guarded :data:`TOOLS` on ``store``.

    Each step runs under ``AirlockContext(metadata={"tool_call_id": step.call_id})``; a raised
    exception is kept as the step's result. Returns the :class:`PlayReport`; the caller asserts on
    it (``double_effects()`` must be empty) and on the store (``verify()``).
    """
    report = PlayReport()
    current: dict[str, CallStep] = {}
    policy = SecurityPolicy(effect_guard=EffectGuard(store=store))

    def tool(name: str) -> Any:
        def body(account: str, cents: int) -> dict[str, Any]:
            running = current["step"]
            if running.outcome == "error":
                raise ValueError(f"{name} was refused by the backend before any effect")
            report.effects[(name, running.call_id)] += 1
            effect = report.effects[(name, running.call_id)]
            value = {"tool": name, "account": account, "cents": cents, "effect": effect}
            if running.outcome == "lost":
                raise TimeoutError(f"the response of {name} was lost")
            return value

        body.__name__ = name
        return Airlock(policy)(reversibility(TOOLS[name])(body))  # type: ignore[arg-type]

    guarded = {name: tool(name) for name in TOOLS}
    for step in steps:
        current["step"] = step
        with AirlockContext(agent_id=agent_id, metadata={"tool_call_id": step.call_id}):
            try:
                result: Any = guarded[step.tool](**step.arguments)
            except Exception as e:
                result = e
        report.results.append(result)
        if not is_refusal(result) and not isinstance(result, Exception):
            report.first_values.setdefault(step.call_id, result)
    return report
