"""How ``shared_queue`` stops its DataLoader workers between operations, never inside one."""

from __future__ import annotations

import multiprocessing.context
from collections.abc import Iterator
from typing import TypeVar

__all__ = ["WorkerControl", "guarded"]

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
