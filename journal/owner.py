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
        return True  # the process exists but belongs to another user
    except (ProcessLookupError, OverflowError):
        return False
    return True
