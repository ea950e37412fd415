"""The id a store keeps a call under, by the effect guard's ``id_scope``.

``"global"``: the model's ``tool_call_id`` itself. ``"agent"``: ``agent:<agent_id>/<tool_call_id>``,
so that two agents that happen to send one id are two calls. The agent's name is written with
``%`` and ``/`` percent-encoded, so the first ``/`` ends it and the pair reads back unambiguously;
a call without an ``agent_id`` is in the scope of the empty name (``agent:/call_1``).

Ids that start with ``agent:`` are kept for the agent scope: a guard of the global scope refuses
such a ``tool_call_id``, so that a global id can never name another agent's call in a journal that
guards of both scopes share.
"""

from __future__ import annotations

from urllib.parse import unquote

from .canonical import storable

__all__ = ["AGENT_PREFIX", "agent_scoped_id", "split_scoped_id"]

AGENT_PREFIX = "agent:"


def agent_scoped_id(agent_id: str | None, tool_call_id: str) -> str:
    """The id a call of ``agent_id`` with ``tool_call_id`` is kept under in the agent scope."""
    agent = (agent_id or "").replace("%", "%25").replace("/", "%2F")
    return storable(f"{AGENT_PREFIX}{agent}/{tool_call_id}")


def split_scoped_id(call_id: str) -> tuple[str, str] | None:
    """``(agent_id, tool_call_id)`` of an id made by :func:`agent_scoped_id` (``""`` for no agent),
    or None for an id of the global scope."""
    if not call_id.startswith(AGENT_PREFIX) or "/" not in call_id:
        return None
    agent, _, tool_call_id = call_id[len(AGENT_PREFIX):].partition("/")
    return unquote(agent), tool_call_id
