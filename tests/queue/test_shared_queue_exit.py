"""Leaving shared_queue's with block: nothing left behind, an operation in flight finishes, the
wait is bounded."""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path

import pytest
import torch
from queue_loads import claimed_ids, leftovers, load_item, wait_until
from queue_nodes import Item, named_units

from gradientmail import LocalMailbox
from gradientmail.patterns.shared_queue import shared_queue

pytestmark = pytest.mark.timeout(60)


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("how", ["break", "exception"])
def test_early_exit_leaves_nothing_behind(local_mailbox, workers, how):
    threads_before = set(threading.enumerate())
    units = named_units(200, steps=2)

    class Stop(Exception):
        pass

    with contextlib.suppress(Stop):
        with shared_queue(
            units, mailbox=local_mailbox, learner_id="q", load=load_item, prefetch=4, workers=workers
        ) as batches:
            for n, _ in enumerate(batches):
                if n == 5:
                    if how == "break":
                        break
                    raise Stop
    children, threads = leftovers(threads_before)
    assert children == [] and threads == []
    claimed = claimed_ids(local_mailbox)
    assert 3 <= len(claimed) < len(units)
    time.sleep(0.3)  # must-not-happen check: a leftover prefetcher would claim more now
    assert claimed_ids(local_mailbox) == claimed
    assert list(batches) == [], "the iterator is finished after the block"


@pytest.mark.timeout(60)
def test_exit_without_iterating(local_mailbox):
    threads_before = set(threading.enumerate())
    with shared_queue(named_units(50), mailbox=local_mailbox, learner_id="idle", load=load_item, workers=2, prefetch=2):
        pass
    assert leftovers(threads_before) == ([], [])
    assert len(claimed_ids(local_mailbox)) <= 2


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_slow_operation_in_flight_is_allowed_to_finish(tmp_path):
    """DataLoader alone would SIGTERM a worker still busy after 5 s; the queue waits for it."""
    mailbox = LocalMailbox(tmp_path / "box")
    load = SlowSecondBatch(str(tmp_path), seconds=6.0)
    threads_before = set(threading.enumerate())
    with shared_queue(
        named_units(3, steps=3), mailbox=mailbox, learner_id="slow", load=load, prefetch=2, workers=1
    ) as batches:
        next(batches)
        assert load.started(), "the slow load is in flight when the block is left"
    assert (tmp_path / "finished").exists(), "the in-flight load was interrupted"
    assert (tmp_path / "closed").exists(), "the loader's own cleanup ran"
    assert leftovers(threads_before) == ([], [])


def test_shutdown_timeout_bounds_the_wait(memory_mailbox):
    release = threading.Event()

    def load(item):
        yield 0, torch.zeros(1)
        release.wait(20)
        yield 1, torch.zeros(1)

    with pytest.warns(UserWarning, match="shutdown_timeout"):
        with shared_queue(
            named_units(2), mailbox=memory_mailbox, learner_id="t", load=load, workers=0, shutdown_timeout=0.1
        ) as batches:
            next(batches)
    release.set()  # the abandoned operation finishes in the background
    wait_until(lambda: not any(t.name.startswith("gradientmail-shared-queue-t") for t in threading.enumerate()))


class SlowSecondBatch:
    def __init__(self, out_dir: str, seconds: float) -> None:
        self.out = Path(out_dir)
        self.seconds = seconds

    def started(self) -> bool:
        deadline = time.monotonic() + 20
        while not (self.out / "started").exists():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def __call__(self, item: Item):
        try:
            yield 0, torch.tensor([item.index, 0])
            (self.out / "started").touch()
            time.sleep(self.seconds)
            (self.out / "finished").touch()
            yield 1, torch.tensor([item.index, 1])
        finally:
            (self.out / "closed").touch()
