"""``HandOff``: ``next()`` called on another thread, a bounded number of items ahead.

``thread_pump.ThreadBatches`` (``workers=0``) runs the dataset's claiming and loading on one;
``loader.LoaderBatches`` uses one to take DataLoader's batches off the training thread, and a
group's followers (``queue.group``) to read their units ahead.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from torch.utils.data import _utils

__all__ = ["HandOff"]


_END = object()


class _Failure:
    def __init__(self, error: BaseException) -> None:
        self.error = error


class HandOff:
    """Calls ``next()`` on ``iterator`` on a thread of its own, at most ``slots`` items ahead.

    A place is reserved *before* each ``next()``, so the thread never holds an item that has
    none (with the dataset's iterator, a unit is claimed only when its first batch has a place).
    The end and an error queue up behind the items before them. Until ``finish`` returns True,
    no other thread may touch the iterator.

    Example:
        >>> pump = HandOff(iter([1, 2]), 1, "example")
        >>> pump.take(), pump.take()
        (1, 2)
    """

    def __init__(self, iterator: Any, slots: int, name: str) -> None:
        self._iterator = iterator
        self._slots = slots
        self._ready: deque[Any] = deque()
        self._room = slots
        self._stopping = False
        self._left = False  # the thread no longer touches the iterator
        self._then: Callable[[], None] | None = None  # cleanup the thread runs if abandoned
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def slots(self) -> int:
        """Items the thread may hold ahead of ``take``."""
        return self._slots

    def full(self) -> bool:
        """Every place holds an item: the thread is outside ``next()`` and asks for no more."""
        with self._changed:
            return self._room == 0 and len(self._ready) == self._slots

    def _run(self) -> None:
        try:
            while True:
                with self._changed:
                    self._changed.wait_for(lambda: self._stopping or self._room > 0)
                    if self._stopping:
                        return
                    self._room -= 1
                try:
                    item: Any = next(self._iterator)
                except StopIteration:
                    item = _END
                except BaseException as exc:  # delivered to the consumer, in order
                    item = _Failure(exc)
                with self._changed:
                    self._ready.append(item)
                    self._changed.notify_all()
                if item is _END or isinstance(item, _Failure):
                    return
        finally:
            with self._changed:
                self._left = True
                then = self._then
            if then is not None:
                then()

    def take(self) -> Any:
        """The next item, waiting for it; raises StopIteration at the end, or the iterator's error."""
        with self._changed:
            self._changed.wait_for(lambda: self._ready)
            item = self._ready.popleft()
            if item is not _END and not isinstance(item, _Failure):
                self._room += 1
                self._changed.notify_all()
        if item is _END:
            raise StopIteration
        if isinstance(item, _Failure):
            raise item.error
        return item

    def stop(self) -> None:
        """Take no more items; a thread waiting for a free place leaves now."""
        with self._changed:
            self._stopping = True
            self._ready.clear()  # the consumer has left
            self._changed.notify_all()

    def finish(self, timeout: float | None, then: Callable[[], None], wake: Callable[[], None] | None = None) -> bool:
        """After ``stop``: wait up to ``timeout`` for the thread to leave the iterator; True when it has.

        If it is still inside ``next()`` then, ``wake`` (if given) tries to free it; if it does
        not leave, it runs ``then`` itself when ``next()`` returns.
        """
        self._thread.join(timeout)
        if self._thread.is_alive() and wake is not None:
            wake()
            self._thread.join(_utils.MP_STATUS_CHECK_INTERVAL)
        with self._changed:
            if not self._left:
                self._then = then
                return False
        self._thread.join()  # only its last few lines are left
        return True
