"""A DataLoader worker never outlives its training process, even stuck inside ``next()``."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import pytest
import torch

from gradientmail import LocalMailbox
from gradientmail.patterns.shared_queue import shared_queue

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


class StuckLoad:
    """Yields one batch, reports the worker's pid, then blocks for good (a hung store or reader)."""

    def __init__(self, pids) -> None:
        self.pids = pids

    def __call__(self, value: int):
        yield 0, torch.tensor([value])
        self.pids.put(os.getpid())
        time.sleep(3600)


def train(path: str, pids) -> None:
    """The training process: takes one batch, then waits to be killed."""
    with shared_queue({"a": 1, "b": 2}, mailbox=LocalMailbox(path), learner_id="n", load=StuckLoad(pids)) as batches:
        next(batches)
        time.sleep(3600)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by init) is not alive
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_worker_stuck_in_next_exits_when_its_training_process_is_sigkilled(tmp_path):
    context = multiprocessing.get_context("fork")
    pids = context.Queue()
    trainer = context.Process(target=train, args=(str(tmp_path / "box"), pids))
    trainer.start()
    worker = pids.get(timeout=60)  # the worker is now inside next(), in load
    os.kill(trainer.pid, signal.SIGKILL)
    trainer.join(10)
    deadline = time.monotonic() + 60  # a bound for a hang, not a timing check
    while alive(worker) and time.monotonic() < deadline:
        time.sleep(0.2)
    if alive(worker):
        os.kill(worker, signal.SIGKILL)
        pytest.fail(f"DataLoader worker {worker} outlived its SIGKILLed training process")
