"""Claimers that lose the same race part instead of racing again for the same next unit.

The races are staged, not timed: each round every claimer picks (listing first as its policy
says) before any of them creates, as when nodes list at the same moment on a real store.
"""

from __future__ import annotations

import random

import pytest

from gradientmail import MemoryMailbox
from gradientmail.queue.claimer import Claimer
from gradientmail.queue.crowd import CROWD_LIMIT, SHARED_CROWD_LIMIT, SPREAD
from gradientmail.queue.units import unit_grid
from gradientmail.sim.queue import simulate


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


@pytest.mark.parametrize("claimers", [2, 4])
def test_claimers_walking_one_order_in_lockstep_jump_apart(box, claimers):
    # Every node without an order of its own walks the mapping's: whoever is behind catches up
    # with whoever is ahead, and in lockstep they race for every next unit. At the shared
    # order's crowd limit they jump apart and list about once per stretch instead.
    order = [f"u{i:05d}" for i in range(3000)]
    figures = {}
    for limit in (CROWD_LIMIT, SHARED_CROWD_LIMIT):
        box.clear()
        racing = [Claimer(box, order, f"node-{rank}", crowd_limit=limit) for rank in range(claimers)]
        won = lockstep(racing)
        assert sorted(won) == order, "every unit once"
        figures[limit] = {key: sum(c.stats[key] for c in racing) / len(order) for key in ("conflicts", "listings")}
    assert figures[CROWD_LIMIT]["conflicts"] > 0.3 and figures[CROWD_LIMIT]["listings"] >= 1.0
    assert figures[SHARED_CROWD_LIMIT]["conflicts"] < 0.1 and figures[SHARED_CROWD_LIMIT]["listings"] < 0.5


def test_nodes_without_an_order_use_the_shared_orders_crowd_limit():
    # The simulator runs the same datasets: nodes given orders (even the mapping's) keep
    # CROWD_LIMIT, as SharedQueueDataset(order=...) does; order=None uses SHARED_CROWD_LIMIT.
    units = unit_grid(steps=2000, unit_steps=1, lanes=2)
    shared = simulate(units, [1.0, 1.0], jitter=0.2)
    given = simulate(units, [1.0, 1.0], orders=[list(units)] * 2, jitter=0.2)
    assert shared.claims == given.claims == len(units)
    assert shared.claim_stats["listings"] < 0.8 * given.claim_stats["listings"]  # 1,404 vs 1,900


@pytest.mark.parametrize("bad", [0, 0.0, 1.5, -0.1, True, "0.5"])
def test_a_crowd_limit_out_of_range_is_refused(box, bad):
    with pytest.raises(ValueError, match="crowd_limit must be a share in"):
        Claimer(box, ["a"], "node-0", crowd_limit=bad)
