"""The shared queue: nodes claim work units through the mailbox, fast nodes simply take more.

``shared_queue`` is the public function (module ``context``), ``dataset`` / ``loader`` / ``handoff``
feed batches, ``claims`` is the protocol (one atomic create, read back), ``claimer`` picks the next
unit, ``reclaim`` / ``progress`` are the elastic queue's two sides.
"""

from __future__ import annotations

from gradientmail.queue.claim_counter import units_claimed_by
from gradientmail.queue.claim_index import ClaimIndex, PositionOrder
from gradientmail.queue.claimer import Claimer
from gradientmail.queue.claims import read_claim, try_claim
from gradientmail.queue.context import QueueContext, shared_queue
from gradientmail.queue.dataset import SharedQueueDataset
from gradientmail.queue.units import Unit, rotated_order, unit_grid
from gradientmail.run_record import prepare_mailbox

__all__ = [
    "ClaimIndex",
    "Claimer",
    "PositionOrder",
    "QueueContext",
    "SharedQueueDataset",
    "Unit",
    "prepare_mailbox",
    "read_claim",
    "rotated_order",
    "shared_queue",
    "try_claim",
    "unit_grid",
    "units_claimed_by",
]
