"""The store work of ``async def`` tools, made off the event loop.

The work goes to a pool of the guard's own threads, not to the loop's default executor, so that it
never waits behind the host's own threaded work, and a host that waits in a default-executor
thread for a guarded call cannot starve it. The work asked for on one call id is made in the order
it was asked for: a retry waits for what its earlier attempt still had under way (the release of
an attempt whose caller was cancelled, an outcome being written), so it finds the call settled.
Once a worker has taken a piece of work, the work is made, whatever becomes of its caller.
"""

from __future__ import annotations

import asyncio
import contextvars
import os
import threading
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

__all__ = ["WORKERS", "offloaded"]

#: Threads of the pool; each holds one store call at a time (a write waiting for a lock or a server).
WORKERS = 32

_lock = threading.Lock()
_executor: ThreadPoolExecutor | None = None
_last: dict[Hashable, threading.Event] = {}  # per call: the end of the work asked for last


def _pool() -> ThreadPoolExecutor:
    global _executor
    pool = _executor
    if pool is None:
        with _lock:
            if _executor is None:
                _executor = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="airlock-store")
            pool = _executor
    return pool


def _forked() -> None:
    # The child has none of the parent's threads: a pool, and work, of its own.
    global _executor, _lock, _last
    _lock, _executor, _last = threading.Lock(), None, {}


os.register_at_fork(after_in_child=_forked)


class _Job:
    """``fn(*args)`` in a copy of the caller's context, made once: by a worker, or by the caller's
    thread when no worker can take it; never made when given up before it started."""

    __slots__ = ("abandoned", "after", "args", "context", "done", "error", "fn", "key", "lock", "prev",
                 "result", "state")

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...], key: Hashable | None,
                 after: Callable[[], Any] | None) -> None:
        self.fn: Callable[..., Any] | None = fn
        self.args: tuple[Any, ...] = args
        self.after = after
        self.context: contextvars.Context | None = contextvars.copy_context()
        self.key = key
        self.lock = threading.Lock()
        self.state = "queued"  # then "running" and "finished", or "dropped"
        self.abandoned = False
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None
        self.prev: threading.Event | None = None
        if key is not None:
            with _lock:
                self.prev = _last.get(key)
                _last[key] = self.done

    def run(self) -> None:
        with self.lock:
            if self.state != "queued":
                return
            self.state = "running"
        fn, context = self.fn, self.context
        assert fn is not None and context is not None
        try:
            if self.prev is not None:
                self.prev.wait()  # what was asked for before on this call is made first
            self.result = context.run(fn, *self.args)
        except BaseException as e:  # the caller's to raise, when it is still there
            self.error = e
        finally:
            with self.lock:
                self.state = "finished"
                after = self.after if self.abandoned else None
            try:
                if after is not None:
                    context.run(after)
            finally:
                self._end()

    def drop(self) -> bool:
        """Give the work up if no one has started it: True when it will never be made."""
        with self.lock:
            if self.state != "queued":
                return False
            self.state = "dropped"
        self._end()
        return True

    def abandon(self) -> bool:
        """The caller is gone: True when the worker will call ``after`` once the work is done, False
        when it was done already."""
        with self.lock:
            if self.state == "finished":
                return False
            self.abandoned = True
            return True

    def _end(self) -> None:
        self.fn = self.context = self.after = None  # the arguments and the result go with the caller
        self.args = ()
        self.done.set()
        if self.key is not None:
            with _lock:
                if _last.get(self.key) is self.done:
                    del _last[self.key]


def _start(job: _Job, loop: asyncio.AbstractEventLoop | None) -> asyncio.Future[None] | None:
    """Hand ``job`` to a worker; None when it was made in this thread instead (no worker could
    take it: the interpreter is shutting down, or no thread can start)."""
    try:
        if loop is None:
            _pool().submit(job.run)
            return None
        return loop.run_in_executor(_pool(), job.run)
    except RuntimeError:  # it may be queued all the same: whichever of the two takes it first makes it
        job.run()
        job.done.wait()
        return None


async def offloaded(fn: Callable[..., Any], *args: Any, key: Hashable | None = None, droppable: bool = False,
                    after: Callable[[], Any] | None = None) -> Any:
    """``fn(*args)`` made by a worker of the guard's pool; returns what it returns, or raises what it raises.

    ``key`` (a call's id) orders the work of one call. A caller cancelled, or closed, while it waits
    leaves at once: work a worker has not taken yet is given up if ``droppable``, else it is made
    all the same; ``after`` is called, by a worker, once work made for a caller that left is done.
    Without a running asyncio loop (a coroutine that another library drives) the caller's thread
    makes it."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return fn(*args)
    job = _Job(fn, args, key, after)
    future = _start(job, loop)
    if future is not None:
        try:
            await asyncio.shield(future)
        except BaseException:  # cancelled, or closed with its loop: the work is the workers' now
            if not (droppable and job.drop()) and not job.abandon() and after is not None:
                _start(_Job(after, (), key, None), None)  # done already: its sequel follows on its own
            raise
    if job.error is not None:
        raise job.error
    return job.result
