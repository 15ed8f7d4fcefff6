"""A store that tells two conditional writers they both won: the guarded operation counts a lost race.

SeaweedFS can answer two racing conditional writes of one key with success when they take
different paths through the server (docs/mailboxes.md): the key then holds the body of the one
that landed last. ``DoubleWin`` fakes exactly that: it tells the caller its write won, then
stores a rival writer's body over it. Every write that guards exactly-once (a lease's beat and
fence, a presence record, a unit's release, a closed contribution slot) must read the key back
and count the rival's body as a lost race, as it would a refused write.
"""

from __future__ import annotations

import json
import time

import pytest
import torch

from gradientmail import DuplicateLearnerError, LeaseLostError, Session, consensus
from gradientmail.layout import FRAGMENTS_PREFIX, claim_key, learner_key, lease_key, parse_pending_key, work_key
from gradientmail.mailbox.confirmed import create_confirmed, holds, replace_confirmed
from gradientmail.mailbox.wrappers import MailboxWrapper
from gradientmail.presence import Presence
from gradientmail.queue.elastic_options import ElasticOptions
from gradientmail.queue.lease import OwnLease, fence
from gradientmail.queue.progress import ProgressTracker
from gradientmail.records import FENCED, RELEASED, RUNNING, ClaimRecord, LeaseRecord, PresenceRecord, WorkRecord
from gradientmail.session.folded_units import close_slots
from gradientmail.session.mail import ClosedSlot


class DoubleWin(MailboxWrapper):
    """Conditional writes of an armed key report success, and a rival's body lands right after."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.rivals: dict[str, bytes] = {}

    def put_if_absent(self, key: str, data: bytes) -> bool:
        won = self.inner.put_if_absent(key, data)
        return self._rival_lands(key) or won

    def replace_if(self, key: str, data: bytes, version: str) -> bool:
        won = self.inner.replace_if(key, data, version)
        return self._rival_lands(key) or won

    def _rival_lands(self, key: str) -> bool:
        armed = next((prefix for prefix in self.rivals if key.startswith(prefix)), None)
        if armed is None:
            return False
        self.inner.put(key, self.rivals.pop(armed))
        return True


@pytest.fixture
def box(memory_mailbox) -> DoubleWin:
    return DoubleWin(memory_mailbox)


def test_the_read_back_is_bounded_by_the_body(memory_mailbox):
    memory_mailbox.put("k", b"x" * 10_000)
    assert not holds(memory_mailbox, "k", b"x")  # refused after one byte more, not read whole
    assert not create_confirmed(memory_mailbox, "k", b"mine")
    version = memory_mailbox.get_versioned("k")[1]
    assert replace_confirmed(memory_mailbox, "k", b"mine", version) and holds(memory_mailbox, "k", b"mine")


def test_a_beat_whose_fence_landed_instead_loses_the_lease(box):
    lease = OwnLease(box, "owner", "inc-1", 30.0)
    lease.write(RUNNING, 0)
    seen = LeaseRecord.from_bytes(box.get(lease_key("owner")))
    box.rivals[lease_key("owner")] = seen.replace(state=FENCED, fenced_by="taker", fenced_at=time.time()).to_bytes()
    with pytest.raises(LeaseLostError, match="taker"):
        lease.write(RUNNING, 1)  # not "written": the owner would go on folding
    assert lease.lost


def test_a_fence_whose_owner_beat_landed_instead_takes_nothing(box):
    owner = OwnLease(box, "owner", "inc-1", 30.0)
    owner.write(RUNNING, 0)
    seen = box.get_versioned(lease_key("owner"))
    beat = LeaseRecord.new("owner", "inc-1", 2, 1, 30.0, RUNNING).to_bytes()
    box.rivals[lease_key("owner")] = beat
    assert fence(box, "owner", seen, "taker", 30.0, "inc-1") is False  # not True: two learners would train the unit
    assert LeaseRecord.from_bytes(box.get(lease_key("owner"))).state == RUNNING  # the beat stands


def test_a_presence_whose_rival_registered_instead_is_a_duplicate(box):
    rival = PresenceRecord.new(
        "node-0", "other", RUNNING, 1, 10.0, {"host": "another-host"}, pid=1, pid_start=None
    ).to_bytes()
    box.rivals[learner_key("node-0")] = rival
    clock, beats = [0.0], [1]

    def sleep(seconds: float) -> None:  # the rival renews its record while this one watches it
        clock[0] += seconds
        beats[0] += 1
        renewed = PresenceRecord.new(
            "node-0", "other", RUNNING, beats[0], 10.0, {"host": "another-host"}, pid=1, pid_start=None
        )
        box.inner.put(learner_key("node-0"), renewed.to_bytes())

    presence = Presence(box, "node-0", "mine", renew_s=10.0, clock=lambda: clock[0], sleep=sleep)
    with pytest.raises(DuplicateLearnerError):
        presence.start()  # else both processes would run under one learner id
    assert PresenceRecord.from_bytes(box.get(learner_key("node-0"))).incarnation == "other"


def test_a_release_whose_takeover_landed_instead_releases_nothing(box):
    options = ElasticOptions(resume=True, lease_s=None)
    box.put(work_key("me", "u"), WorkRecord.new("me", "t", options.incarnation, 3, position=3).to_bytes())
    box.put_if_absent(claim_key("u"), json.dumps({"learner": "me", "token": "t", "state": "active"}).encode())
    taken = json.dumps({"learner": "taker", "token": "t2", "state": "active", "taken_from": "me"}).encode()
    box.rivals[claim_key("u")] = taken
    assert ProgressTracker(box, "me", options).release() == 0  # not 1: the unit was taken, not handed back
    claim = ClaimRecord.from_bytes(box.get(claim_key("u")))
    assert claim.learner == "taker" and claim.state != RELEASED


class ClosedOverTheWrite(MailboxWrapper):
    """A restarted learner's store: its next create loses to another writer, and its pending
    write is told it won while a peer's closure of that slot lands over it."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.armed = False

    def put_if_absent(self, key: str, data: bytes) -> bool:
        if self.armed and "/versions/" in key:
            return False
        if self.armed and "/pending/" in key:
            self.armed = False
            won = self.inner.put_if_absent(key, data)
            learner, seq = parse_pending_key(key)
            self.inner.put(key, ClosedSlot(learner, seq, "node-1").to_bytes())
            return won
        return self.inner.put_if_absent(key, data)


