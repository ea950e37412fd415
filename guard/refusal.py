"""Refusals: what a blocked call returns (or raises), with a code a program can branch on."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from enum import StrEnum
from typing import Any

__all__ = ["AirlockBlocked", "BlockReason", "FIX_HINTS", "Refusal", "is_refusal", "make_refusal"]


class BlockReason(StrEnum):
    """The refusal codes (``Refusal["block_reason"]``)."""

    POLICY_VIOLATION = "policy_violation"
    CAPABILITY_DENIED = "capability_denied"
    ESCALATION_REQUIRED = "escalation_required"
    ESCALATION_DENIED = "escalation_denied"
    TOOL_CALL_ID_REQUIRED = "tool_call_id_required"
    TARGET_ARGS_REQUIRED = "target_args_required"
    ARGUMENTS_NOT_CANONICAL = "arguments_not_canonical"
    EFFECT_STATUS_UNKNOWN = "effect_status_unknown"
    REPLAY_VALUE_UNAVAILABLE = "replay_value_unavailable"
    STORE_UNAVAILABLE = "store_unavailable"


# The fix_hints of the guard's refusals, by code (or by violation_type, which says more).
FIX_HINTS: dict[str, tuple[str, ...]] = {
    "policy_violation": (
        "Do not call this tool again in this session; choose an allowed tool.",
    ),
    "tool_call_id_reused": (
        "Send a new tool call with a fresh id for a different call.",
        "To retry the earlier call, send exactly the same tool and arguments.",
    ),
    "capability_denied": ("Ask an operator to grant the capability, or use a tool that does not need it.",),
    "escalation_required": ("Ask an operator to configure an approver for this tool; do not retry until then.",),
    "escalation_denied": ("Do not retry this call unchanged; tell the user it was not approved.",),
    "tool_call_id_required": (
        "The host must run this tool inside AirlockContext(metadata={'tool_call_id': ...}), the id a "
        "non-empty string.",
    ),
    "target_args_required": ("Name the target explicitly and call again.",),
    "arguments_not_canonical": (
        "Pass arguments that fit the tool's signature and have a JSON form: "
        "strings, numbers, booleans, null, lists and objects (no NaN or infinity, and integers within "
        "64 bits: from -2**63 to 2**64 - 1).",
    ),
    "arguments_invalid": (  # an adapter's: the model's arguments do not fit the tool's parameters
        "Call the tool again with a JSON object of arguments that fits its parameters; the error says "
        "which one did not.",
    ),
    "effect_status_unknown": (
        "Do not retry this call.",
        "Ask the backend whether the operation with this idempotency key took effect.",
        "An operator can settle it with `airlock journal resolve`.",
    ),
    "replay_value_unavailable": (
        "Do not retry this call: it already took effect.",
        "Look up its result in the backend if you need it.",
    ),
    "store_unavailable": ("Try again later; the tool was not run.",),
    "approval_pending": (
        "Tell the user the call waits for an operator's approval.",
        "Retry with the same tool_call_id and the same arguments after the operator decides.",
    ),
    "tool_call_id_ambiguous": (
        "Do not retry this call: it may already have run under its earlier id.",
        "Send a new tool call with a fresh id for a new call.",
    ),
}


class Refusal(dict[str, Any]):
    """A refused call's result: a ``dict`` of ``success`` (False), ``status`` ("blocked"),
    ``block_reason``, ``error`` (one sentence a model can act on), ``fix_hints`` and ``metadata``.
    """

    @property
    def block_reason(self) -> str:
        return str(self["block_reason"])

    @property
    def error(self) -> str:
        return str(self["error"])


def make_refusal(
    code: str, error: str, fix_hints: Sequence[str], metadata: Mapping[str, Any]
) -> Refusal:
    return Refusal(
        success=False,
        status="blocked",
        block_reason=str(code),
        error=error,
        fix_hints=list(fix_hints),
        metadata=dict(metadata),
    )


def is_refusal(value: object) -> bool:
    """True exactly for a :class:`Refusal`."""
    return isinstance(value, Refusal)


class AirlockBlocked(Exception):
    """A refusal raised, with ``Airlock(..., on_block="raise")``."""

    def __init__(self, refusal: Refusal) -> None:
        super().__init__(refusal["error"])
        self.refusal = refusal
        self.block_reason: str = refusal["block_reason"]

    def __reduce__(self) -> tuple[type[AirlockBlocked], tuple[Refusal]]:
        # Made again from its refusal, so it crosses to another process (a process pool, a worker).
        return (type(self), (self.refusal,))
