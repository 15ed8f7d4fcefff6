"""Claim-ahead depth from measured times (``DepthGauge``): enough claims in flight to hide a
claim's latency behind loading, never more than ``limit`` nor ``TIED_S`` of this node's work."""

from __future__ import annotations

import math

import pytest
from test_claim_ahead import DryGauge, FixedTimes  # tests/helpers/ is on sys.path (tests/conftest.py)

from gradientmail.mailbox.wrappers import DelayedMailbox
from gradientmail.queue.claimer import TIED_S, ClaimAhead, Claimer, DepthGauge

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


def test_depth_reaches_the_measured_target_beyond_the_old_cap_of_four(memory_mailbox):
    order = ids(200)
    ahead = ClaimAhead(Claimer(memory_mailbox, order, "node-0"), limit=64, gauge=DryGauge())
    ahead.times = FixedTimes(claim_s=0.2, unit_s=0.005)  # a 100 ms store, 5 ms units
    for _ in range(3):  # the third is the second wait in a row while the loop starves
        ahead.next()
    assert ahead.depth == 41
    assert ahead.wait_in_flight() == 41
    ahead.close()


def test_depth_stays_within_the_tied_work_bound_and_shrinks_when_units_slow(memory_mailbox):
    order = ids(200)
    ahead = ClaimAhead(Claimer(memory_mailbox, order, "node-0"), limit=64, gauge=DryGauge())
    times = ahead.times = FixedTimes(claim_s=4 * TIED_S, unit_s=TIED_S / 20)  # wants 81 in flight
    for _ in range(3):
        ahead.next()
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