def test_a_contribution_whose_slot_closure_landed_instead_takes_the_next_slot(memory_mailbox):
    """Each step adds 1 to the bias. Before: the learner took its contribution for written, the
    closure held the slot, and the run lost that step's change silently (bias 2 of 3)."""
    box = memory_mailbox

    def train(session: Session, model: torch.nn.Module) -> None:
        with torch.no_grad():
            model.bias.add_(1.0)
        session.step(samples=1)
        session.wait()

    first_model = torch.nn.Linear(1, 1)
    with torch.no_grad():
        first_model.bias.zero_()
    with Session(first_model, mailbox=box, learner_id="node-0", every=None, every_steps=1) as first:
        train(first, first_model)  # seq 0 of node-0 in the run
    store = ClosedOverTheWrite(box)
    model = torch.nn.Linear(1, 1)
    consensus(box, model)
    with Session(model, mailbox=store, learner_id="node-0", every=None, every_steps=1) as again:
        store.armed = True
        train(again, model)  # slot 1 closed over it: left pending at slot 2
        train(again, model)
    merged = torch.nn.Linear(1, 1)
    assert consensus(box, merged) == {"node-0": 3}
    assert merged.bias.item() == pytest.approx(3.0)


def test_a_slot_closure_whose_contribution_landed_instead_closes_nothing(memory_mailbox):
    box = DoubleWin(memory_mailbox)
    with Session(torch.nn.Linear(1, 1), mailbox=box, learner_id="node-0", every=None, every_steps=1) as first:
        first.step(samples=1)
        first.wait()
    box.rivals[FRAGMENTS_PREFIX] = b"the learner's late contribution"  # over the slot being closed
    assert close_slots(box, "node-0", "node-1") == 0  # not 1: the slot holds a contribution, it was not closed


class AbsorbedAtOnce(MailboxWrapper):
    """A learner's version create loses the race, and a peer's fold absorbs (reads and deletes)
    the contribution it then leaves pending before its read-back can see it."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.armed = False
        self.absorbed: list[str] = []

    def put_if_absent(self, key: str, data: bytes) -> bool:
        if self.armed and "/versions/" in key:
            return False
        won = self.inner.put_if_absent(key, data)
        if self.armed and "/pending/" in key and won:
            self.armed = False
            self.inner.delete(key)
            self.absorbed.append(key)
        return won


def test_a_pending_contribution_absorbed_before_its_read_back_is_no_duplicate_learner(memory_mailbox):
    """A missing pending slot after a won create was absorbed by a peer's fold: the contribution
    is in the run. Before: the read-back found nothing and the learner stopped with "two
    processes run under one learner id" (a busy run's folds absorb pending slots at once)."""
    store = AbsorbedAtOnce(memory_mailbox)
    model = torch.nn.Linear(1, 1)
    with Session(model, mailbox=store, learner_id="node-0", every=None, every_steps=1) as session:
        session.step(samples=1)
        session.wait()
        store.armed = True
        session.step(samples=1)
        session.wait()
    assert len(store.absorbed) == 1
