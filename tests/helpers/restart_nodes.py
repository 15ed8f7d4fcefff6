"""A training process for the restart tests, run as a script: ``DataLoader(SharedQueueDataset(...))``
with one worker, the user's own loop, killing itself (SIGKILL) after a number of batches.

``python restart_nodes.py BOX LEARNER UNITS STEPS OUT [KILL_AFTER]`` appends ``identifier step``
per batch its loop received to ``OUT`` (one write per line: a SIGKILL loses nothing).
"""

from __future__ import annotations

import os
import signal
import sys

import torch
from torch.utils.data import DataLoader

from gradientmail import LocalMailbox, SharedQueueDataset


def load(unit: int):  # module-level: the DataLoader worker pickles it
    for step in range(STEPS):
        yield step, torch.tensor([unit, step])


STEPS = 4

if __name__ == "__main__":
    root, learner, units, STEPS, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    kill_after = int(sys.argv[6]) if len(sys.argv) > 6 else None
    dataset = SharedQueueDataset(
        {f"{i:05d}": i for i in range(units)}, mailbox=LocalMailbox(root), learner_id=learner, load=load
    )
    received = 0
    for step, batch in DataLoader(dataset, batch_size=None, num_workers=1, multiprocessing_context="fork"):
        with open(out, "a", encoding="utf-8") as handle:
            handle.write(f"{int(batch[0]):05d} {step}\n")
        received += 1
        if kill_after is not None and received >= kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
