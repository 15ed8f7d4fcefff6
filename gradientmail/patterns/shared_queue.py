"""The design note's documented import path: ``from gradientmail.patterns.shared_queue import shared_queue``.

It names the two entry points the design note documents here, ``shared_queue``
and ``SharedQueueDataset``; they live in ``gradientmail.queue`` and are also ``gradientmail``'s.
"""

from __future__ import annotations

from gradientmail.queue.context import shared_queue
from gradientmail.queue.dataset import SharedQueueDataset

__all__ = ["SharedQueueDataset", "shared_queue"]
