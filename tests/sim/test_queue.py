"""The queue simulator on the documented example's schedule: the makespan and units per node
that a real run gets."""

from __future__ import annotations

import pytest

from gradientmail import unit_grid
from gradientmail.queue.crowd import STRETCH
from gradientmail.sim.queue import fixed_split_makespan, simulate

pytestmark = pytest.mark.timeout(60)


ORDER_SHAPES = [None, {}, {"block": 1, "lag": 0}, {"block": 8, "lag": 1}, {"block": 2, "lag": 3}]


@pytest.mark.parametrize("shape", ORDER_SHAPES)
def test_documented_schedule(shape):
    """Greedy claiming of equal units: the preference order changes which units, not how many."""
    units = unit_grid(steps=6, unit_steps=1, lanes=4)
    result = simulate(units, unit_times=[1, 2, 2, 4], rotate_lanes=None if shape is None else 4, **(shape or {}))
    assert result.makespan == 12
    assert result.units_by_learner == {"node-0": 11, "node-1": 5, "node-2": 5, "node-3": 3}
    assert fixed_split_makespan(len(units), [1, 2, 2, 4]) == 24


@pytest.mark.parametrize("shape", ORDER_SHAPES)
def test_simulated_units_of_several_batches(shape):
    units = unit_grid(steps=24, unit_steps=4, lanes=4)  # the same 24 units, 4 batches each
    result = simulate(units, unit_times=[1, 2, 2, 4], rotate_lanes=None if shape is None else 4, **(shape or {}))
    assert result.makespan == pytest.approx(12)
    assert sorted(result.units_by_learner.values()) == [3, 5, 5, 11]


@pytest.mark.slow
def test_step_spread_grows_with_the_stretches_nodes_keep_to_themselves():
    units = unit_grid(400, 1, 8)
    speeds = [1, 2, 2, 4] * 2
    plain = simulate(units, speeds, rotate_lanes=8, block=1, lag=0, jitter=0.2)
    default = simulate(units, speeds, rotate_lanes=8, jitter=0.2)
    longer = simulate(units, speeds, rotate_lanes=8, block=8, lag=1, jitter=0.2)
    assert default.step_spread <= 12 < longer.step_spread <= 22  # 17 before NEAR_WALK, 21 after
    assert longer.requests_per_claim < default.requests_per_claim < plain.requests_per_claim
    # Competing for the same next units, nodes jump ahead in stretches: they drift apart too.
    assert plain.claim_stats["jumps"] > 0
    assert plain.step_spread <= 2 * STRETCH
