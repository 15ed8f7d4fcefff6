"""Node processes for ``test_session_processes.py``: ``python tests/helpers/session_nodes.py KIND JSON``.

``documented``: the documented example (``shared_queue`` + ``Session``), its loop
verbatim, with a tiny language model on the CPU and small constants.

``regression``: linear regression with a known weight vector; each node sleeps ``delay`` seconds
per batch (unequal speeds) and trains with or without a ``Session``.

Each node writes a JSON result to ``out``. Nodes wait for each other on a start line in the
mailbox (``ready/``) so that their speeds, not their import times, decide who claims what.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
from documented_loop import run_documented_loop  # tests/helpers/ is on sys.path (tests/conftest.py)
from torch import Tensor

from gradientmail import LocalMailbox, Session

torch.set_num_threads(1)  # several nodes share two cores

# -- the design note's example, with small constants ----------------------------------------------------

VOCAB = 16
LENGTH = 12
BATCH = 32
steps = 16
unit_steps = 4
nodes = 2


@dataclass(frozen=True)
class Unit:
    first: int
    count: int
    lane: int
    lanes: int


units = {
    f"{first // unit_steps:06d}-{lane}.json": Unit(
        first=first,
        count=min(unit_steps, steps - first),
        lane=lane,
        lanes=nodes,
    )
    for first in range(0, steps, unit_steps)
    for lane in range(nodes)
}


def sequences(start: int, count: int) -> Tensor:
    """``count`` token sequences from ``start``: each counts up by one, modulo the vocabulary."""
    return (torch.arange(start, start + count)[:, None] * 5 + torch.arange(LENGTH + 1)) % VOCAB


def load_unit(unit: Unit) -> Iterator[tuple[int, Tensor]]:
    share = BATCH // unit.lanes

    for step in range(unit.first, unit.first + unit.count):
        start = step * BATCH + unit.lane * share
        yield step, sequences(start, share)


class TinyLanguageModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 16)
        self.head = torch.nn.Linear(16, VOCAB)

    def forward(self, inputs: Tensor, targets: Tensor) -> Tensor:
        logits = self.head(self.embed(inputs))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def learning_rate(step: int) -> float:
    return 0.05 * min(1.0, (step + 1) / 4)


def start_line(box: LocalMailbox, rank: int, count: int) -> None:
    box.put(f"ready/{rank}", b"")
    deadline = time.monotonic() + 120
    while sum(1 for _ in box.list("ready/")) < count:
        if time.monotonic() > deadline:
            raise TimeoutError("the other nodes never started")
        time.sleep(0.01)


def documented_node(config: dict) -> dict:
    rank = config["rank"]
    box = LocalMailbox(config["mailbox"])
    device = "cpu"
    torch.manual_seed(0)
    model = TinyLanguageModel().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate(0))
    session = Session(model, mailbox=box, learner_id=f"node-{rank}", every_steps=2)
    start_line(box, rank, nodes)

    last_loss = run_documented_loop(
        units=units,
        box=box,
        rank=rank,
        nodes=nodes,
        BATCH=BATCH,
        load_unit=load_unit,
        model=model,
        optimizer=optimizer,
        session=session,
        learning_rate=learning_rate,
        device=device,
    )
    return {
        "rank": rank,
        "loss": None if last_loss is None else float(last_loss),
        "steps": session.steps,
        "samples": session.samples,
        "exchanges": session.exchanges,
        "merges": session.merges,
    }


# -- linear regression with a known optimum ------------------------------------------------------

DIM = 8
NOISE = 0.5
REG_BATCH = 16
REG_UNIT_STEPS = 4
REG_UNITS = 128
LEARNING_RATE = 0.02
W_SCALE = 4.0
"""Start far from the optimum (|w*| ~ 6), so that a node that trains alone on few batches ends
visibly short of it, while the run as a whole has batches enough to reach the noise floor."""


def regression_data() -> tuple[Tensor, Tensor, Tensor]:
    """``(x, y, w_star)``: ``y = x @ w_star + noise``, the same on every node (fixed seed)."""
    generator = torch.Generator().manual_seed(1234)
    w_star = W_SCALE * torch.randn(DIM, generator=generator)
    x = torch.randn(REG_UNITS * REG_UNIT_STEPS * REG_BATCH, DIM, generator=generator)
    y = x @ w_star + NOISE * torch.randn(len(x), generator=generator)
    return x, y, w_star


def regression_units() -> dict[str, int]:
    return {f"{index:06d}.json": index for index in range(REG_UNITS)}


def regression_batches(x: Tensor, y: Tensor, index: int) -> Iterator[tuple[int, Tensor]]:
    for step in range(index * REG_UNIT_STEPS, (index + 1) * REG_UNIT_STEPS):
        rows = slice(step * REG_BATCH, (step + 1) * REG_BATCH)
        yield step, torch.cat([x[rows], y[rows, None]], dim=1)


def regression_model() -> torch.nn.Linear:
    model = torch.nn.Linear(DIM, 1, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    return model


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Tensor) -> None:
    loss = torch.nn.functional.mse_loss(model(batch[:, :-1]).squeeze(1), batch[:, -1])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def regression_node(config: dict) -> dict:
    """Train once per entry of ``config["runs"]`` (``{"mailbox", "session"}``), one after another.

    The same process serves as an independent node and as a node with a ``Session``, in two
    runs on two mailboxes, which halves the processes (and torch imports) a test starts.
    """
    return {"rank": config["rank"], "runs": [regression_run(config, run) for run in config["runs"]]}


def regression_run(config: dict, run: dict) -> dict:
    from contextlib import nullcontext

    from gradientmail.patterns.shared_queue import shared_queue

    rank = config["rank"]
    box = LocalMailbox(run["mailbox"])
    x, y, _ = regression_data()
    model = regression_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    learner = f"node-{rank}"
    session = (
        # The plain rule: with SGD on a convex loss near its optimum, outer momentum
        # (the default, tuned for Adam on a language model) overshoots.
        Session(model, mailbox=box, learner_id=learner, every=timedelta(seconds=config["every_s"]), outer="average")
        if run["session"]
        else None
    )
    start_line(box, rank, config["nodes"])
    batches_done = 0
    with (
        session or nullcontext(),
        shared_queue(
            regression_units(),
            mailbox=box,
            learner_id=learner,
            load=lambda index: regression_batches(x, y, index),
            prefetch=REG_UNIT_STEPS,
            workers=0,
        ) as batches,
    ):
        for _, batch in batches:
            began = time.monotonic()
            train_step(model, optimizer, batch)
            if session is not None:
                session.step(samples=len(batch))
            batches_done += 1
            time.sleep(max(0.0, began + config["delay"] - time.monotonic()))
    return {
        "batches": batches_done,
        "weight": model.weight.detach().squeeze(0).tolist(),
        "merges": session.merges if session is not None else 0,
    }


if __name__ == "__main__":
    kind, config = sys.argv[1], json.loads(sys.argv[2])
    result = {"documented": documented_node, "regression": regression_node}[kind](config)
    with open(config["out"], "w") as handle:
        json.dump(result, handle)
