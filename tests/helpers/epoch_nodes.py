"""Node processes that train several epochs as one run (module-level, so that they pickle).

A node runs the documented loop (a ``Session`` and ``shared_queue``, the defaults) over
``epochs(units, n)`` and appends ``identifier step`` per batch its loop received to
``consumed-{learner}-{run}.txt`` before anything else happens, so a SIGKILL loses nothing; its
progress records' writes go to ``written-{learner}.txt`` (``elastic_nodes.ProgressLog``).
A batch's step label names its ``(epoch, unit, position)``: ``decode_step``.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from elastic_nodes import ProgressLog  # tests/helpers/ is on sys.path (tests/conftest.py)
from process_harness import join_all

from gradientmail import Session
from gradientmail.data import EpochUnit
from gradientmail.patterns.shared_queue import shared_queue

STEPS_PER_UNIT = 3
UNITS_PER_EPOCH = 1000  # an upper bound for the step labels' layout


def encode_step(epoch: int, unit: int, position: int) -> int:
    return (epoch * UNITS_PER_EPOCH + unit) * STEPS_PER_UNIT + position


def decode_step(step: int) -> tuple[int, int, int]:
    """``(epoch, unit, position)`` of a step label."""
    rest, position = divmod(step, STEPS_PER_UNIT)
    epoch, unit = divmod(rest, UNITS_PER_EPOCH)
    return epoch, unit, position


EPOCHS, UNITS = 2, 24


def batch_index(epoch: int, unit: int, position: int) -> int:
    return (epoch * UNITS + unit) * STEPS_PER_UNIT + position


def batch_counter() -> torch.nn.Linear:
    """A model with one weight per batch of the run: training a batch adds 1 to its own."""
    model = torch.nn.Linear(EPOCHS * UNITS * STEPS_PER_UNIT, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    return model


def load_epoch_unit(item: EpochUnit[int]):
    for position in range(STEPS_PER_UNIT):
        yield encode_step(item.epoch, item.unit, position), torch.tensor([item.epoch, item.unit, position])


@dataclass
class EpochNode:
    root: str
    learner: str
    units: dict[str, EpochUnit[int]]
    out_dir: str
    run: int = 1
    train: float = 0.0  # seconds per batch
    kill_in_epoch: int | None = None  # SIGKILL itself once it consumed ...
    kill_after: int = 0  # ... this many batches of that epoch
    barrier: Any = None


def run_epoch_node(spec: EpochNode) -> None:
    from gradientmail import LocalMailbox

    box = ProgressLog(LocalMailbox(spec.root, create=False), spec.out_dir, spec.learner)
    consumed = Path(spec.out_dir) / f"consumed-{spec.learner}-{spec.run}.txt"
    names = {(item.epoch, item.unit): key for key, item in spec.units.items()}
    model = batch_counter()
    if spec.barrier is not None:
        spec.barrier.wait(timeout=60)
    in_epoch = 0
    with (
        Session(
            model, mailbox=box, learner_id=spec.learner, every=timedelta(seconds=0.3), fragments=1, outer="average"
        ) as session,
        shared_queue(
            spec.units, mailbox=box, learner_id=spec.learner, load=load_epoch_unit, workers=0, prefetch=2
        ) as batches,
    ):
        for step, batch in batches:
            epoch, unit, position = (int(v) for v in batch)
            assert decode_step(step) == (epoch, unit, position)
            with open(consumed, "a", encoding="utf-8") as handle:
                handle.write(f"{names[epoch, unit]} {step}\n")
            if spec.train:
                time.sleep(spec.train)
            with torch.no_grad():
                model.weight[0, batch_index(epoch, unit, position)] += 1.0
            session.step(samples=1)
            if epoch == spec.kill_in_epoch:
                in_epoch += 1
                if in_epoch >= spec.kill_after:
                    os.kill(os.getpid(), signal.SIGKILL)


def run_epoch_nodes(specs: list[EpochNode], *, timeout: float = 90, killed: frozenset[str] = frozenset()) -> None:
    """Fork one process per spec (sharing a start barrier); all but ``killed`` must succeed."""
    context = multiprocessing.get_context("fork")
    barrier = context.Barrier(len(specs))
    processes = []
    for spec in specs:
        spec.barrier = barrier
        processes.append(context.Process(target=run_epoch_node, args=(spec,), name=spec.learner))
    for process in processes:
        process.start()
    codes = dict(zip((p.name for p in processes), join_all(processes, timeout)))
    for name, code in codes.items():
        expected = -signal.SIGKILL if name in killed else 0
        assert code == expected, f"node processes ended with {codes} (expected {name}: {expected})"
