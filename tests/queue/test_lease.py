"""A learner's lease as a fence: one beat per fold however many units it holds, and a peer that
judged it dead fences the lease before it takes a unit over.

Of an owner's beat (right before a fold of batches whose records are not written) and a taker's
fence exactly one lands: a beat first and the taker takes nothing; a fence first and the owner's
next beat, renewal or check raises ``LeaseLostError``, and its Session folds nothing more.
Deterministic: the takers' clocks are fake, and each race is set by a hook in the store.
"""

from __future__ import annotations

import json
import uuid
from collections import Counter
from collections.abc import Callable
from datetime import timedelta

import pytest
import torch

from gradientmail import LeaseLostError, Session, consensus
from gradientmail.errors import RecordError
from gradientmail.fold_gate import UnitMark
from gradientmail.layout import FRAGMENTS_PREFIX, claim_key, lease_key, pending_key
from gradientmail.mailbox.memory import MemoryMailbox
from gradientmail.mailbox.wrappers import CountingMailbox, MailboxWrapper
from gradientmail.patterns.shared_queue import shared_queue
from gradientmail.queue.claims import claim_body
from gradientmail.queue.elastic_options import ElasticOptions
from gradientmail.queue.progress import ProgressTracker
from gradientmail.queue.reclaim import ElasticClaimer
from gradientmail.records import LeaseRecord
from gradientmail.session.folded_units import close_slots
from gradientmail.session.mail import VoidSlotError, decode_pending
from gradientmail.verdict import EXPIRED, judge_lease

LEASE_S = 2.0


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _holding(box, learner: str, units: list[str], options: ElasticOptions) -> ProgressTracker:
    """A started tracker of ``learner`` whose Session has not folded a batch of each of ``units``
    yet (their claims exist, under token ``t-{unit}``): each fold must confirm ownership first."""
    tracker = ProgressTracker(box, learner, options)
    tracker.start()
    tracker.gate.attach(lambda: None, fragments=1)  # a Session: records wait for its folds
    for unit in units:
        box.put_if_absent(claim_key(unit), claim_body(learner, f"t-{unit}", incarnation=options.incarnation))
        index = tracker.gate.deliver(UnitMark(unit, f"t-{unit}", 0, 0))
        tracker.consumed(unit, f"t-{unit}", 0, 0, index)
    assert tracker.held == len(units)
    return tracker


def _confirm_requests(units: int) -> Counter:
    """The requests one ownership confirmation before a fold costs, holding ``units`` units."""
    box = CountingMailbox(MemoryMailbox(f"test-{uuid.uuid4().hex}"))
    tracker = _holding(box, "node-0", [f"u{i:03d}" for i in range(units)], ElasticOptions(False, 60.0))
    try:
        before = Counter(box.counts)
        tracker.gate.confirm_owner()  # what the Session calls right before such a fold's write
        return box.counts - before
    finally:
        tracker.close(release=False)


def test_confirming_ownership_before_a_fold_costs_the_same_for_one_unit_or_sixty_four():
    """Before: a read and a compare-and-swap of each held unit's claim (1,237 compare-and-swaps
    for 238 one-batch units, one after another before every fragment write: 0.24x the folds of
    a Session without a lease, 20 ms from its store). Now one beat of the learner's lease: a
    read, a compare-and-swap and its read-back (``mailbox.confirmed``)."""
    one, many = _confirm_requests(1), _confirm_requests(64)
    assert many == one, f"1 unit: {dict(one)}, 64 units: {dict(many)}"
    assert sum(one.values()) <= 3, dict(one)


class OwnerBeatsAfterTheRead(MailboxWrapper):
    """Once armed: right after the taker read the owner's lease (and judged it by that read),
    the owner beats, before the taker can act on it."""

    def __init__(self, inner, owner: str, beat: Callable[[], None]) -> None:
        super().__init__(inner)
        self.key, self.beat, self.armed = lease_key(owner), beat, False

    def _after_read(self, key: str, result):
        if self.armed and key == self.key:
            self.armed = False
            self.beat()
        return result

    def get(self, key: str, **bound):
        return self._after_read(key, self.inner.get(key, **bound))

    def get_versioned(self, key: str, **bound):
        return self._after_read(key, self.inner.get_versioned(key, **bound))


