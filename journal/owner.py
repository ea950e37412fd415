"""Whether the process that recorded an event is still running (for ``resolve`` of a pending call)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from guard.store import current_owner

__all__ = ["owner_alive"]


def owner_alive(owner: Mapping[str, Any] | None) -> bool:
    """True when ``owner`` (``{host, pid}``) names a process alive on this host.

    An owner on another host, or one without a usable pid, is not known to be alive: False.
    """
    if not owner or owner.get("host") != current_owner()["host"]:
        return False
    pid = owner.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except PermissionError:
        return not _zombie(pid)  # the process exists but belongs to another user
    except (ProcessLookupError, OverflowError):
        return False
    return not _zombie(pid)


def _zombie(pid: int) -> bool:
    """True when ``pid`` has ended but its parent has not reaped it yet (``ps`` shows it
    ``<defunct>``): it will record nothing more. Known only where ``/proc`` is (Linux)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    # "pid (comm) state ...": the name may hold spaces and parentheses, the state follows the last ")".
    return stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] in (b"Z", b"X")
