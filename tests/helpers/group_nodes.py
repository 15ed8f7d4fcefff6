"""Node processes for ``test_groups.py``: ``python tests/helpers/group_nodes.py JSON``.

One process is one rank of a group ("a machine"): a gloo process group of its own per group
(its own TCP port), DDP inside it, ``Session(group=...)`` and ``shared_queue(group=...)``
across groups on one ``LocalMailbox``. Each rank writes what it trained (the rows of every
step) and a fingerprint of its parameters after every step to ``out``.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from gradientmail import LocalMailbox, Session
from gradientmail.patterns.shared_queue import shared_queue

torch.set_num_threads(1)  # four processes share two cores

DIM, BATCH, UNIT_STEPS, UNITS = 4, 8, 3, 10


def load_unit(unit: int) -> Iterator[tuple[int, tuple[Tensor, Tensor, Tensor]]]:
    """Unit ``unit``'s steps: rows numbered ``step * BATCH + i``, ``y = x @ w* `` (the same everywhere)."""
    w_star = torch.arange(1.0, DIM + 1)
    for step in range(unit * UNIT_STEPS, (unit + 1) * UNIT_STEPS):
        rows = torch.arange(step * BATCH, (step + 1) * BATCH)
        x = torch.randn(BATCH, DIM, generator=torch.Generator().manual_seed(step))
        yield step, (rows, x, x @ w_star)


def fingerprint(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for tensor in model.state_dict().values():
        digest.update(tensor.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def start_line(box: LocalMailbox, name: str, count: int) -> None:
    box.put(f"ready/{name}", b"")
    deadline = time.monotonic() + 120
    while sum(1 for _ in box.list("ready/")) < count:
        if time.monotonic() > deadline:
            raise TimeoutError("the other ranks never started")
        time.sleep(0.01)


def main(config: dict) -> dict:
    group, rank = config["group"], config["rank"]
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{config['port']}", rank=rank, world_size=config["size"]
    )
    box = LocalMailbox(config["mailbox"])
    torch.manual_seed(0)
    model = torch.nn.Linear(DIM, 1)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    units = {f"{unit:04d}": unit for unit in range(UNITS)}
    learner = f"machine-{group}"
    elastic = config.get("elastic", False)
    start_line(box, f"{group}-{rank}", config["ranks"])
    trained: list[list[int]] = []
    prints: list[str] = []
    with (
        Session(
            ddp, mailbox=box, learner_id=learner, every_steps=2, outer="average", group=dist.group.WORLD
        ) as session,
        shared_queue(
            units,
            mailbox=box,
            learner_id=learner,
            load=load_unit,
            workers=0,
            prefetch=2,
            resume=elastic,
            lease=timedelta(seconds=60) if elastic else None,
            group=dist.group.WORLD,
        ) as batches,
    ):
        for step, (rows, x, y) in batches:
            loss = torch.nn.functional.mse_loss(ddp(x).squeeze(1), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            session.step(samples=len(rows))
            trained.append([step, *rows.tolist()])
            prints.append(fingerprint(model))
            time.sleep(config["delay"])
    result = {
        "group": group,
        "rank": rank,
        "learner": session.learner_id,
        "trained": trained,
        "prints": prints,
        "final": fingerprint(model),
        "steps": session.steps,
        "samples": session.samples,
        "merges": session.merges,
    }
    dist.destroy_process_group()
    return result


if __name__ == "__main__":
    settings = json.loads(sys.argv[1])
    outcome = main(settings)
    with open(settings["out"], "w") as file:
        json.dump(outcome, file)