def test_an_owner_whose_beat_lands_before_the_fence_keeps_its_units(memory_mailbox):
    """A slow owner (its lease stood still a whole lease on the taker's clock) beats right
    before a fold after the taker read its lease: the taker's fence, a compare-and-swap on the
    version it judged, fails, and it takes nothing. Before: the owner marked its claims, but
    the taker had judged the claim by an earlier read and took the unit over all the same,
    while the owner's fold of its batches went ahead (those batches counted twice)."""
    box = memory_mailbox
    owner = _holding(box, "slow", ["a"], ElasticOptions(False, LEASE_S))
    try:
        clock = FakeClock()
        store = OwnerBeatsAfterTheRead(box, "slow", owner.gate.confirm_owner)
        taker = ElasticClaimer(
            store, ["a"], "node-1", ElasticOptions(False, LEASE_S), stopping=lambda: True, clock=clock
        )
        assert taker.claim_next() is None  # first sight of the lease and the claim
        clock.now += LEASE_S + 1  # both stood still longer than a lease on the taker's clock
        store.armed = True
        assert taker.claim_next() is None, "the owner's beat landed first: nothing may be taken"
        assert not store.armed, "the taker read the owner's lease"
        assert json.loads(box.get(claim_key("a")))["token"] == "t-a"
        lease = json.loads(box.get(lease_key("slow")))
        assert lease["state"] == "running" and "fenced_by" not in lease
        owner.gate.confirm_owner()  # the owner goes on: its lease is still its own
        owner.check_owner()
    finally:
        owner.close(release=False)


def test_a_taker_fences_a_lease_that_stood_still_before_taking_a_unit_over(memory_mailbox):
    """The fence lands first: the taker takes the unit over, and the owner's next beat (before a
    fold), renewal or check after a pause raises ``LeaseLostError`` naming the taker; its stop at
    exit leaves the fence in place."""
    box = memory_mailbox
    owner = _holding(box, "slow", ["a"], ElasticOptions(False, LEASE_S))
    try:
        clock = FakeClock()
        taker = ElasticClaimer(box, ["a"], "node-1", ElasticOptions(False, LEASE_S), stopping=lambda: True, clock=clock)
        assert taker.claim_next() is None
        clock.now += LEASE_S + 1
        got = taker.claim_next()
        assert got is not None and (got.identifier, got.taken_from) == ("a", "slow")
        lease = json.loads(box.get(lease_key("slow")))
        assert (lease["state"], lease["fenced_by"], lease["incarnation"]) == (
            "fenced",
            "node-1",
            owner.options.incarnation,
        )
        with pytest.raises(LeaseLostError, match="fenced by 'node-1'.*because its lease record lagged"):
            owner.gate.confirm_owner()
        assert owner.lease is not None and owner.lease.lost
        with pytest.raises(LeaseLostError, match="fenced by 'node-1'"):
            owner.lease.write("running", 1)  # a renewal: the same error, no request
    finally:
        owner.close(release=False)
    assert json.loads(box.get(lease_key("slow")))["state"] == "fenced", "the stop overwrote the fence"


def test_a_paused_owner_finds_its_lease_fenced_with_one_read(memory_mailbox):
    box = CountingMailbox(memory_mailbox)
    owner = _holding(box, "slow", ["a", "b", "c"], ElasticOptions(False, LEASE_S))
    try:
        owner.check_owner(1.5)  # still its own
        clock = FakeClock()
        taker = ElasticClaimer(box, ["a"], "node-1", ElasticOptions(False, LEASE_S), stopping=lambda: True, clock=clock)
        taker.claim_next()
        clock.now += LEASE_S + 1
        assert taker.claim_next() is not None
        before = Counter(box.counts)
        with pytest.raises(LeaseLostError, match="fenced by 'node-1'.*while this process stood still for 3.0 s"):
            owner.check_owner(3.0)
        assert box.counts - before == Counter(get_versioned=1)
    finally:
        owner.close(release=False)


def test_a_fresh_takeover_is_not_fenced_before_its_claim_stood_still(memory_mailbox):
    """A node that waited longer than a lease (nothing to consume: no renewals) and has just
    taken a unit over renews only once it consumes from it: a peer leaves its lease alone until
    the claim itself stood still a whole lease (the claim's token is all it needs to see)."""
    box = memory_mailbox
    clock = FakeClock()
    box.put(
        lease_key("idle"), json.dumps({"learner": "idle", "incarnation": "i", "beat": 1, "state": "running"}).encode()
    )
    peer = ElasticClaimer(box, ["a"], "node-9", ElasticOptions(False, 1.0), clock=clock)
    assert not peer.takeable("a", {"learner": "idle", "token": "t0", "incarnation": "i"}, {})
    clock.now += 5  # the lease stood still for long, and "idle" takes "a" over now
    assert not peer.takeable("a", {"learner": "idle", "token": "t1", "incarnation": "i"}, {})
    assert json.loads(box.get(lease_key("idle")))["state"] == "running", "fenced a node that just took a unit"


