"""The store work of ``async def`` tools, made off the event loop.

The work goes to a pool of the guard's own threads, not to the loop's default executor, so that it
never waits behind the host's own threaded work, and a host that waits in a default-executor
thread for a guarded call cannot starve it. Once a worker has taken a piece of work, the work is
made, and its caller, cancelled or not, returns only when it is: so what a call recorded is
recorded when its task is done, and a retry (or a host that closes its journal next) finds it.
"""

from __future__ import annotations

import asyncio
import contextvars
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .store import AsyncOffload

__all__ = ["WORKERS", "offloaded", "offloads"]

#: Threads of the pool; each holds one store call at a time (a write waiting for a lock or a server).
WORKERS = 32

_lock = threading.Lock()
_executor: ThreadPoolExecutor | None = None


def offloads(store: AsyncOffload | None) -> bool:
    """Whether ``store`` (an effect guard's :attr:`~guard.effect_guard.EffectGuard.offload`) asks now
    for its work to be made off the event loop (``offload_async = True``)."""
    return store is not None and store.offload_async is True


def _pool() -> ThreadPoolExecutor:
    global _executor
    pool = _executor
    if pool is None:
        with _lock:
            if _executor is None:
                _executor = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="airlock-store")
            pool = _executor
    return pool


def _forget(pool: ThreadPoolExecutor) -> None:
    # A pool that could not start a thread: the next work gets a new one, and this one's queue goes
    # with it once nothing refers to it.
    global _executor
    with _lock:
        if _executor is pool:
            _executor = None


def _forked() -> None:
    # The child has none of the parent's threads: a pool of its own.
    global _executor, _lock
    _lock, _executor = threading.Lock(), None


os.register_at_fork(after_in_child=_forked)


class _Job:
    """``fn(*args)`` in a copy of the caller's context, made once: by a worker, or by the caller's
    thread when no worker can take it; never made when given up before it started. ``after`` is
    made by the worker once the work is done, when its caller had left by then."""

    __slots__ = ("abandoned", "after", "args", "context", "done", "error", "fn", "lock", "result", "state")

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...], after: Callable[[], Any] | None) -> None:
        self.fn: Callable[..., Any] | None = fn
        self.args: tuple[Any, ...] = args
        self.after = after
        self.context: contextvars.Context | None = contextvars.copy_context()
        self.lock = threading.Lock()
        self.state = "queued"  # then "running" and "finished", or "dropped"
        self.abandoned = False
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        with self.lock:
            if self.state != "queued":
                return
            self.state = "running"
        fn, context = self.fn, self.context
        assert fn is not None and context is not None
        try:
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
        """The caller is leaving: True when the worker makes ``after`` once the work is done, False
        when the work was done already."""
        with self.lock:
            if self.state == "finished":
                return False
            self.abandoned = True
            return True

    def _end(self) -> None:
        self.fn = self.context = self.after = None  # the arguments go; the result goes with the caller
        self.args = ()
        self.done.set()


def _start(job: _Job, loop: asyncio.AbstractEventLoop) -> asyncio.Future[None] | None:
    """Hand ``job`` to a worker; None when it was made in this thread instead (no worker could
    take it: the interpreter is shutting down, or no thread can start)."""
    pool = _pool()
    try:
        return loop.run_in_executor(pool, job.run)
    except RuntimeError:  # it may be queued all the same: whichever of the two takes it first makes it
        _forget(pool)
        job.run()
        job.done.wait()
        return None


async def _wait_out(job: _Job, future: asyncio.Future[None]) -> None:
    """Wait for ``job`` to end, the caller being cancelled already: through one more cancellation
    in the loop, and past that (a cancel scope that cancels again on every turn of the loop) in
    this thread, rather than spin."""
    try:
        await asyncio.wait((future,))
    except asyncio.CancelledError:
        job.done.wait()


async def offloaded(fn: Callable[..., Any], *args: Any, droppable: bool = False,
                    after: Callable[[], Any] | None = None) -> Any:
    """``fn(*args)`` made by a worker of the guard's pool; returns what it returns, or raises what it raises.

    A caller cancelled while it waits gives the work up if it is ``droppable`` and no worker has
    taken it yet; otherwise it waits for the work to end, then for ``after``, and only then raises
    its ``CancelledError``. A coroutine closed while it waits (its loop gone) does the same in its
    own thread. Without a running asyncio loop (a coroutine that another library drives) the
    caller's thread makes it."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return fn(*args)
    job = _Job(fn, args, after)
    future = _start(job, loop)
    if future is not None:
        try:
            await asyncio.shield(future)
        except GeneratorExit:  # closed: nothing may be awaited any more
            if not (droppable and job.drop()):
                if job.abandon():
                    job.done.wait()
                elif after is not None:
                    after()
            raise
        except BaseException:
            if not (droppable and job.drop()):
                sequel = None if job.abandon() else after  # done already: ``after`` is the caller's
                try:
                    await _wait_out(job, future)
                except GeneratorExit:  # closed while it waited: the rest in this thread
                    job.done.wait()
                    if sequel is not None:
                        sequel()
                    raise
                if sequel is not None:
                    await offloaded(sequel)  # which sees to its own closing
            raise
    if job.error is not None:
        raise job.error
    return job.result
