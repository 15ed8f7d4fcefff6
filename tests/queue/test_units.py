"""Work units and orders: unit_grid, rotated_order, Unit."""

from __future__ import annotations

import itertools

import pytest

from gradientmail import Unit, rotated_order, unit_grid

pytestmark = pytest.mark.timeout(60)


def test_unit_grid_is_the_design_notes_mapping():
    steps, unit_steps, nodes = 4000, 20, 4
    design_note = {
        f"{first // unit_steps:06d}-{lane}.json": Unit(
            first=first,
            count=min(unit_steps, steps - first),
            lane=lane,
            lanes=nodes,
        )
        for first in range(0, steps, unit_steps)
        for lane in range(nodes)
    }
    grid = unit_grid(steps, unit_steps, nodes)
    assert list(grid.items()) == list(design_note.items())
    assert len(grid) == 800 and grid["000000-2.json"] == Unit(first=0, count=20, lane=2, lanes=4)


def test_unit_grid_shortens_the_last_group():
    grid = unit_grid(steps=45, unit_steps=20, lanes=2)
    assert grid["000002-1.json"] == Unit(first=40, count=5, lane=1, lanes=2)
    with pytest.raises(ValueError, match="unit_steps"):
        unit_grid(10, 0, 2)


def test_rotated_order_plain_is_the_design_notes_rotation():
    units = unit_grid(steps=2, unit_steps=1, lanes=4)
    assert rotated_order(units, 1, 4, block=1, lag=0) == [
        "000000-1.json",
        "000000-2.json",
        "000000-3.json",
        "000000-0.json",
        "000001-1.json",
        "000001-2.json",
        "000001-3.json",
        "000001-0.json",
    ]
    assert rotated_order(units, 4, 4, block=1, lag=0) == list(units)
    assert rotated_order(["a", "b", "c"], 1, 2, block=1, lag=0) == ["b", "a", "c"]


def test_rotated_order_blocks_and_lag():
    # Own lane through each block of 2 groups first, then the other lane of the block before,
    # from its last group backwards.
    ids = ["a0", "a1", "b0", "b1", "c0", "c1", "d0", "d1"]
    assert rotated_order(ids, 0, 2, block=2, lag=1) == ["a0", "b0", "c0", "d0", "b1", "a1", "d1", "c1"]
    assert rotated_order(ids, 1, 2, block=2, lag=1) == ["a1", "b1", "c1", "d1", "b0", "a0", "d0", "c0"]
    assert rotated_order(ids, 0, 2, block=2, lag=0) == ["a0", "b0", "b1", "a1", "c0", "d0", "d1", "c1"]
    # block=1: own lane of each group, the other lanes `lag` groups later.
    assert rotated_order(["a0", "a1", "a2", "b0", "b1", "b2"], 1, 3, block=1, lag=1) == [
        "a1",
        "b1",
        "a2",
        "a0",
        "b2",
        "b0",
    ]


@pytest.mark.parametrize("lanes", [1, 3, 7])
def test_rotated_order_is_always_a_permutation(lanes):
    units = list(unit_grid(50, 1, lanes))
    for identifiers in (units, units[:-1]):  # a short last group too
        for block, lag, rank in itertools.product((1, 2, 3, 8, 100), (0, 1, 2, 5), range(9)):
            order = rotated_order(identifiers, rank, lanes, block=block, lag=lag)
            assert sorted(order) == sorted(identifiers), (block, lag, rank)
            assert order[0] == identifiers[rank % min(lanes, len(identifiers))], "own lane first"


def test_rotated_order_default_prefers_own_lane_first_in_each_group():
    lanes = 4
    units = unit_grid(steps=40, unit_steps=1, lanes=lanes)
    for rank in range(lanes):
        order = rotated_order(units, rank, lanes)
        first_seen: dict[int, int] = {}
        for identifier in order:
            first_seen.setdefault(units[identifier].first, units[identifier].lane)
        assert set(first_seen.values()) == {rank}


def test_rotated_order_bad_arguments():
    units = unit_grid(steps=2, unit_steps=1, lanes=4)
    with pytest.raises(ValueError, match="rank"):
        rotated_order(units, -1, 4)
    with pytest.raises(ValueError, match="block"):
        rotated_order(units, 0, 4, block=0)
    with pytest.raises(ValueError, match="lag"):
        rotated_order(units, 0, 4, lag=-1)
