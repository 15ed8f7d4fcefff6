"""shared_queue in one process: every batch once, bounded prefetch, errors that reach the loop."""

from __future__ import annotations

import multiprocessing
import threading
import time

import pytest
import torch
from queue_loads import FailingLoad, ProducedCounter, claimed_ids, load_item, wait_until
from queue_nodes import RecordingLoad, named_units

from gradientmail import LocalMailbox, SharedQueueDataset
from gradientmail.errors import (
    LoaderError,
    MailboxError,
)
from gradientmail.layout import CLAIMS_PREFIX
from gradientmail.mailbox.wrappers import FaultyMailbox
from gradientmail.patterns.shared_queue import shared_queue

FORK = multiprocessing.get_context("fork")

pytestmark = pytest.mark.timeout(60)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [0, 1, 2])
def test_shared_queue_delivers_every_batch_once(local_mailbox, workers):
    units = named_units(20, steps=3)
    with shared_queue(
        units, mailbox=local_mailbox, learner_id=f"w{workers}", load=load_item, prefetch=4, workers=workers
    ) as batches:
        got = [(int(t[0]), step) for step, t in batches]
    assert sorted(got) == [(i, s) for i in range(20) for s in range(3)]
    # Each unit's steps arrive in order; with two workers, units interleave.
    for i in range(20):
        assert [s for u, s in got if u == i] == [0, 1, 2]
    assert sorted(claimed_ids(local_mailbox)) == sorted(units)


def test_workers_zero_runs_with_memory_mailbox_and_unpicklable_loader(memory_mailbox):
    units = named_units(4, steps=2)
    lock = threading.Lock()  # cannot be pickled

    def load(item):  # a closure: cannot be pickled either
        with lock:
            yield from load_item(item)

    with shared_queue(units, mailbox=memory_mailbox, learner_id="nb", load=load, workers=0) as batches:
        assert len(list(batches)) == 8


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [1, 2])
def test_two_workers_of_one_node_never_load_one_unit(tmp_path, workers):
    mailbox = LocalMailbox(tmp_path / "box")
    units = named_units(60)
    load = RecordingLoad(str(tmp_path), "n")
    with shared_queue(units, mailbox=mailbox, learner_id="n", load=load, prefetch=2, workers=workers) as batches:
        got = sorted(int(t[0]) for _, t in batches)
    assert got == list(range(60))
    loaded = [name for path in tmp_path.glob("loaded-*.txt") for name in path.read_text().split()]
    assert sorted(loaded) == sorted(units), "each unit loaded exactly once across workers"


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize(("workers", "prefetch"), [(0, 3), (1, 3), (2, 4), (2, 2), (2, 5)])
def test_prefetch_bounds_batches_in_flight_and_claims(local_mailbox, workers, prefetch):
    units = named_units(40)
    load = ProducedCounter(steps=3)
    # DataLoader's prefetch_factor is per worker: prefetch=5 over 2 workers buffers 2 x 2.
    bound = prefetch // workers * workers if workers else prefetch
    consumed = 0
    with shared_queue(  # the design note's queue: the elastic one's buffer holds end markers too
        units, mailbox=local_mailbox, learner_id="p", load=load, prefetch=prefetch, workers=workers, resume=False
    ) as batches:
        for _ in range(3):
            # The buffer fills to exactly `prefetch`...
            wait_until(lambda done=consumed: load.produced.value >= done + bound)
            claimed = len(claimed_ids(local_mailbox))
            # ...and then nothing more is produced or claimed while the loop stalls (a
            # must-not-happen check: an implementation that overran would be caught here).
            time.sleep(0.3)
            assert load.produced.value == consumed + bound <= consumed + prefetch
            assert len(claimed_ids(local_mailbox)) == claimed
            # No hoarding: units of 3 batches, at most one unit started per worker beyond those.
            assert claimed <= -(-(consumed + bound) // 3) + max(workers, 1) - 1
            for _ in range(4):
                next(batches)
                consumed += 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [0, 1, 2])
