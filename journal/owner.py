"""Whether the process that recorded an event is still running (for a pending call without a lease)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from guard.liveness import process_seen

__all__ = ["owner_alive"]


def owner_alive(owner: Mapping[str, Any] | None) -> bool:
    """True when ``owner`` names a process this host sees running (see :mod:`guard.liveness`).

    An owner on another host, in another PID namespace or boot, or without a usable pid, is not
    seen from here: False. This is the host-and-pid test alone; whether a pending call's owner is
    alive is :func:`journal.leasing.owner_state`'s question, which never takes "not seen" for gone.
    """
    return process_seen(owner) == "running"
