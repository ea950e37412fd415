"""Refusals: what a blocked call returns (or raises), with a code a program can branch on."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from enum import StrEnum
from typing import Any

__all__ = ["AirlockBlocked", "BlockReason", "Refusal", "is_refusal", "make_refusal"]


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
