"""One node of ``gradientmail demo``: the documented loop, ``shared_queue`` + ``Session``.

A node trains a small MLP on synthetic data (any node can build any unit from its random seed),
simulates its speed by sleeping after each batch, and reports ``(rank, event)`` pairs on a
queue: ``ready``, ``batch``, ``unit`` (the unit's exact training span), then ``done`` or ``error``.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

FEATURES = 16
HIDDEN = 32
BATCH = 32
"""Samples per batch (one lane's share of a dataset step)."""
VALIDATION = 1024
EXCHANGE_EVERY = timedelta(seconds=0.5)
"""Session exchange interval: short, so that a run of seconds exchanges parameters often."""


@dataclass
class NodeConfig:
    """Everything one node needs; picklable, so it travels to the node process."""

    name: str
    learner_id: str
    rank: int
    mailbox: str
    endpoint_url: str | None
    units: int
    unit_steps: int
    lanes: int
    batch_time: float
    slowdown_factor: float = 1.0
    slowdown_at: float = 0.0
    prefetch: int = 2
    seed: int = 0
    learning_rate: float = 0.01
    log: str | None = None


# -- the model and the data (also used by the consensus process) ------------------------------
def make_model(seed: int):
    import torch

    torch.manual_seed(seed)  # every node starts from the same parameters
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, 1))


def _teacher(seed: int):
    import torch

    generator = torch.Generator().manual_seed(10_000 + seed)
    weight = torch.randn(FEATURES, 1, generator=generator) / FEATURES**0.5
    return weight


def synthetic_batch(seed: int, step: int, lane: int, lanes: int, rows: int = BATCH):
    """Lane ``lane`` of dataset step ``step``: ``rows`` x (FEATURES + 1), the target last.

    A noisy linear teacher: easy enough that a few dozen steps per node visibly learn it.
    """
    import torch

    generator = torch.Generator().manual_seed(seed * 1_000_003 + step * lanes + lane)
    x = torch.randn(rows, FEATURES, generator=generator)
    y = x @ _teacher(seed) + 0.05 * torch.randn(rows, 1, generator=generator)
    return torch.cat([x, y], dim=1)


def validation_loss(model, seed: int) -> float:
    import torch

    data = synthetic_batch(seed, step=-1, lane=0, lanes=1, rows=VALIDATION)
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(model(data[:, :-1]), data[:, -1:]))


# -- the node ---------------------------------------------------------------------------------
def _open(config: NodeConfig):
    from gradientmail.mailbox.url import open_mailbox

    options = {"endpoint_url": config.endpoint_url} if config.endpoint_url else {}
    return open_mailbox(config.mailbox, **options)


def run_node(config: NodeConfig, emit: Callable[..., None], go: Any, start_at: Any) -> None:
    """The node's whole life; ``go`` is an Event the demo sets, ``start_at`` a shared double."""
    import torch

    from gradientmail.queue.context import shared_queue
    from gradientmail.queue.units import rotated_order, unit_grid
    from gradientmail.session.core import Session

    torch.set_num_threads(1)  # several nodes share the demo machine's cores
    mailbox = _open(config)
    steps = config.units // config.lanes * config.unit_steps
    units = unit_grid(steps, config.unit_steps, config.lanes)
    identifier_of = {unit: identifier for identifier, unit in units.items()}
    model = make_model(config.seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=config.learning_rate)

    # Units in the order the loader started them; batches arrive in the same order.
    loaded: deque[str] = deque()

    def load(unit):
        loaded.append(identifier_of[unit])
        for step in range(unit.first, unit.first + unit.count):
            yield step, synthetic_batch(config.seed, step, unit.lane, unit.lanes)

    emit(event="ready")
    go.wait()
    start = start_at.value
    time.sleep(max(0.0, start - time.time()))

    batches_done = samples = 0
    units_done = 0
    unit_start = 0.0
    current = None
    loss_value = float("nan")
    session = Session(model, mailbox=mailbox, learner_id=config.learner_id, every=EXCHANGE_EVERY)
    with (
        session,
        shared_queue(
            units,
            mailbox=mailbox,
            learner_id=config.learner_id,
            load=load,
            prefetch=config.prefetch,
            workers=0,  # one loader thread: the synthetic data costs nothing to make
            order=rotated_order(units, config.rank, config.lanes),
        ) as batches,
    ):
        for step, batch in batches:
            began = time.time()
            # Every unit has unit_steps batches (the grid divides evenly) and one loader
            # thread delivers units in the order it started them, so this batch opens the
            # next unit exactly when the count says so.
            if batches_done % config.unit_steps == 0:
                current = loaded.popleft() if loaded else f"unit-{units_done}"
                unit_start = began
            loss = torch.nn.functional.mse_loss(model(batch[:, :-1]), batch[:, -1:])
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            session.step(samples=len(batch))
            # The simulated hardware: this node needs batch_time seconds per batch
            # (slowdown_factor times more from slowdown_at seconds into the run on).
            slow = config.slowdown_factor if began - start >= config.slowdown_at else 1.0
            time.sleep(max(0.0, began + config.batch_time * slow - time.time()))
            batches_done += 1
            samples += len(batch)
            loss_value = loss.item()
            now = time.time()
            finished_unit = batches_done % config.unit_steps == 0
            units_done += finished_unit
            emit(
                event="batch",
                units=units_done,
                batches=batches_done,
                samples=samples,
                loss=loss_value,
                step=step,
                time=now,
            )
            if finished_unit:
                emit(event="unit", unit=current, start=unit_start, end=now)
        if batches_done % config.unit_steps:  # a last, shorter unit
            units_done += 1
            emit(event="unit", unit=current, start=unit_start, end=time.time())
    finished = time.time()
    emit(
        event="done",
        units=units_done,
        batches=batches_done,
        samples=samples,
        train_loss=loss_value,
        loss=validation_loss(model, config.seed),
        exchanges=session.exchanges,
        merges=session.merges,
        finished=finished,
    )


def node_process(config: NodeConfig, events: Any, go: Any, start_at: Any) -> None:
    """Entry point of a node process: runs the node and reports its end on ``events``."""
    if config.log:
        descriptor = os.open(config.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(descriptor, 2)
        os.close(descriptor)
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115

    def emit(**event: Any) -> None:
        events.put((config.rank, event))

    try:
        run_node(config, emit, go, start_at)
    except KeyboardInterrupt:
        sys.exit(130)
    except BaseException as exc:
        traceback.print_exc()
        emit(event="error", message=f"{type(exc).__name__}: {' '.join(str(exc).split())}")
        sys.exit(1)


def consensus_process(url: str, endpoint_url: str | None, seed: int, events: Any) -> None:
    """The run's result: validation loss before training and of the ``consensus`` model."""
    from gradientmail.session.merge import consensus

    config = NodeConfig("", "", -1, url, endpoint_url, 0, 1, 1, 0.0, seed=seed)
    model = make_model(seed)
    initial = validation_loss(model, seed)
    weights = consensus(_open(config), model)
    events.put(
        (
            -1,
            {"event": "consensus", "initial": initial, "final": validation_loss(model, seed), "learners": len(weights)},
        )
    )
