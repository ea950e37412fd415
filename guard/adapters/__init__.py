"""Host adapters: run a model's tool call under its own ``tool_call_id`` and answer in the host's shape.

``guard.adapters.openai``, ``guard.adapters.anthropic`` and ``guard.adapters.mcp``; none imports its SDK.
"""

from . import anthropic, mcp, openai

__all__ = ["anthropic", "mcp", "openai"]
