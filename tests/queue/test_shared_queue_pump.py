"""shared_queue with workers: the hand-off thread that takes batches off the training thread.

DataLoader worker processes on a LocalMailbox. The bound on buffered batches, errors in order,
and leaving the block while the hand-off waits for room or for a blocked worker.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import queue
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch
from queue_nodes import Item, named_units
from test_shared_queue import FailingLoad, ProducedCounter, leftovers, load_item, wait_until
from torch.utils.data import _utils

from gradientmail.layout import CLAIMS_PREFIX
from gradientmail.mailbox.base import describe
from gradientmail.patterns.shared_queue import shared_queue
from gradientmail.queue.handoff import HandOff
from gradientmail.queue.pumps import wake_loader
from gradientmail.queue.telemetry import spans_record

FORK = multiprocessing.get_context("fork")

pytestmark = pytest.mark.timeout(60)


def _handoff_threads(learner: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == f"gradientmail-handoff-{learner}"]


def _handoff_full(batches, slots: int) -> bool:
    """Every place of the hand-off holds a batch: it is not inside next() and asks for no more."""
    pump = batches.handoff
    return pump.slots == slots and pump.full()


class BlockingLoad:
    """Yields a unit's first batch, then blocks until ``release()`` (a worker busy in ``load``).

    Files, not multiprocessing events: a worker may be terminated while it waits, and an event
    with a terminated waiter cannot be set any more.
    """

    def __init__(self, out_dir: Path) -> None:
        self.out = out_dir

    def blocked(self) -> bool:
        wait_until(lambda: (self.out / "blocked").exists())
        return True

    def release(self) -> None:
        (self.out / "release").touch()

    def finished(self) -> bool:
        return (self.out / "finished").exists()

    def __call__(self, item: Item):
        yield 0, torch.tensor([item.index, 0])
        (self.out / "blocked").touch()
        deadline = time.monotonic() + 30
        while not (self.out / "release").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        (self.out / "finished").touch()
        yield 1, torch.tensor([item.index, 1])


# -- the thread ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("workers", "prefetch"), [(1, 2), (1, 8), (2, 4), (2, 5)])
def test_handoff_thread_runs_while_iterating_and_is_gone_after(local_mailbox, workers, prefetch):
    threads_before = set(threading.enumerate())
    units = named_units(12, steps=2)
    with shared_queue(
        units, mailbox=local_mailbox, learner_id="h", load=load_item, prefetch=prefetch, workers=workers, resume=False
    ) as batches:
        [thread] = _handoff_threads("h")
        assert thread.daemon
        got = sorted((int(t[0]), step) for step, t in batches)
    assert got == [(i, s) for i in range(12) for s in range(2)]
    with pytest.raises(StopIteration):
        next(batches)  # the end was delivered once; the iterator stays finished
    assert leftovers(threads_before) == ([], [])


@pytest.mark.parametrize(("workers", "prefetch"), [(1, 1), (2, 2), (2, 3)])
def test_a_worker_with_one_place_keeps_the_direct_path(local_mailbox, workers, prefetch):
    """prefetch < 2 * workers: each worker has a single place, none to give to a hand-off."""
    threads_before = set(threading.enumerate())
    with shared_queue(
        named_units(10, steps=2),
        mailbox=local_mailbox,
        learner_id="d",
        load=load_item,
        prefetch=prefetch,
        workers=workers,
        resume=False,
    ) as batches:
        assert batches.handoff is None and _handoff_threads("d") == []
        got = sorted((int(t[0]), step) for step, t in batches)
    assert got == [(i, s) for i in range(10) for s in range(2)]
    assert leftovers(threads_before) == ([], [])


# -- the bound -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("workers", "prefetch"), [(1, 2), (1, 8), (2, 4), (2, 5), (2, 8)])
def test_at_most_prefetch_batches_buffered_in_all(local_mailbox, workers, prefetch):
    load = ProducedCounter(steps=3)
    fill = prefetch // workers * workers  # DataLoader's places are per worker
    consumed = 0
    with shared_queue(
        named_units(60),
        mailbox=local_mailbox,
        learner_id="b",
        load=load,
        prefetch=prefetch,
        workers=workers,
        resume=False,
    ) as batches:
        for _ in range(3):
            # The loop stalls. The buffer fills, and then the hand-off has every place taken,
            # so it is outside next() and DataLoader sends the workers no further request:
            # nothing more can be produced until a batch is taken.
            wait_until(lambda done=consumed: load.produced.value >= done + fill)
            wait_until(lambda: _handoff_full(batches, slots=workers))  # a place per worker
            assert load.produced.value - consumed == fill <= prefetch
            for _ in range(prefetch + 1):  # more than a buffer's worth, so the workers refill it
                next(batches)
                consumed += 1


# -- errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("workers", "prefetch", "bad"), [(1, 8, 2), (1, 2, 0), (2, 8, 0), (2, 4, 0)])
def test_error_after_the_batches_buffered_before_it(local_mailbox, workers, prefetch, bad):
    units = named_units(10)
    load = FailingLoad(bad=bad)
    got = []
    with pytest.raises(ValueError, match=f"boom in unit 0000{bad}") as caught:
        with shared_queue(
            units, mailbox=local_mailbox, learner_id="e", load=load, prefetch=prefetch, workers=workers, resume=False
        ) as batches:
            # The failing batch is within what its worker produces ahead of the loop: the
            # error is buffered behind the batches before it when the loop starts.
            assert load.failed.wait(60)  # a bound for a hang: DataLoader workers start slowly on busy cores
            for step, tensor in batches:
                got.append((int(tensor[0]), step))
    assert (bad, 0) in got
    if workers == 1:
        assert got == [(unit, step) for unit in range(bad) for step in (0, 1)] + [(bad, 0)]
    assert "Traceback" in str(caught.value), "the worker's traceback travels with the error"
    assert list(batches) == [], "the iterator ends after the error"


# -- leaving the block ---------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["break", "exception", "keyboard-interrupt"])
def test_leaving_while_the_handoff_waits_for_room(local_mailbox, how):
    threads_before = set(threading.enumerate())
    load = ProducedCounter(steps=2)

    class Stop(Exception):
        pass

    error = {"exception": Stop, "keyboard-interrupt": KeyboardInterrupt}.get(how)
    with contextlib.suppress(Stop, KeyboardInterrupt):
        with shared_queue(
            named_units(100, steps=2),
            mailbox=local_mailbox,
            learner_id="r",
            load=load,
            prefetch=4,
            workers=1,
            resume=False,
        ) as batches:
            next(batches)
            wait_until(lambda: load.produced.value >= 1 + 4)
            wait_until(lambda: _handoff_full(batches, slots=1))
            if error is not None:
                raise error
    assert leftovers(threads_before) == ([], [])
    assert list(batches) == []
    claimed = len(list(local_mailbox.list(CLAIMS_PREFIX)))
    assert claimed <= 3, "a unit is claimed only when its first batch has room"


def test_leaving_waits_for_a_blocked_worker(local_mailbox, tmp_path):
    """No shutdown_timeout: the worker's load in flight finishes; the hand-off then leaves."""
    threads_before = set(threading.enumerate())
    load = BlockingLoad(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing is given up on
        with shared_queue(
            named_units(4, steps=2),
            mailbox=local_mailbox,
            learner_id="w",
            load=load,
            prefetch=4,
            workers=1,
            resume=False,
        ) as batches:
            next(batches)
            assert load.blocked()
            # The hand-off is inside next(), waiting for the blocked worker. Release the worker
            # once the block is being left.
            releaser = threading.Thread(
                target=lambda: batches.control.stop.wait(20) and load.release(),
                daemon=True,
            )
            releaser.start()
    releaser.join(5)
    assert load.finished(), "the load in flight was allowed to finish"
    assert leftovers(threads_before) == ([], [])


@pytest.mark.slow
def test_shutdown_timeout_gives_up_on_a_blocked_worker(local_mailbox, tmp_path):
    """The hand-off, inside next() for a worker that does not return, is woken; DataLoader then
    terminates the worker (after its own 5 s)."""
    threads_before = set(threading.enumerate())
    load = BlockingLoad(tmp_path)
    with pytest.warns(UserWarning, match="shutdown_timeout") as caught:
        with shared_queue(
            named_units(4, steps=2),
            mailbox=local_mailbox,
            learner_id="t",
            load=load,
            prefetch=4,
            workers=1,
            shutdown_timeout=0.2,
            resume=False,
        ) as batches:
            next(batches)
            assert load.blocked()
    assert len(caught) == 1, [str(w.message) for w in caught]  # the hand-off itself was freed
    load.release()
    assert not load.finished(), "the blocked worker was terminated, not waited for"
    assert leftovers(threads_before) == ([], [])


def test_pin_memory(local_mailbox):
    threads_before = set(threading.enumerate())
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*pin_memory.*")  # no accelerator here
        with shared_queue(
            named_units(8, steps=2),
            mailbox=local_mailbox,
            learner_id="p",
            load=load_item,
            prefetch=4,
            workers=2,
            pin_memory=True,
            resume=False,
        ) as batches:
            got = sorted((int(t[0]), step) for step, t in batches)
    assert got == [(i, s) for i in range(8) for s in range(2)]
    assert leftovers(threads_before) == ([], [])


# -- the hand-off on its own ---------------------------------------------------------------------


class FakeLoaderIterator:
    """Stands in for DataLoader's iterator: next() unpacks what its data queue holds."""

    def __init__(self, data_queue) -> None:
        self._data_queue = data_queue

    def __iter__(self):
        return self

    def __next__(self):
        index, data = self._data_queue.get()
        if index is None:
            raise StopIteration
        return data


def test_handoff_woken_inside_next():
    data = queue.Queue()
    loader = FakeLoaderIterator(data)
    pump = HandOff(loader, 2, "gradientmail-handoff-unit")
    data.put((0, "a"))
    assert pump.take() == "a"
    pump.stop()
    # Blocked in next() with nothing coming: woken by an item it cannot unpack.
    assert pump.finish(0.05, then=lambda: pytest.fail("not abandoned"), wake=lambda: wake_loader(loader))
    assert _handoff_threads("unit") == []


def test_handoff_that_cannot_be_woken_runs_the_cleanup_itself(monkeypatch):
    monkeypatch.setattr(_utils, "MP_STATUS_CHECK_INTERVAL", 0.05)
    release = threading.Event()
    cleaned = threading.Event()

    class Stuck:
        def __next__(self):
            release.wait(20)
            raise StopIteration

    pump = HandOff(Stuck(), 1, "gradientmail-handoff-stuck")
    pump.stop()
    assert not pump.finish(0.05, then=cleaned.set, wake=lambda: None)
    assert not cleaned.is_set()
    release.set()
    assert cleaned.wait(20), "the thread shut the iterator down when it returned"
    wait_until(lambda: _handoff_threads("stuck") == [])


def test_handoff_delivers_end_and_errors_in_order():
    data = queue.Queue()
    for item in [(0, "a"), (1, "b")]:
        data.put(item)

    class Failing(FakeLoaderIterator):
        def __next__(self):
            if self._data_queue.empty():
                raise KeyboardInterrupt("from the loader")
            return super().__next__()

    pump = HandOff(Failing(data), 1, "gradientmail-handoff-order")
    assert [pump.take(), pump.take()] == ["a", "b"]
    with pytest.raises(KeyboardInterrupt, match="from the loader"):
        pump.take()
    wait_until(lambda: _handoff_threads("order") == [])

    ended = queue.Queue()
    ended.put((0, "a"))
    ended.put((None, None))
    pump = HandOff(FakeLoaderIterator(ended), 1, "gradientmail-handoff-end")
    assert pump.take() == "a"
    with pytest.raises(StopIteration):
        pump.take()
    wait_until(lambda: _handoff_threads("end") == [])


@pytest.mark.parametrize("resume", [False, True])
def test_each_batch_crosses_the_worker_pipe_naming_its_unit(local_mailbox, resume):
    """A DataLoader worker hands each batch over as one ``batches.Item`` (its unit's tag kept
    through collation and the pipe): the loop gets plain ``(step, batch)`` pairs, and every
    unit's batches are timed under that unit's name (with ``resume``: and recorded as consumed)."""
    units = named_units(3, steps=2)
    learner = f"items-{resume}"
    with shared_queue(
        units, mailbox=local_mailbox, learner_id=learner, load=load_item, workers=1, resume=resume
    ) as batches:
        got = list(batches)
    assert all(type(pair) is tuple and len(pair) == 2 for pair in got)
    assert sorted((int(batch[0]), step) for step, batch in got) == [(u, s) for u in range(3) for s in range(2)]
    spans = spans_record(describe(local_mailbox), learner)
    assert spans is not None
    assert sorted((entry["unit"], entry["batches"]) for entry in spans["recent"]) == [
        (unit, 2) for unit in sorted(units)
    ]
