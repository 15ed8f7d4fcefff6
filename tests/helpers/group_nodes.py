"""Node processes for ``test_groups.py``: ``python tests/helpers/group_nodes.py JSON``.

One process is one rank of a group ("a machine"): a gloo process group of its own per group
(its own TCP port), DDP inside it, ``Session(group=...)`` and ``shared_queue(group=...)``
across groups on one ``LocalMailbox``. Each rank writes what it trained (the rows of every
step) and a fingerprint of its parameters after every step to ``out``; an error, as
``{"error": ...}``. Options: ``dataset`` (the group's ranks iterate
``SharedQueueDataset(group=)`` in their own ``DataLoader`` instead of ``shared_queue``), ``kill_after`` (SIGKILL this rank after that many steps), ``log``
(append each trained step to this file as it happens: a killed rank's record), ``mode``
``"drag"`` (no queue: every rank adds 1 to one parameter per step, ``steps`` steps) or
``"wait"`` (rank 0's store ``latency`` seconds away: ``wait(timeout=)`` runs out) or
``"orphan"`` (rank 1 killed inside the Session, rank 0 stepping).
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.data import DataLoader

from gradientmail import LocalMailbox, Session
from gradientmail.mailbox.wrappers import DelayedMailbox
from gradientmail.patterns.shared_queue import SharedQueueDataset, shared_queue

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


def drag(config: dict, box: LocalMailbox) -> dict:
    """Every rank adds 1 to the one parameter per step: the group is one learner of ``steps``."""
    model = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    learner = f"machine-{config['group']}"
    start_line(box, f"{config['group']}-{config['rank']}", config["ranks"])
    with Session(
        model, mailbox=box, learner_id=learner, every=None, every_steps=3, outer="average", group=dist.group.WORLD
    ) as session:
        for _ in range(config["steps"]):
            with torch.no_grad():
                model.weight.add_(1.0)
            session.step(samples=1)
            time.sleep(config["delay"])
        # Every group stays a member until all are done (as the one-process drag figure does).
        box.put(f"done/{config['group']}-{config['rank']}", b"")
        while sum(1 for _ in box.list("done/")) < config["ranks"]:
            time.sleep(0.01)
    return {"group": config["group"], "rank": config["rank"], "steps": session.steps, "final": model.weight.item()}


def wait_past_timeout(config: dict, box: LocalMailbox) -> dict:
    """Rank 0's store is slow: ``wait(timeout=)`` runs out there; every rank must raise."""
    model = torch.nn.Linear(DIM, 1)
    slow = DelayedMailbox(box, config["latency"]) if config["rank"] == 0 else box
    raised = "nothing"
    with Session(
        model, mailbox=slow, learner_id="machine-0", every=None, every_steps=1, group=dist.group.WORLD
    ) as session:
        session.step(samples=1)  # an exchange starts on rank 0, slow
        try:
            session.wait(timeout=timedelta(seconds=0.05))
        except Exception as error:
            raised = f"{type(error).__name__}: {error}"
        session.wait()  # then it lands, on every rank
    return {"group": 0, "rank": config["rank"], "raised": raised, "final": fingerprint(model)}


def orphan(config: dict, box: LocalMailbox) -> dict:
    """Rank 1 is killed inside the Session; rank 0 goes on stepping until its group's word fails."""
    model = torch.nn.Linear(DIM, 1)
    with Session(model, mailbox=box, learner_id="machine-0", every_steps=2, group=dist.group.WORLD) as session:
        if config["rank"] == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        for _ in range(10_000):  # a hang here is the failure the test looks for
            session.step(samples=1)
            time.sleep(0.01)
    return {"rank": config["rank"], "error": "stepped on without its group"}


def main(config: dict) -> dict:
    """Run this rank, then tear its process group down once nothing of the run holds it: a
    group destroyed only at interpreter exit (still held by a reference cycle) aborts there."""
    outcome = train(config)
    gc.collect()
    dist.barrier()  # nothing of the group in flight when either rank tears it down
    dist.destroy_process_group()
    return outcome


def train(config: dict) -> dict:
    group, rank = config["group"], config["rank"]
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{config['port']}",
        rank=rank,
        world_size=config["size"],
        timeout=timedelta(seconds=config.get("timeout_s", 60)),
    )
    box = LocalMailbox(config["mailbox"])
    if config.get("mode") == "drag":
        return drag(config, box)
    if config.get("mode") == "orphan":
        return orphan(config, box)
    if config.get("mode") == "wait":
        return wait_past_timeout(config, box)
    torch.manual_seed(0)
    model = torch.nn.Linear(DIM, 1)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    units = {f"{unit:04d}": unit for unit in range(UNITS)}
    learner = f"machine-{group}"
    elastic = config.get("elastic", False)
    if not config.get("restart"):
        start_line(box, f"{group}-{rank}", config["ranks"])
    log = open(config["log"], "a", encoding="ascii") if config.get("log") else None  # noqa: SIM115
    trained: list[list[int]] = []
    prints: list[str] = []
    lease = timedelta(seconds=60) if elastic else None
    if config.get("dataset"):
        dataset = SharedQueueDataset(
            units, mailbox=box, learner_id=learner, load=load_unit, resume=elastic, lease=lease, group=dist.group.WORLD
        )
        queue = contextlib.nullcontext(DataLoader(dataset, batch_size=None, num_workers=0))
    else:
        queue = shared_queue(
            units,
            mailbox=box,
            learner_id=learner,
            load=load_unit,
            workers=0,
            prefetch=2,
            resume=elastic,
            lease=lease,
            group=dist.group.WORLD,
        )
    with (
        Session(
            ddp, mailbox=box, learner_id=learner, every_steps=2, outer="average", group=dist.group.WORLD
        ) as session,
        queue as batches,
    ):
        for step, (rows, x, y) in batches:
            loss = torch.nn.functional.mse_loss(ddp(x).squeeze(1), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            session.step(samples=len(rows))
            trained.append([step, *rows.tolist()])
            prints.append(fingerprint(model))
            if log is not None:
                log.write(f"{step}\n")
                log.flush()  # a SIGKILL loses nothing this loop did
            if len(trained) == config.get("kill_after"):
                os.kill(os.getpid(), signal.SIGKILL)
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
    return result


if __name__ == "__main__":
    settings = json.loads(sys.argv[1])
    try:
        outcome = main(settings)
    except Exception as error:  # a clean stop of this rank: say why
        outcome = {"error": f"{type(error).__name__}: {error}"}
    gc.collect()  # the failed run's frames and cycles, which hold the group
    if dist.is_initialized():
        with contextlib.suppress(Exception):  # a broken group tears down as it can
            dist.destroy_process_group()
    with open(settings["out"], "w") as file:
        json.dump(outcome, file)
    sys.exit(1 if "error" in outcome else 0)
