"""Train a byte-level language model on the Python standard library, one process per node.

torchrun --standalone --nproc_per_node=4 examples/quickstart.py runs/quickstart-1
"""

import os
import sys
import sysconfig
from datetime import timedelta
from pathlib import Path

import torch
from torch import nn

from gradientmail import Session, consensus, default_learner_id, open_mailbox
from gradientmail.patterns.shared_queue import shared_queue

CONTEXT, BATCH, UNITS, UNIT_STEPS = 32, 64, int(os.environ.get("UNITS", 48)), 20
files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
text = torch.frombuffer(bytearray(b"".join(f.read_bytes() for f in files)), dtype=torch.uint8)
train, held_out = text[: len(text) * 9 // 10].long(), text[len(text) * 9 // 10 :].long()


def windows(data: torch.Tensor, seed: int, rows: int = BATCH) -> torch.Tensor:  # rows of CONTEXT + 1 bytes
    starts = torch.randint(len(data) - CONTEXT - 1, (rows, 1), generator=torch.Generator().manual_seed(seed))
    return data[starts + torch.arange(CONTEXT + 1)]


def load_unit(unit: int):  # a unit of work: UNIT_STEPS batches, the same on every node
    for step in range(unit * UNIT_STEPS, (unit + 1) * UNIT_STEPS):
        yield step, windows(train, step)


def loss_of(model: nn.Module, rows: torch.Tensor) -> torch.Tensor:  # next byte from CONTEXT bytes
    return nn.functional.cross_entropy(model(rows[:, :-1]), rows[:, -1])


torch.manual_seed(0)  # every node starts from the same model (the first one in sets the run's base)
model = nn.Sequential(nn.Embedding(256, 32), nn.Flatten(), nn.Linear(32 * CONTEXT, 512), nn.ReLU(), nn.Linear(512, 256))
optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
box = open_mailbox(sys.argv[1] if len(sys.argv) > 1 else "runs/quickstart")
me = default_learner_id()  # host name + launcher rank (torchrun, SLURM): unique in the run, kept on restart
units = {f"{i:05d}": i for i in range(UNITS)}

with (
    Session(model, mailbox=box, learner_id=me, every=timedelta(seconds=1)) as session,
    shared_queue(units, mailbox=box, learner_id=me, load=load_unit) as batches,
):
    for step, rows in batches:
        optimizer.zero_grad()
        loss_of(model, rows).backward()
        optimizer.step()
        session.step(samples=len(rows))

consensus(box, model)  # the run's model: every node's progress (the last node to finish has it all)
with torch.no_grad():
    print(f"{me}: {session.steps} steps, held-out loss {loss_of(model, windows(held_out, 0, 4096)).item():.3f}")
