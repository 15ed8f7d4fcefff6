"""Requests overlapped on reusable daemon threads: a fold's listings and reads in one round trip.

An object store serves requests in parallel (S3 does), so reading a fragment's version and the
contributions pending beside it costs about one request's latency when the reads overlap. The
threads are kept for reuse (a thread start per request costs more CPU than the request) and are
daemons, as the session's own: a store that never answers must not keep the interpreter alive.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Iterable
from contextvars import ContextVar
from typing import Any, TypeVar

T = TypeVar("T")
R = TypeVar("R")

PARALLEL_REQUESTS = 8
"""Requests one learner keeps in flight at once while reading or cleaning up a fragment."""

Overlap = Callable[[list[Callable[[], Any]], int], list[Any]]
"""Runs tasks overlapped on at most ``lanes`` at once and returns their results in order."""

OVERLAP: ContextVar[Overlap | None] = ContextVar("gradientmail_overlap", default=None)
"""This thread's way to overlap requests instead of the daemon threads, when set: a simulator
whose learners run as cooperative tasks on a virtual clock overlaps them as tasks of its own."""


class _Lanes:
    """Daemon threads kept for reuse, so that overlapped requests start no thread each.

    A thread is added only when every existing one is busy; idle ones wait for the next request.
    Daemons, as the session's own thread: a store that never answers must not keep the
    interpreter alive at exit.
    """

    def __init__(self) -> None:
        self._reset()
        os.register_at_fork(after_in_child=self._reset)  # a forked child has none of the threads

    def _reset(self) -> None:
        self._tasks: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._idle = 0
        self._lock = threading.Lock()

    def submit(self, task: Callable[[], None]) -> None:
        with self._lock:
            spawn = self._idle == 0
            if not spawn:
                self._idle -= 1
        self._tasks.put(task)
        if spawn:
            threading.Thread(target=self._serve, name="gradientmail-io", daemon=True).start()

    def _serve(self) -> None:
        tasks = self._tasks
        while True:
            tasks.get()()
            with self._lock:
                self._idle += 1


_LANES = _Lanes()


def parallel(function: Callable[[T], R], items: Iterable[T], *, lanes: int = PARALLEL_REQUESTS) -> list[R]:
    """``[function(item) for item in items]``, overlapped on up to ``lanes`` threads.

    Requests to an object store overlap (S3 serves them in parallel), so a fold's listings and
    reads cost about one round trip, not one per object. The first error is raised once every
    request has finished.
    """
    items = list(items)
    if len(items) <= 1:
        return [function(item) for item in items]
    overlap = OVERLAP.get()
    if overlap is not None:
        return overlap([lambda item=item: function(item) for item in items], lanes)
    results: list[Any] = [None] * len(items)
    errors: list[BaseException] = []
    groups = [range(k, len(items), lanes) for k in range(min(lanes, len(items)))]
    remaining = [len(groups) - 1]
    finished = threading.Event()
    lock = threading.Lock()

    def run(indices: range) -> None:
        for i in indices:
            try:
                results[i] = function(items[i])
            except BaseException as exc:  # raised below, on the calling thread
                errors.append(exc)

    def lane(indices: range) -> None:
        run(indices)
        with lock:
            remaining[0] -= 1
            if remaining[0] == 0:
                finished.set()

    for group in groups[1:]:
        _LANES.submit(lambda group=group: lane(group))
    run(groups[0])
    if len(groups) > 1:  # one lane (``lanes=1``): everything ran here
        finished.wait()
    if errors:
        raise errors[0]
    return results