def test_a_restarted_learner_replaces_its_fenced_lease(memory_mailbox):
    """The next incarnation under the same learner id writes its lease over the fence of the
    earlier one; peers take the earlier incarnation's units at once (another incarnation)."""
    box = memory_mailbox
    first = ProgressTracker(box, "node-0", ElasticOptions(False, LEASE_S))
    first.start()
    data, version = box.get_versioned(lease_key("node-0"))
    fenced = json.loads(data) | {"state": "fenced", "fenced_by": "node-1"}
    assert box.replace_if(lease_key("node-0"), json.dumps(fenced).encode(), version)
    first.close(release=False)
    again = ProgressTracker(box, "node-0", ElasticOptions(False, LEASE_S))
    again.start()
    try:
        lease = json.loads(box.get(lease_key("node-0")))
        assert (lease["state"], lease["incarnation"]) == ("running", again.options.incarnation)
        old_claim = {"learner": "node-0", "token": "t", "incarnation": first.options.incarnation}
        assert ElasticClaimer(box, ["a"], "node-1", ElasticOptions(False, LEASE_S)).takeable("a", old_claim, {})
    finally:
        again.close(release=False)


def test_a_fence_is_a_record_read_like_any_other():
    fence = {"learner": "slow", "incarnation": "i", "state": "fenced", "fenced_by": "node-1", "fenced_at": 1.7e9}
    record = LeaseRecord.from_bytes(json.dumps(fence).encode())
    assert (record.state, record.fenced_by) == ("fenced", "node-1")
    assert judge_lease(record, LEASE_S, unchanged_s=lambda: 0.0, incarnation="i") == EXPIRED
    with pytest.raises(RecordError, match="'fenced_by' '../x' is not one mailbox key segment"):
        LeaseRecord.from_bytes(json.dumps(fence | {"fenced_by": "../x"}).encode(), "leases/slow.json")


def test_status_shows_a_fenced_lease_as_expired_and_its_units_orphaned(memory_mailbox):
    from gradientmail.status import read_run

    box = memory_mailbox
    box.put_if_absent(claim_key("a"), claim_body("slow", "t-a", incarnation="i", state="active"))
    fenced = {"learner": "slow", "incarnation": "i", "beat": 3, "lease_s": 600.0, "state": "fenced"}
    box.put(lease_key("slow"), json.dumps(fenced | {"fenced_by": "node-1", "time": __import__("time").time()}).encode())
    run = read_run(box)
    assert run.orphaned == ["a"] and run.learner("slow").lease == "expired"


# -- the Session -----------------------------------------------------------------------------
def _load(identifier: str):
    for step in range(3):
        yield step, torch.tensor([float(step)])


def test_a_fenced_owner_s_session_folds_nothing_more(memory_mailbox):
    """The documented loop: once a peer fenced the learner's lease, the Session's next fold (it
    holds batches whose records are not written) raises ``LeaseLostError`` before it writes:
    no fragment version or pending contribution is added, and the units go to the taker."""
    box = memory_mailbox
    model = torch.nn.Linear(1, 1)
    session = Session(model, mailbox=box, learner_id="node-0", every=None, every_steps=2, fragments=1)
    units = {"a": "a", "b": "b"}
    with pytest.raises(LeaseLostError, match="fenced by 'node-1'"):
        with (
            session,
            shared_queue(
                units, mailbox=box, learner_id="node-0", load=_load, workers=0, lease=timedelta(minutes=5)
            ) as batches,
        ):
            for count, _ in enumerate(batches, start=1):
                session.step(samples=1)
                if count == 2:  # an exchange started at step 2: its fold lands
                    session.wait()
                    versions = _versions(box)
                    clock = FakeClock()
                    taker = ElasticClaimer(box, list(units), "node-1", ElasticOptions(False, 300.0), clock=clock)
                    taker.takeable("a", json.loads(box.get(claim_key("a"))), {})  # first sight
                    clock.now += 301
                    assert taker.takeable("a", json.loads(box.get(claim_key("a"))), {})  # fenced now
                if count == 4:  # the next exchange: its fold holds batches 3-4, not recorded
                    session.wait()
    assert _versions(box) == versions, "a fenced learner folded"
    closed = [key for key in box.list(FRAGMENTS_PREFIX) if "/pending/" in key]
    assert closed == [pending_key(0, "node-0", 1)]  # the taker closed its next slot: no contribution there
    with pytest.raises(VoidSlotError, match="closed by 'node-1'"):
        decode_pending(box.get(closed[0]), key=closed[0], spec=None)


