"""The thread pump: with ``workers=0`` the dataset claims and loads on a thread of this process.

A ``HandOff`` runs the dataset's iterator a bounded number of batches ahead of the loop, so the
loop never waits for a claim it could have overlapped with training.
"""

from __future__ import annotations

import warnings
from typing import Any

from gradientmail.queue.batch_checks import Batch, Item
from gradientmail.queue.consume import Batches, LoopHooks
from gradientmail.queue.dataset import SharedQueueDataset
from gradientmail.queue.handoff import HandOff

__all__ = ["ThreadBatches"]


class ThreadBatches(Batches):
    """``workers=0``: claims and loads on one background thread, ``prefetch`` batches ahead."""

    def __init__(
        self,
        dataset: SharedQueueDataset[Any],
        prefetch: int,
        timeout: float | None,
        *,
        hooks: LoopHooks | None = None,
    ) -> None:
        super().__init__(hooks)
        self._timeout = timeout
        self._gauge = dataset.gauge
        self._source = iter(dataset)
        # A daemon: never keeps the interpreter alive; close() joins it.
        self._pump = HandOff(self._source, prefetch, f"gradientmail-shared-queue-{dataset.learner_id}")

    def _next(self) -> Batch | Item:
        batch = self._pump.take()
        if self._gauge is not None:
            self._gauge.consumed()
        return batch

    def close(self) -> None:
        """Stop the thread, then close the dataset's iterator (waiting up to ``timeout``)."""
        self._finished = True
        if self._gauge is not None:
            self._gauge.close()  # a loader waiting for its turn to claim leaves at once
        self._pump.stop()
        if self._pump.finish(self._timeout, self._close_source):
            self._close_source()
            return
        warnings.warn(
            f"shared_queue: the loader thread did not finish its operation within "
            f"{self._timeout} s (shutdown_timeout); leaving it to finish in the background",
            stacklevel=2,
        )

    def _close_source(self) -> None:
        try:
            close = getattr(self._source, "close", None)
            if close is not None:
                close()  # the loader's own cleanup (a generator's finally blocks)
        except Exception as exc:  # the consumer has moved on; do not lose it silently
            warnings.warn(f"shared_queue: the loader failed while closing: {exc!r}", stacklevel=1)
