"""At-most-once dispatch for the tools an AI agent calls."""

from .airlock import Airlock
from .context import AirlockContext, get_current_context
from .oversight import OversightRequest, OversightResponse, OversightVerdict
from .policy import SecurityPolicy, requires
from .refusal import AirlockBlocked, Refusal, is_refusal

__all__ = [
    "Airlock",
    "AirlockBlocked",
    "AirlockContext",
    "OversightRequest",
    "OversightResponse",
    "OversightVerdict",
    "Refusal",
    "SecurityPolicy",
    "get_current_context",
    "is_refusal",
    "requires",
]