def test_load_error_arrives_after_buffered_batches(local_mailbox, workers):
    units = named_units(10)
    load = FailingLoad(bad=2)
    got = []
    with pytest.raises(ValueError, match="boom in unit 00002") as caught:
        with shared_queue(
            units, mailbox=local_mailbox, learner_id="e", load=load, prefetch=8, workers=workers
        ) as batches:
            if workers <= 1:
                # One producer runs 8 batches ahead, past the failing one. Two each run 3 ahead
                # (plus the hand-off's 2, from either): the failing 4th of one may wait.
                assert load.failed.wait(60)  # a bound for a hang: DataLoader workers start slowly on busy cores
            for step, tensor in batches:
                got.append((int(tensor[0]), step))
    assert (2, 0) in got, "the failing unit's batch produced before the error was delivered"
    if workers <= 1:
        # One producer: everything it produced before the error came first, in order.
        assert got == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0)]
    assert "00002" in str(caught.value) or any("00002" in n for n in getattr(caught.value, "__notes__", []))


def test_iterator_ends_after_an_error(memory_mailbox):
    with shared_queue(
        named_units(5), mailbox=memory_mailbox, learner_id="e", load=FailingLoad(bad=0), workers=0
    ) as batches:
        next(batches)
        with pytest.raises(ValueError):
            next(batches)
        assert list(batches) == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [0, 1])
def test_mailbox_error_reaches_the_loop(local_mailbox, workers):
    calls = FORK.Value("i", 0)

    def fault(operation, key):
        if operation == "put_if_absent" and key.startswith(CLAIMS_PREFIX):
            with calls.get_lock():
                calls.value += 1
                if calls.value == 3:
                    return MailboxError("store on fire", operation=operation, key=key, store="test")
        return None

    mailbox = FaultyMailbox(local_mailbox, fault)
    got = []
    with pytest.raises(MailboxError, match="store on fire"):
        with shared_queue(
            named_units(10), mailbox=mailbox, learner_id="m", load=load_item, prefetch=4, workers=workers
        ) as batches:
            for _, tensor in batches:
                got.append(int(tensor[0]))
    assert got == [0, 1]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [1, 2])
def test_loader_yielding_the_wrong_thing(memory_mailbox, local_mailbox, workers):
    def bad_load(item):
        yield "not a pair"

    with pytest.raises(LoaderError, match=r"unit '00000'.*str 'not a pair'"):
        list(SharedQueueDataset(named_units(1), mailbox=memory_mailbox, learner_id="x", load=bad_load))
    with pytest.raises(LoaderError, match="00000"):
        with shared_queue(
            named_units(3), mailbox=local_mailbox, learner_id="x", load=bad_load, workers=workers, prefetch=3
        ) as batches:
            list(batches)


@pytest.mark.parametrize(
    "item",
    [(1.5, torch.zeros(1)), (1, [1, 2]), (True, torch.zeros(1)), (1, torch.zeros(1), 2), torch.zeros(2), None],
)
def test_loader_error_names_unit_and_what_it_yielded(memory_mailbox, item):
    def bad_load(value):
        yield item

    with pytest.raises(LoaderError) as caught:
        list(SharedQueueDataset({"u-7": 0}, mailbox=memory_mailbox, learner_id="x", load=bad_load))
    assert "'u-7'" in str(caught.value) and type(item).__name__ in str(caught.value)
    assert isinstance(caught.value, TypeError)
    assert len(str(caught.value)) < 400, "long values are truncated"


def test_loader_returning_a_non_iterable(memory_mailbox):
    with pytest.raises(LoaderError, match="'u'.*NoneType"):
        list(SharedQueueDataset({"u": 0}, mailbox=memory_mailbox, learner_id="x", load=lambda value: None))
