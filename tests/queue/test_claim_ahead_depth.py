"""Claim-ahead depth from measured times (``DepthGauge``): enough claims in flight to hide a
claim's latency behind loading, never more than ``limit`` nor ``TIED_S`` of this node's work."""

from __future__ import annotations

import math

import pytest
from test_claim_ahead import DryGauge, FixedTimes, SlowStoreClock  # tests/helpers/ is on sys.path (tests/conftest.py)

from gradientmail.mailbox.wrappers import DelayedMailbox
from gradientmail.queue.claim_ahead import (
    CLIMB_GAIN,
    CLIMB_S,
    CLIMB_UNITS,
    HOLD_S,
    TIED_S,
    ClaimAhead,
    DepthClimb,
    DepthGauge,
)
from gradientmail.queue.claimer import Claimer

pytestmark = pytest.mark.timeout(90)


def ids(count: int) -> list[str]:
    return [f"u{i:04d}" for i in range(count)]


def test_gauge_target_hides_one_claim_behind_the_units_in_flight():
    gauge = DepthGauge()
    assert gauge.target() == 0  # nothing measured: no opinion
    gauge.claimed(0.2)
    gauge.loaded(0.005)
    assert gauge.target() == math.ceil(0.2 / 0.005) + 1 == 41


def test_gauge_smooths_one_outlier():
    gauge = DepthGauge(smoothing=0.2)
    for _ in range(10):
        gauge.claimed(0.1)
    gauge.claimed(1.1)  # one slow request
    assert gauge.claim_s == pytest.approx(0.3)


def test_gauge_bound_ties_at_most_tied_s_of_work_and_at_most_limit():
    gauge = DepthGauge()
    assert gauge.bound(64) == 64  # unit time unknown: the cap alone
    gauge.loaded(0.05)
    assert gauge.bound(64) == int(TIED_S / 0.05)
    assert gauge.bound(3) == 3
    gauge.loaded(100.0)  # units slower than TIED_S: still one ahead
    assert gauge.bound(64) == 1


def test_a_starving_loop_tries_a_quarter_more_claims_in_flight_or_the_target():
    gauge = FixedTimes(claim_s=0.01, unit_s=0.001)  # target 11
    assert gauge.deeper(0, limit=64) == 11
    assert gauge.deeper(11, limit=64) == 13  # 11 // CLIMB_STEP more
    assert gauge.deeper(40, limit=64) == 50
    assert gauge.deeper(60, limit=64) == 64
    assert gauge.deeper(2, limit=64) == 11
    gauge.claim_s = 0.0  # a store with no latency: the target asks for one
    assert gauge.deeper(0, limit=64) == 1


def test_depth_reaches_the_measured_target_beyond_the_old_cap_of_four(memory_mailbox):
    order = ids(200)
    clock = SlowStoreClock()
    ahead = ClaimAhead(Claimer(memory_mailbox, order, "node-0"), limit=64, gauge=DryGauge(), clock=clock)
    ahead.times = FixedTimes(claim_s=0.2, unit_s=0.005)  # a 100 ms store, 5 ms units
    for _ in range(3):  # the third is the second wait in a row while the loop starves
        clock.take(ahead)
    assert ahead.depth == 41
    assert ahead.wait_in_flight() == 41
    ahead.close()


def test_depth_stays_within_the_tied_work_bound_and_shrinks_when_units_slow(memory_mailbox):
    order = ids(200)
    clock = SlowStoreClock()
    ahead = ClaimAhead(Claimer(memory_mailbox, order, "node-0"), limit=64, gauge=DryGauge(), clock=clock)
    times = ahead.times = FixedTimes(claim_s=4 * TIED_S, unit_s=TIED_S / 20)  # wants 81 in flight
    for _ in range(3):
        clock.take(ahead)
    assert times.target() == 81 and ahead.depth == 20
    times.unit_s = TIED_S / 4  # the loop slowed down: the same units tie five times the work
    ahead.next()
    assert ahead.depth == 4
    for _ in range(25):  # claims already in flight are handed out, none is started beyond 4
        ahead.next()
    assert ahead.wait_in_flight() <= 4
    ahead.close()


