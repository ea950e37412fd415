"""Whether the owner of a pending call may still be running its tool.

One principle: an owner is *gone* only on positive evidence, never for lack of it. The evidence is
the owner's own lease (the one its pending event names, never another holder's row) and, where
this host can see the owner's process, whether that process still runs:

| the owner's lease | its process seen from here | the owner is |
|---|---|---|
| running | any | alive |
| ran out, or dropped | running | alive (paused, starved of the GIL, or its outcome not recorded) |
| ran out, or dropped | ended | gone |
| ran out, or dropped | not seen | gone |
| none | running | alive |
| none | ended | gone |
| none | not seen | alive: nothing says otherwise |

A process is *seen* from here when it ran on this host name, in this boot and in this PID
namespace (owners recorded before these were kept: this host name alone); it has *ended* when no
process of its pid runs, or the one that does started at another time (its pid was reused), or it
is a zombie. An owner in another container or on another host is never judged by a pid test; nor
one of another boot, except by a store whose owners all ran on one machine (SQLite), where another
boot means the machine restarted since.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from typing import Any, Literal

__all__ = ["LeaseSeen", "ProcessSeen", "boot_id", "owner_alive", "process_identity", "process_seen"]

ProcessSeen = Literal["running", "ended", "unseen"]
# What the store knows of the lease a pending call's owner named: None when it named none.
LeaseSeen = Literal["running", "ended"] | None


def _read_text(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read(4096).decode("ascii", "replace").strip()
    except OSError:
        return None


def _pid_namespace() -> int | None:
    """The inode of this process's PID namespace (``pid:[4026531836]``), or None where not told."""
    try:
        link = os.readlink("/proc/self/ns/pid")
    except OSError:
        return None
    digits = link[link.find("[") + 1 : link.rfind("]")]
    return int(digits) if digits.isdigit() else None


def _start_time(pid: int | str) -> int | None:
    """When process ``pid`` started, in clock ticks after boot (``/proc/PID/stat``'s 22nd field)."""
    stat = _read_text(f"/proc/{pid}/stat")
    if stat is None:
        return None
    # "pid (comm) state ppid ...": the name may hold spaces and parentheses; fields follow the last ")".
    fields = stat[stat.rfind(")") + 2 :].split()
    return int(fields[19]) if len(fields) > 19 and fields[19].isdigit() else None


def _zombie(pid: int) -> bool:
    """True when ``pid`` has ended but its parent has not reaped it yet (``<defunct>``)."""
    stat = _read_text(f"/proc/{pid}/stat")
    return stat is not None and stat[stat.rfind(")") + 2 : stat.rfind(")") + 3] in ("Z", "X")


_HOST = socket.gethostname()
_BOOT = _read_text("/proc/sys/kernel/random/boot_id")
_PID_NS = _pid_namespace()


def boot_id() -> str | None:
    """The kernel's boot id (Linux), or None: it changes at every boot."""
    return _BOOT


def process_identity() -> dict[str, Any]:
    """This process as an owner record: ``host`` and ``pid``, and where the platform tells them,
    ``boot`` (the kernel's boot id), ``pid_ns`` (its PID namespace) and ``start`` (its start time in
    clock ticks after boot), which tell it from a process of another container or boot that has its
    pid, and from a later process its pid was given to."""
    owner: dict[str, Any] = {"host": _HOST, "pid": os.getpid()}
    if _BOOT:
        owner["boot"] = _BOOT
    pid_ns = _pid_namespace() if _PID_NS is not None else None  # a child may be in a new namespace
    if pid_ns is not None:
        owner["pid_ns"] = pid_ns
    start = _start_time("self")
    if start is not None:
        owner["start"] = start
    return owner


def _proc_is_ours() -> bool:
    """Whether ``/proc`` numbers processes as this process's namespace does (not so in a namespace
    made without its own ``/proc``): only then do ``/proc/PID`` files speak of our ``PID``."""
    try:
        return os.readlink("/proc/self") == str(os.getpid())
    except OSError:
        return False


def process_seen(owner: Mapping[str, Any] | None, one_machine: bool = False) -> ProcessSeen:
    """Whether the process ``owner`` names is ``running``, has ``ended``, or is ``unseen`` from here
    (another host, boot or PID namespace, or no usable pid).

    ``one_machine``: every owner the store can hold ran on this machine's kernel (a SQLite file in
    WAL mode is shared through memory of one kernel), so an owner of another boot has ended: the
    machine restarted since."""
    if one_machine and _BOOT and owner and isinstance(owner.get("boot"), str) and owner["boot"] != _BOOT:
        return "ended"
    if not owner or owner.get("host") != _HOST:
        return "unseen"
    pid = owner.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return "unseen"
    for field, ours in (("boot", _BOOT), ("pid_ns", _PID_NS if _PID_NS is None else _pid_namespace())):
        if field in owner and (ours is None or owner[field] != ours):
            return "unseen"  # another boot or container: a pid here says nothing of it
    try:
        os.kill(pid, 0)
    except PermissionError:
        pass  # the process exists but belongs to another user
    except (ProcessLookupError, OverflowError):
        return "ended"
    if not _proc_is_ours():
        return "running"
    start = owner.get("start")
    if isinstance(start, int) and not isinstance(start, bool):
        now = _start_time(pid)
        if now is not None and now != start:
            return "ended"  # its pid was given to a later process
    return "ended" if _zombie(pid) else "running"


def owner_alive(owner: Mapping[str, Any] | None, lease: LeaseSeen = None, one_machine: bool = False) -> bool:
    """Whether the owner of a pending call may still be running its tool (see the module's table).

    ``lease``: what the store knows of the lease the owner named: ``"running"``, ``"ended"`` (it ran
    out, or is no longer in the store), or None (it named none). ``one_machine``: as for
    :func:`process_seen`."""
    if lease == "running":
        return True
    seen = process_seen(owner, one_machine)
    if seen != "unseen":
        return seen == "running"
    return lease is None
