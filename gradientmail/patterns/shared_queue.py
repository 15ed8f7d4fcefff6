"""Old home of the shared queue, kept so that its import paths keep working.

The code lives in ``gradientmail.queue`` (``shared_queue``, ``dataset``, ``counter``, ...);
``from gradientmail.patterns.shared_queue import shared_queue`` is the seed's documented import.
"""

from __future__ import annotations

from gradientmail.errors import InProcessMailboxError, UnpicklableError
from gradientmail.queue.batch_checks import Batch
from gradientmail.queue.counter import units_claimed_by
from gradientmail.queue.dataset import SharedQueueDataset, prepare_mailbox
from gradientmail.queue.shared_queue import WITH_HINT, QueueContext, log, shared_queue

__all__ = [
    "WITH_HINT",
    "Batch",
    "InProcessMailboxError",
    "QueueContext",
    "SharedQueueDataset",
    "UnpicklableError",
    "log",
    "prepare_mailbox",
    "shared_queue",
    "units_claimed_by",
]