def test_measures_the_claims_it_makes(memory_mailbox):
    slow = DelayedMailbox(memory_mailbox, 0.003)
    ahead = ClaimAhead(Claimer(slow, ids(10), "node-0"), limit=4)
    for _ in range(3):
        ahead.next()
    ahead.close()
    # A claim is at least a create and a read-back, each sleeping 3 ms (sleep never returns early).
    assert ahead.times.claim_s is not None and ahead.times.claim_s >= 0.006
    assert ahead.times.unit_s is not None


# -- DepthClimb: a deeper depth stays only if units come faster --------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def hand_out(climb: DepthClimb, clock: Clock, handed: int, depth: int, units: int, unit_s: float) -> tuple[int, int]:
    """``units`` more units handed out ``unit_s`` apart: (units handed, depth kept)."""
    for _ in range(units):
        clock.now += unit_s
        handed += 1
        depth = climb.handed(handed, depth)
    return handed, depth


def test_climb_waits_until_the_current_depth_is_measured():
    clock = Clock()
    climb = DepthClimb(clock)
    handed, depth = hand_out(climb, clock, 0, 0, 2, unit_s=CLIMB_S / 4)
    assert climb.deeper(handed, depth, wanted=4) == 0, "half of CLIMB_S at depth 0 is not a rate yet"
    handed, depth = hand_out(climb, clock, handed, depth, 4, unit_s=CLIMB_S / 4)
    assert climb.deeper(handed, depth, wanted=4) == 4 and climb.trying


def test_climb_keeps_a_depth_that_hands_units_out_faster():
    clock = Clock()
    climb = DepthClimb(clock)
    handed, depth = hand_out(climb, clock, 0, 0, 5, unit_s=0.2)  # 5 units/s on demand
    depth = climb.deeper(handed, depth, wanted=10)
    handed, depth = hand_out(climb, clock, handed, depth, 10 + max(CLIMB_UNITS, 10), unit_s=0.02)  # 50 units/s
    assert depth == 10 and not climb.trying
    assert climb.deeper(handed, depth, wanted=11) == 11, "kept: the next step is tried at once"


def test_climb_goes_back_from_a_depth_that_does_not_pay_and_holds_it():
    clock = Clock()
    climb = DepthClimb(clock)
    unit_s = 0.01  # a store with no latency: claims cost CPU, deeper is no faster
    handed, depth = hand_out(climb, clock, 0, 0, 20, unit_s)
    depth = climb.deeper(handed, depth, wanted=6)
    assert depth == 6
    handed, depth = hand_out(climb, clock, handed, depth, 6 + CLIMB_UNITS, unit_s / (1 + CLIMB_GAIN / 2))
    assert (depth, climb.trying) == (6, True), "a trial lasts at least CLIMB_S"
    handed, depth = hand_out(climb, clock, handed, depth, 10, unit_s / (1 + CLIMB_GAIN / 2))
    assert depth == 0 and not climb.trying, "a gain under CLIMB_GAIN is not kept"
    handed, depth = hand_out(climb, clock, handed, depth, 20, unit_s)
    assert climb.deeper(handed, depth, wanted=6) == 0, "held while HOLD_S lasts"
    clock.now += HOLD_S
    assert climb.deeper(handed, depth, wanted=6) == 6, "tried again once HOLD_S passed"


def test_claim_ahead_on_a_store_where_depth_does_not_pay_goes_back_to_claiming_on_demand(memory_mailbox):
    order = ids(400)
    clock = Clock()
    ahead = ClaimAhead(Claimer(memory_mailbox, order, "node-0"), limit=64, gauge=DryGauge(), clock=clock)
    ahead.times = FixedTimes(claim_s=0.01, unit_s=0.002)  # the gauge wants 6 in flight
    handed = []
    went_deeper = False
    while (identifier := ahead.next()) is not None:
        handed.append(identifier)
        went_deeper |= ahead.depth > 0
        clock.now += 0.005  # a unit every 5 ms, however deep the claims run
    ahead.close()
    assert went_deeper, "the gauge's depth was tried"
    assert ahead.depth == 0, "and given up: units did not come faster"
    assert sorted(handed) == order, "the claims made ahead were handed out, none lost or repeated"
