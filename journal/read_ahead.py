"""Reading ahead on a thread of its own: the database's work on the next pages overlaps this
thread's work on the last one.

It pays where the reader holds the GIL rarely: a page that SQLite builds as one value is read in
one step, with the GIL let go for all of it. A reader that makes a Python object per row would
wait for the GIL after each row, and be slower than reading in line.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import TypeVar, cast

__all__ = ["read_ahead"]

T = TypeVar("T")

_DONE = object()  # the reader's last put: the pages are over


class _Failed:
    """What the reader raised, to be raised again where the pages are taken."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


def read_ahead(pages: Iterator[T], depth: int = 2) -> Iterator[T]:
    """The items of ``pages``, taken on a thread of its own at most ``depth`` ahead of the caller
    (the memory stays that of ``depth + 2`` pages). What ``pages`` raises is raised here, in
    order. Closing this iterator early stops the reader and closes ``pages`` on its thread, before
    the close returns."""
    ready: queue.Queue[object] = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item: object) -> bool:
        while not stop.is_set():
            try:
                ready.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def read() -> None:
        try:
            for page in pages:
                if not put(page):
                    return
        except BaseException as e:  # handed over whole, to be raised where the pages are taken
            put(_Failed(e))
            return
        finally:
            close = getattr(pages, "close", None)
            if close is not None:
                close()  # a generator's own finally (its connection closed) runs on its own thread
        put(_DONE)

    reader = threading.Thread(target=read, name="journal-read-ahead", daemon=True)
    reader.start()
    try:
        while True:
            item = ready.get()
            if item is _DONE:
                return
            if isinstance(item, _Failed):
                raise item.error
            yield cast(T, item)
    finally:
        stop.set()
        while reader.is_alive():
            try:
                ready.get(timeout=0.05)  # a reader blocked on a full queue sees the stop
            except queue.Empty:
                continue
        reader.join()
