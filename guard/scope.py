"""The id a store keeps a call under, by the effect guard's ``id_scope``.

``"global"``: the model's ``tool_call_id`` itself. ``"agent"``: ``agent:<agent_id>/<tool_call_id>``,
so that two agents that happen to send one id are two calls. The agent's name is written with
``%`` and ``/`` percent-encoded, so the first ``/`` ends it and the pair reads back unambiguously;
a call without an ``agent_id`` is in the scope of the empty name (``agent:/call_1``).

Those forms are for plain ids: text with a UTF-8 form that does not hold the six characters
:func:`~guard.canonical.storable` writes for a lone surrogate (``\\udcff``, ``\\ud800`` and the
like, lower case). Any other id is kept escaped, so that no two ids ever share a stored id:
``%``, ``/`` and each lone surrogate are written ``%25``, ``%2F`` and ``%uDCFF``. An escaped pair
is ``agent:<agent>%/<tool_call_id>`` (its agent part ends in a bare ``%``, which no plain one
does); an escaped global id is ``agent:%<tool_call_id>`` (no ``/`` at all, so it names no agent).

Ids that start with ``agent:`` are kept for these forms: a guard of the global scope refuses such a
``tool_call_id`` (and :func:`global_call_id` escapes it), so that a global id can never name
another call in a journal that guards of both scopes share.

Before this rule a non-plain id was kept with each surrogate as its backslash escape, the text of
another id too: :func:`old_call_id` gives that form, under which a call found may be either id's,
so the guard refuses to run it (never a second run).
"""

from __future__ import annotations

import re
from typing import Literal

from .canonical import storable

__all__ = [
    "AGENT_PREFIX", "ESCAPED_PREFIX", "agent_scoped_id", "global_call_id", "old_call_id", "split_global_id",
    "split_scoped_id", "stored_call_id",
]

AGENT_PREFIX = "agent:"
ESCAPED_PREFIX = "agent:%"  # an escaped global id: it has no "/", which every id of the agent scope has

# What storable writes for a lone surrogate: a key holding it may have been made from either.
_SURROGATE_ESCAPE = re.compile(r"\\ud[89a-f][0-9a-f]{2}")
_SURROGATE = re.compile(r"[\ud800-\udfff]")
# Every "%" of an escaped text starts one of these, so one left-to-right pass reads it back.
_ESCAPE = re.compile(r"%(?:25|2F|u(D[89A-F][0-9A-F]{2}))")


def _plain(text: str) -> bool:
    """Whether ``text`` is kept as it is: it has a UTF-8 form and no surrogate's escape text."""
    if "\\" in text and _SURROGATE_ESCAPE.search(text) is not None:
        return False
    return text.isascii() or _SURROGATE.search(text) is None


def _escaped(text: str) -> str:
    """``text`` with ``%``, ``/`` and each lone surrogate percent-escaped: valid UTF-8, no ``/``."""
    text = text.replace("%", "%25").replace("/", "%2F")
    return _SURROGATE.sub(lambda m: f"%u{ord(m.group()):04X}", text)


def _unescaped_match(m: re.Match[str]) -> str:
    code = m.group(1)
    if code is not None:
        return chr(int(code, 16))
    return "%" if m.group() == "%25" else "/"


def _unescaped(text: str) -> str:
    """The text :func:`_escaped` made ``text`` from."""
    return _ESCAPE.sub(_unescaped_match, text) if "%" in text else text


def global_call_id(tool_call_id: str) -> str:
    """The id a call with ``tool_call_id`` is kept under in the global scope."""
    if _plain(tool_call_id) and not tool_call_id.startswith(AGENT_PREFIX):
        return tool_call_id
    return ESCAPED_PREFIX + _escaped(tool_call_id)


def agent_scoped_id(agent_id: str | None, tool_call_id: str) -> str:
    """The id a call of ``agent_id`` with ``tool_call_id`` is kept under in the agent scope."""
    agent = agent_id or ""
    if _plain(agent) and _plain(tool_call_id):
        return f"{AGENT_PREFIX}{agent.replace('%', '%25').replace('/', '%2F')}/{tool_call_id}"
    return f"{AGENT_PREFIX}{_escaped(agent)}%/{_escaped(tool_call_id)}"


def stored_call_id(id_scope: Literal["global", "agent"], agent_id: str | None, tool_call_id: str) -> str:
    """The id a call is kept under by a guard of ``id_scope``."""
    if id_scope == "agent":
        return agent_scoped_id(agent_id, tool_call_id)
    return global_call_id(tool_call_id)


def old_call_id(id_scope: Literal["global", "agent"], agent_id: str | None, tool_call_id: str) -> str | None:
    """The id the call was kept under before ids were kept apart, when that is not its id now;
    None for a plain id, whose form never changed.

    Such an old id always holds a surrogate's escape text, which two ids wrote alike (the
    surrogate, and the backslash and five letters), so a call found under it may be either's."""
    agent = agent_id or ""
    if id_scope == "agent":
        if _plain(agent) and _plain(tool_call_id):
            return None
        return storable(f"{AGENT_PREFIX}{agent.replace('%', '%25').replace('/', '%2F')}/{tool_call_id}")
    if _plain(tool_call_id) or tool_call_id.startswith(AGENT_PREFIX):
        return None  # its form never changed, or it is refused before any look-up
    return storable(tool_call_id)


def split_scoped_id(call_id: str) -> tuple[str, str] | None:
    """``(agent_id, tool_call_id)`` of an id made by :func:`agent_scoped_id` (``""`` for no agent),
    or None for an id of the global scope."""
    if not call_id.startswith(AGENT_PREFIX):
        return None
    agent, slash, tool_call_id = call_id[len(AGENT_PREFIX):].partition("/")
    if not slash:
        return None  # an escaped global id: it has no "/"
    if agent.endswith("%"):  # an escaped pair: a plain agent part never ends in a bare "%"
        return _unescaped(agent[:-1]), _unescaped(tool_call_id)
    return _unescaped(agent), tool_call_id


def split_global_id(call_id: str) -> str | None:
    """The ``tool_call_id`` of an id made by :func:`global_call_id`, or None for an id of the
    agent scope."""
    if not call_id.startswith(AGENT_PREFIX):
        return call_id
    if call_id.startswith(ESCAPED_PREFIX) and "/" not in call_id:
        return _unescaped(call_id[len(ESCAPED_PREFIX):])
    return None
