"""Node processes for ``test_fsdp_groups.py``: ``python tests/helpers/fsdp_nodes.py JSON``.

One process is one rank of a group ("a machine"): a gloo process group of its own per group,
a CPU device mesh over it and a model sharded with FSDP2 (``fully_shard``), ``Session(group=)``
and ``shared_queue(group=)`` across groups on one ``LocalMailbox``. The model is built so that
every step adds exactly 1 to every parameter, and its outer optimizer folds progress as it is:
the run's model is then its base plus the number of steps all groups trained, exactly. Each
rank records the steps it trained, its mailbox requests, and its shard's values.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from gradientmail import LocalMailbox, Session, consensus
from gradientmail.patterns.shared_queue import shared_queue

torch.set_num_threads(1)  # four processes share two cores

BATCH, UNIT_STEPS, UNITS = 4, 3, 6


class Ramp(torch.nn.Module):
    """Two layers whose loss is minus the sum of their parameters: SGD with ``lr=1`` adds 1 to each."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(6, 5)
        self.second = torch.nn.Linear(5, 3)

    def forward(self, rows: Tensor) -> Tensor:
        total = sum(parameter.sum() for parameter in self.parameters())
        return 0.0 * rows.float().sum() - total


def build() -> Ramp:
    """The same initial model in every process (a plain one, for ``consensus``, too)."""
    torch.manual_seed(0)
    return Ramp()


@dataclass(frozen=True)
class Whole:
    """An outer optimizer that folds progress as it is (no ``/ N``): the run sums its learners."""

    name: str = "whole"

    def start(self):
        return lambda progress, active: progress


def load_unit(unit: int) -> Iterator[tuple[int, Tensor]]:
    for step in range(unit * UNIT_STEPS, (unit + 1) * UNIT_STEPS):
        yield step, torch.arange(step * BATCH, (step + 1) * BATCH)


class Counting:
    """Records the fragments this process reads and writes (mixed into a mailbox class)."""

    touched: set[str]

    def _note(self, key: str) -> None:
        if key.startswith("session/fragments/"):
            self.touched.add(key.split("/")[2])

    def get(self, key, *args, **kwargs):
        self._note(key)
        return super().get(key, *args, **kwargs)

    def put(self, key, *args, **kwargs):
        self._note(key)
        return super().put(key, *args, **kwargs)

    def put_if_absent(self, key, *args, **kwargs):
        self._note(key)
        return super().put_if_absent(key, *args, **kwargs)


def open_box(config: dict):
    """The run's mailbox: a local directory, or a prefix of an S3 bucket (SeaweedFS)."""
    if "s3" in config:
        from gradientmail.mailbox.s3 import S3Mailbox

        s3 = config["s3"]
        box = type("CountingS3", (Counting, S3Mailbox), {})(s3["bucket"], s3["prefix"], endpoint_url=s3["endpoint"])
    else:
        box = type("CountingLocal", (Counting, LocalMailbox), {})(config["mailbox"])
    box.touched = set()
    return box


def start_line(box: LocalMailbox, name: str, count: int, prefix: str = "ready/") -> None:
    box.put(f"{prefix}{name}", b"")
    deadline = time.monotonic() + 120
    while sum(1 for _ in box.list(prefix)) < count:
        if time.monotonic() > deadline:
            raise TimeoutError("the other ranks never started")
        time.sleep(0.05)  # a listing per poll: spare the store (and the shared cores)


def main(config: dict) -> dict:
    group, rank = config["group"], config["rank"]
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{config['port']}", rank=rank, world_size=config["size"]
    )
    mesh = init_device_mesh("cpu", (config["size"],))
    model = build()
    for layer in (model.first, model.second):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    box = open_box(config)
    units = {f"{unit:04d}": unit for unit in range(config.get("units", UNITS))}
    learner = f"machine-{group}"
    try:  # a sharded model without its group would exchange one rank's shard as a whole model
        Session(model, mailbox=box, learner_id=learner)
        refused = ""
    except ValueError as error:
        refused = str(error)
    elastic = config.get("elastic", False)
    start_line(box, f"{group}-{rank}", config["ranks"])
    trained: list[int] = []
    with (
        Session(
            model, mailbox=box, learner_id=learner, every_steps=2, outer=Whole(), group=dist.group.WORLD
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
        for step, rows in batches:
            model(rows).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            session.step(samples=len(rows))
            trained.append(step)
            if len(trained) == config.get("die_after"):
                with open(config["out"] + ".trained", "w") as file:  # what it trained before dying
                    json.dump(trained, file)
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(config["delay"])
    touched = sorted(box.touched)
    start_line(box, f"left-{group}-{rank}", config["ranks"], "left/")  # every group has left the run
    loaded = consensus(box, model)  # this rank's shard of the run's model, from its own fragments
    shard = {name: tensor.to_local().tolist() for name, tensor in model.state_dict().items()}
    result = {
        "group": group,
        "rank": rank,
        "learner": session.learner_id,
        "trained": trained,
        "samples": session.samples,
        "merges": session.merges,
        "fragments": session.fragments,
        "touched": touched,
        "loaded": loaded,
        "refused": refused,
        "shard": shard,
    }
    dist.destroy_process_group()
    return result


if __name__ == "__main__":
    settings = json.loads(sys.argv[1])
    outcome = main(settings)
    with open(settings["out"], "w") as file:
        json.dump(outcome, file)
