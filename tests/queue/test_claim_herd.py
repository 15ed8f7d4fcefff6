"""Claimers that lose the same race part instead of racing again for the same next unit.

The races are staged, not timed: each round every claimer picks (listing first as its policy
says) before any of them creates, as when nodes list at the same moment on a real store.
"""

from __future__ import annotations

import random

import pytest

from gradientmail import MemoryMailbox
from gradientmail.queue.claimer import SPREAD, Claimer


@pytest.fixture
def box():
    mailbox = MemoryMailbox(f"herd-{random.getrandbits(64):x}")
    yield mailbox
    mailbox.clear()


def lockstep(claimers: list[Claimer]) -> list[str]:
    """Rounds of pick-all, then attempt-and-settle-all, until no claimer has a candidate."""
    won: list[str] = []
    while True:
        picks = [(claimer, claimer.pick()) for claimer in claimers]
        picks = [(claimer, pick) for claimer, pick in picks if pick is not None]
        if not picks:
            return won
        for claimer, pick in picks:
            identifier = claimer.settle(pick, claimer.attempt(pick))
            if identifier is not None:
                won.append(identifier)


def test_claimers_that_lost_together_part(box):
    identifiers = [f"{i:04d}" for i in range(400)]
    claimers = [Claimer(box, identifiers, f"node-{rank}") for rank in range(8)]
    won = lockstep(claimers)
    assert sorted(won) == identifiers, "every unit claimed exactly once"
    conflicts = sum(claimer.stats["conflicts"] for claimer in claimers)
    # Racing again for the first free unit, 7 of the 8 would lose every round (7 per claim);
    # parted, the losers mostly win their next create (0.8 per claim here, in lockstep).
    assert conflicts / len(won) < 2


def test_after_a_loss_a_claimer_stays_near_its_order(box):
    identifiers = [f"{i:04d}" for i in range(300)]
    claimers = [Claimer(box, identifiers, f"node-{rank}") for rank in range(4)]
    picks = [claimer.pick() for claimer in claimers]  # all four want unit 0000
    assert {pick.identifier for pick in picks if pick is not None} == {"0000"}
    outcomes = [claimer.attempt(pick) for claimer, pick in zip(claimers, picks, strict=True)]
    assert outcomes.count(True) == 1
    for claimer, pick, won in zip(claimers, picks, outcomes, strict=True):
        claimer.settle(pick, won)
    losers = [claimer for claimer, won in zip(claimers, outcomes, strict=True) if not won]
    chosen = [claimer.pick() for claimer in losers]
    positions = [int(pick.identifier) for pick in chosen if pick is not None]
    assert len(positions) == 3 and all(1 <= position <= SPREAD for position in positions)
    assert len(set(positions)) > 1, "losers of one race do not all create the same unit next"


def test_spreading_is_deterministic(box):
    identifiers = [f"{i:04d}" for i in range(200)]
    first = lockstep([Claimer(box, identifiers, f"node-{rank}") for rank in range(6)])
    box.clear()
    second = lockstep([Claimer(box, identifiers, f"node-{rank}") for rank in range(6)])
    assert first == second
