"""Loaders and checks shared by the shared-queue tests that run in one process."""

from __future__ import annotations

import multiprocessing
import threading
import time

import torch
from queue_nodes import Item

from gradientmail.layout import CLAIMS_PREFIX

FORK = multiprocessing.get_context("fork")


def load_item(item: Item):
    """The documented example's load: ``item.steps`` batches, each naming its unit and step."""
    for step in range(item.steps):
        yield step, torch.tensor([item.index, step])


def claimed_ids(mailbox) -> list[str]:
    """The identifiers claimed in ``mailbox``, in key order."""
    return [key[len(CLAIMS_PREFIX) :] for key in mailbox.list(CLAIMS_PREFIX)]


def wait_until(condition, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.01)


def leftovers(threads_before: set[threading.Thread]) -> tuple[list, list]:
    """Child processes alive now, and threads started since ``threads_before`` still running."""
    return multiprocessing.active_children(), [t for t in threading.enumerate() if t not in threads_before]


class ProducedCounter:
    """A loader that counts batches produced (across worker processes) and records their units."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.produced = FORK.Value("i", 0)

    def __call__(self, item: Item):
        for step in range(self.steps):
            with self.produced.get_lock():
                self.produced.value += 1
            yield step, torch.tensor([item.index, step])


class FailingLoad:
    """Yields two batches per unit; the unit with index ``bad`` fails after its first batch."""

    def __init__(self, bad: int) -> None:
        self.bad = bad
        self.failed = FORK.Event()

    def __call__(self, item: Item):
        for step in range(2):
            if item.index == self.bad and step == 1:
                self.failed.set()
                raise ValueError(f"boom in unit {item.name}")
            yield step, torch.tensor([item.index, step])
