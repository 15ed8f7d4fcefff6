"""Claiming ahead (``ClaimAhead``): concurrent claims that stay exactly-once, grow only when the
loop starves, deliver errors in order, and leave nothing running behind."""

from __future__ import annotations

import functools
import threading
from collections import Counter
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
from queue_nodes import Item, RecordingLoad, named_units, read_lines

from gradientmail import LocalMailbox, SharedQueueDataset, units_claimed_by
from gradientmail.errors import MailboxError
from gradientmail.layout import CLAIMS_PREFIX
from gradientmail.mailbox.wrappers import DelayedMailbox, FaultyMailbox, MailboxWrapper
from gradientmail.patterns.shared_queue import shared_queue
from gradientmail.queue.claim_ahead import DEFAULT_CLAIM_AHEAD, ClaimAhead, DepthGauge
from gradientmail.queue.claimer import Claimer
from gradientmail.queue.claims import parse_claim
from gradientmail.queue.pacing import BufferGauge

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def box(memory_mailbox):
    return memory_mailbox


def ids(count: int) -> list[str]:
    return [f"u{i:04d}" for i in range(count)]


def claimed(mailbox) -> dict[str, str]:
    """Unit → learner that owns it."""
    return {key[len(CLAIMS_PREFIX) :]: parse_claim(mailbox.get(key))["learner"] for key in mailbox.list(CLAIMS_PREFIX)}


def drain(ahead: ClaimAhead) -> list[str]:
    handed = []
    while (identifier := ahead.next()) is not None:
        handed.append(identifier)
    return handed


