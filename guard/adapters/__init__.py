"""Host adapters: run a model's tool call under its own ``tool_call_id`` and answer in the host's shape.

``guard.adapters.openai``, ``guard.adapters.anthropic``, ``guard.adapters.mcp``,
``guard.adapters.langgraph``, ``guard.adapters.openai_agents`` and ``guard.adapters.pydantic_ai``;
none imports its SDK or framework until it is used.
"""

from . import anthropic, langgraph, mcp, openai, openai_agents, pydantic_ai

__all__ = ["anthropic", "langgraph", "mcp", "openai", "openai_agents", "pydantic_ai"]
