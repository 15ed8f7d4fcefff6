"""Stopping ``shared_queue``'s DataLoader workers between operations, never inside one."""

from __future__ import annotations

import multiprocessing.context
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import TypeVar

__all__ = ["PARENT_CHECK_S", "WorkerControl", "exit_with_parent", "guarded"]

T = TypeVar("T")


class WorkerControl:
    """What ``shared_queue`` shares with its worker processes to stop them.

    ``stop`` ends claiming and loading; each worker holds ``locks[worker]`` around every step
    of its claim/load generator, so acquiring a worker's lock waits for the operation in flight
    to finish instead of interrupting it.
    """

    def __init__(self, context: multiprocessing.context.BaseContext, workers: int) -> None:
        self.stop = context.Event()
        self.locks = [context.Lock() for _ in range(workers)]


PARENT_CHECK_S = 1.0
"""Seconds between a DataLoader worker's looks at whether the process that started it is alive."""

_PARENT_WATCH: list[int] = []  # the pid this worker process watches, once its watch runs


def exit_with_parent() -> None:
    """Make this DataLoader worker process exit when the process that started it dies.

    DataLoader's own watchdog looks only between batches; a worker inside ``next()`` (waiting for
    a claim's turn, for orphaned units, or in a store's request) would outlive a SIGKILLed
    training process for good, holding its memory. A daemon thread checks the parent every
    ``PARENT_CHECK_S`` and ends the process at once (SIGKILL to itself: no cleanup that waits on
    the dead parent's pipes). Idempotent per process.
    """
    if _PARENT_WATCH:
        return
    parent = os.getppid()
    _PARENT_WATCH.append(parent)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_CHECK_S)
        os.kill(os.getpid(), signal.SIGKILL)  # no cleanup: it would wait on the dead parent's pipes

    threading.Thread(target=watch, name="gradientmail-parent-watch", daemon=True).start()


def guarded(items: Iterator[T], control: WorkerControl, worker: int) -> Iterator[T]:
    """Run ``items`` one step at a time under the worker's lock, until ``stop`` is set."""
    lock = control.locks[worker]
    try:
        while True:
            with lock:
                if control.stop.is_set():
                    return
                try:
                    item = next(items)
                except StopIteration:
                    return
                except BaseException:
                    # This node is failing: the other workers stop claiming; batches already
                    # buffered, then this error, still reach the consumer in order.
                    control.stop.set()
                    raise
            yield item
    finally:
        with lock:
            items.close()  # the loader's own cleanup, as part of the last operation