class DryGauge:
    """A loop that waits for a batch while the loader claims (it is starving)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def waited(self) -> float:
        self.seconds += 1.0  # each look sees the loop waited one more second since the last
        return self.seconds


class FixedTimes(DepthGauge):
    """Times set by the test instead of measured, so the depth they imply is exact."""

    def __init__(self, claim_s: float, unit_s: float) -> None:
        super().__init__()
        self.claim_s, self.unit_s = claim_s, unit_s

    def claimed(self, seconds: float) -> None:
        pass

    def loaded(self, seconds: float) -> None:
        pass


class SlowStoreClock:
    """The test's clock, moved only by ``take``: a unit takes what ``depth`` claims in flight leave
    of a 200 ms claim behind 5 ms of loading, so claiming deeper pays up to about 41 in flight
    (``DepthClimb`` keeps a deeper depth only when units come faster)."""

    claim_s, unit_s = 0.2, 0.005

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def take(self, ahead: ClaimAhead) -> str | None:
        self.now += max(self.unit_s, (self.claim_s + self.unit_s) / (ahead.depth + 1))
        return ahead.next()

    def until_depth(self, ahead: ClaimAhead, depth: int, most: int = 200) -> list[str | None]:
        """Units taken until ``ahead`` runs ``depth`` claims in flight (at most ``most``)."""
        taken = []
        while ahead.depth < depth and len(taken) < most:
            taken.append(self.take(ahead))
        return taken


class StalledGauge:
    """A loop that has stopped taking batches, with some buffered: it never waits."""

    def waited(self) -> float:
        return 5.0


def test_limit_zero_claims_on_demand_like_the_claimer(box):
    order = ids(12)
    ahead = ClaimAhead(Claimer(box, order, "node-0"), limit=0, gauge=DryGauge())
    handed = drain(ahead)
    ahead.close()
    assert handed == order
    assert ahead.depth == 0 and not ahead.threaded  # no thread was ever started


def test_grows_while_the_loop_starves_and_claims_ahead(box):
    order = ids(40)
    counted = Counter()
    clock = SlowStoreClock()
    ahead = ClaimAhead(
        Claimer(box, order, "node-0"), limit=3, gauge=DryGauge(), count=lambda: counted.update(["won"]), clock=clock
    )
    handed = clock.until_depth(ahead, 3)
    assert ahead.depth == 3
    ahead.wait_in_flight()
    # The units handed out, three more claimed ahead and waiting, nothing else.
    assert len(claimed(box)) == len(handed) + 3 == counted["won"]
    handed += drain(ahead)
    ahead.close()
    assert sorted(handed) == order, "every unit handed out once, none lost"


def test_a_stalled_loop_never_makes_it_claim_ahead(box):
    order = ids(20)
    ahead = ClaimAhead(Claimer(box, order, "node-0"), limit=4, gauge=StalledGauge())
    for handed in range(1, 11):
        ahead.next()
        assert len(claimed(box)) == handed  # claimed on demand only
    ahead.close()
    assert ahead.depth == 0 and not ahead.threaded


def test_without_a_gauge_every_wait_counts(box):
    clock = SlowStoreClock()
    ahead = ClaimAhead(Claimer(box, ids(40), "node-0"), limit=2, clock=clock)
    clock.until_depth(ahead, 2)
    assert ahead.depth == 2
    ahead.close()


def test_buffer_gauge_counts_across_loaders():
    gauge = BufferGauge(loaders=2)
    gauge.produced(0)
    gauge.produced(1)
    gauge.produced(1)
    gauge.produced(None)  # a thread loader uses the first slot
    gauge.consumed()
    assert (gauge.buffered(), gauge.taken()) == (3, 1)


def test_concurrent_claimers_split_every_unit_exactly_once(box):
    order = ids(240)
    slow = DelayedMailbox(box, 0.001)
    results: dict[str, list[str]] = {}
    errors = []

    def node(rank: int) -> None:
        try:
            ahead = ClaimAhead(Claimer(slow, order, f"node-{rank}"), limit=4)
            try:
                results[f"node-{rank}"] = drain(ahead)
            finally:
                ahead.close()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=node, args=(rank,)) for rank in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    everything = [unit for handed in results.values() for unit in handed]
    assert sorted(everything) == order, "no unit lost, none handed out twice"
    owners = claimed(box)
    for learner, handed in results.items():
        assert all(owners[unit] == learner for unit in handed)


def test_claim_error_arrives_after_the_units_claimed_before_it(box):
    order = ids(10)
    ahead = ClaimAhead(Claimer(failing_claim(box, "u0006"), order, "node-0"), limit=3)
    handed = []
    with pytest.raises(MailboxError, match="store unavailable"):
        while True:
            handed.append(ahead.next())
    ahead.close()
    assert handed == order[:6]


class NewestFirstPool:
    """Stands in for the claim thread pool: holds the claims started until ``run``, then runs them
    newest first on the calling thread, the schedule in which a later claim picks its unit first."""

    def __init__(self, max_workers: int, thread_name_prefix: str) -> None:
        self.held: list[tuple[Future, functools.partial]] = []

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future: Future = Future()
        self.held.append((future, functools.partial(fn, *args, **kwargs)))
        return future

    def run(self) -> None:
        held, self.held = self.held, []
        for future, call in reversed(held):
            try:
                future.set_result(call())
            except BaseException as exc:
                future.set_exception(exc)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self.held.clear()


def test_units_and_errors_keep_the_pick_order_whatever_order_claims_run_in(box, monkeypatch):
    pools: list[NewestFirstPool] = []

    def pool(**kwargs) -> NewestFirstPool:
        pools.append(NewestFirstPool(**kwargs))
        return pools[-1]

    monkeypatch.setattr("gradientmail.queue.claim_ahead.ThreadPoolExecutor", pool)
    order = ids(10)
    clock = SlowStoreClock()
    ahead = ClaimAhead(Claimer(failing_claim(box, "u0003"), order, "node-0"), limit=3, clock=clock)
    ahead.times = FixedTimes(claim_s=0.2, unit_s=0.005)  # the second unit's wait starts 3 claims at once
    handed = []
    with pytest.raises(MailboxError, match="store unavailable"):
        while True:
            for started in pools:
                started.run()  # the three claims for u0002-u0004 run newest first
            handed.append(clock.take(ahead))
    ahead.close()
    assert ahead.depth == 3
    assert handed == order[:3], "units handed out in the order they were picked, the error after them"


class BlockingMailbox(MailboxWrapper):
    """Holds every create of one key until released."""

    def __init__(self, inner, key: str) -> None:
        super().__init__(inner)
        self.key = key
        self.entered = threading.Event()
        self.release = threading.Event()

    def put_if_absent(self, key: str, data: bytes) -> bool:
        if key == self.key:
            self.entered.set()
            assert self.release.wait(30)
        return self.inner.put_if_absent(key, data)

    def get(self, key, *, max_bytes=None):
        return self.inner.get(key, max_bytes=max_bytes)

    def list(self, prefix="", start_after=None):
        return self.inner.list(prefix, start_after)


def test_close_waits_for_the_claim_in_flight(box):
    blocking = BlockingMailbox(box, f"{CLAIMS_PREFIX}u0003")
    clock = SlowStoreClock()
    ahead = ClaimAhead(Claimer(blocking, ids(10), "node-0"), limit=2, clock=clock)
    ahead.times = FixedTimes(claim_s=0.2, unit_s=0.005)
    for _ in range(2):  # by the second unit, two claims run ahead: u0003 blocks
        clock.take(ahead)
    assert blocking.entered.wait(30)
    closer = threading.Thread(target=ahead.close)
    closer.start()
    closer.join(0.2)
    assert closer.is_alive(), "close returned while a claim was still in flight"
    blocking.release.set()
    closer.join(30)
    assert not closer.is_alive()
    assert not [t for t in threading.enumerate() if t.name.startswith("gradientmail-claim")]


def test_claims_after_the_end_are_still_handed_out(box):
    # Pending claims that won units when another pick found none are not lost.
    order = ids(7)
    clock = SlowStoreClock()
    ahead = ClaimAhead(Claimer(box, order, "node-0"), limit=4, clock=clock)
    ahead.times = FixedTimes(claim_s=0.2, unit_s=0.005)  # four claims in flight from the second unit
    handed = []
    while (identifier := clock.take(ahead)) is not None:
        handed.append(identifier)
    assert ahead.next() is None
    ahead.close()
    assert handed == sorted(handed) and sorted(handed) == order


def test_dataset_validates_claim_ahead(box):
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises((TypeError, ValueError), match="claim_ahead"):
            SharedQueueDataset({"a": 1}, mailbox=box, learner_id="n", load=lambda v: iter(()), claim_ahead=bad)
    assert SharedQueueDataset({"a": 1}, mailbox=box, learner_id="n", load=lambda v: iter(())).claim_ahead == 0
    assert DEFAULT_CLAIM_AHEAD >= 1


# -- through shared_queue, with real DataLoader worker processes -------------------------------


def _loads(out: Path) -> Counter[str]:
    loads: Counter[str] = Counter()
    for names in read_lines(out, "loaded-*.txt").values():
        loads.update(names)
    return loads


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 1, 2])
def test_fast_loop_on_a_slow_store_gets_every_unit_once(tmp_path, workers):
    units = named_units(60, steps=2)
    mailbox = DelayedMailbox(LocalMailbox(tmp_path / "box"), 0.003)
    out = tmp_path / "out"
    out.mkdir()
    before = units_claimed_by("fast")
    seen = Counter()
    with shared_queue(
        units,
        mailbox=mailbox,
        learner_id="fast",
        load=RecordingLoad(str(out), "fast"),
        prefetch=4,
        workers=workers,
        multiprocessing_context="fork" if workers else None,
    ) as batches:
        last_step: dict[int, int] = {}
        for step, batch in batches:
            index = int(batch[0])
            assert last_step.get(index, -1) == step - 1, "a unit's steps arrive in order"
            last_step[index] = step
            seen[(index, step)] += 1
    assert set(seen) == {(i, s) for i in range(60) for s in range(2)} and max(seen.values()) == 1
    assert set(claimed(mailbox.inner)) == set(units)
    assert _loads(out) == Counter({name: 1 for name in units})
    assert units_claimed_by("fast") - before == 60


@pytest.mark.parametrize("workers", [0, 1])
def test_a_loop_that_stops_leaves_no_unit_claimed_and_unloaded(tmp_path, workers):
    # The loop takes one batch and leaves: it never ran dry twice in a row, so every unit this
    # node claimed was also loaded (into the buffer), as with claiming on demand.
    units = named_units(50)
    mailbox = LocalMailbox(tmp_path / "box")
    out = tmp_path / "out"
    out.mkdir()
    with shared_queue(
        units,
        mailbox=mailbox,
        learner_id="stops",
        load=RecordingLoad(str(out), "stops"),
        prefetch=4,
        workers=workers,
        multiprocessing_context="fork" if workers else None,
    ) as batches:
        next(batches)
    owned = [unit for unit, learner in claimed(mailbox).items() if learner == "stops"]
    assert sorted(owned) == sorted(_loads(out)), "a unit was claimed ahead by a loop that had stopped"


def test_claim_ahead_zero_is_on_demand(tmp_path):
    units = {name: item for name, item in named_units(8).items()}
    mailbox = LocalMailbox(tmp_path / "box")
    load = functools.partial(_one, tag=1)
    with shared_queue(
        units, mailbox=mailbox, learner_id="n", load=load, prefetch=2, workers=0, claim_ahead=0
    ) as batches:
        assert len([batch for batch in batches]) == 8


def _one(item: Item, tag: int):
    yield 0, torch.tensor([item.index, tag])


def failing_claim(box, unit: str) -> FaultyMailbox:
    """``box`` whose claim of ``unit`` fails with a store error (every other request passes)."""
    bad = f"{CLAIMS_PREFIX}{unit}"

    def fault(operation: str, key: str):
        if operation == "put_if_absent" and key == bad:
            return MailboxError("store unavailable", operation=operation, key=key, store="test")
        return None

    return FaultyMailbox(box, fault)