def _versions(box) -> list[str]:
    return sorted(key for key in box.list(FRAGMENTS_PREFIX) if "/versions/" in key)
    assert json.loads(box.get(lease_key("node-0")))["fenced_by"] == "node-1"


class LateFold(MailboxWrapper):
    """The owner's store: its next create of a fragment version loses to another writer, and
    right before its pending contribution is sent (its beat just landed), ``peer()`` runs: the
    owner stands still there (frozen) while a peer fences its lease and takes its unit over."""

    def __init__(self, inner, peer: Callable[[], None]) -> None:
        super().__init__(inner)
        self.peer, self.armed = peer, False

    def put_if_absent(self, key: str, data: bytes) -> bool:
        if self.armed and "/versions/" in key:
            return False  # another writer created this version first
        if self.armed and "/pending/" in key:
            self.armed = False
            self.peer()
        return self.inner.put_if_absent(key, data)


def test_a_fold_written_after_the_fence_finds_its_slot_closed(memory_mailbox):
    """The owner beats right before its write, then stands still (frozen) before the write is
    sent, for longer than a lease: a peer fences its lease, closes its next pending slot in
    every fragment, reads what the run holds of its unit and trains the rest. The late write
    finds the slot taken: nothing of it reaches the run, and the owner stops with
    ``LeaseLostError``. Before: the late contribution landed after the peer's read, and the
    batches it held were in the run twice (`benchmarks.faults` freeze trials, SeaweedFS)."""
    box = memory_mailbox
    taken = []

    def peer() -> None:  # a node that watched the owner's lease stand still a whole lease
        clock = FakeClock()
        taker = ElasticClaimer(box, ["a"], "node-1", ElasticOptions(False, 60.0), stopping=lambda: True, clock=clock)
        assert taker.claim_next() is None  # first sight of the lease just beaten, and of the claim
        clock.now += 61
        taken.append(taker.claim_next())

    store = LateFold(box, peer)
    model = torch.nn.Linear(1, 1)
    session = Session(model, mailbox=store, learner_id="node-0", every=None, every_steps=2, fragments=1)
    units = {"a": "a"}
    with pytest.raises(LeaseLostError, match="fenced by 'node-1'"):
        with (
            session,
            shared_queue(units, mailbox=store, learner_id="node-0", load=_six, workers=0, lease=60.0) as batches,
        ):
            for count, _ in enumerate(batches, start=1):
                with torch.no_grad():
                    model.bias.add_(1.0)  # each batch adds one sample's worth
                session.step(samples=1)
                if count == 2:
                    session.wait()  # batches 1-2 are in the run
                    batches.tracker.flush()
                    store.armed = True  # the fold of batches 3-4 is the late one
                if count == 4:
                    session.wait()
    assert taken and taken[0] is not None and (taken[0].identifier, taken[0].position) == ("a", 1)
    assert consensus(box, torch.nn.Linear(1, 1)) == {"node-0": 2}, "the late fold reached the run"


def _six(identifier: str):
    for step in range(6):
        yield step, torch.tensor([float(step)])


class ClosedAtTheWrite(MailboxWrapper):
    """A restarted learner's store: its next create loses to another writer, and a peer closes
    the learner's next slot (judging its earlier incarnation dead) right before its pending write."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.armed = False

    def put_if_absent(self, key: str, data: bytes) -> bool:
        if self.armed and "/versions/" in key:
            return False
        if self.armed and "/pending/" in key:
            self.armed = False
            assert close_slots(self.inner, "node-0", "node-1") == 1
        return self.inner.put_if_absent(key, data)


def test_a_restart_whose_slot_a_peer_closed_takes_the_next_one(memory_mailbox):
    """A learner restarted under the same id reads the run's state, then a peer closes the next
    slot of its (earlier, fenced) incarnation: its own fold takes the slot after, and the run
    counts its samples once."""
    box = memory_mailbox
    with Session(torch.nn.Linear(1, 1), mailbox=box, learner_id="node-0", every=None, every_steps=1) as first:
        first.step(samples=1)
        first.wait()  # seq 0 of node-0 in the run
    store = ClosedAtTheWrite(box)
    again = Session(torch.nn.Linear(1, 1), mailbox=store, learner_id="node-0", every=None, every_steps=1)
    with again:
        store.armed = True
        again.step(samples=1)
        again.wait()  # slot 1 closed under it: left pending at slot 2
        again.step(samples=1)
        again.wait()  # and on to slot 3
    assert [key.rsplit("/", 1)[1] for key in box.list(FRAGMENTS_PREFIX) if "/pending/" in key] == []
    assert consensus(box, torch.nn.Linear(1, 1)) == {"node-0": 3}
