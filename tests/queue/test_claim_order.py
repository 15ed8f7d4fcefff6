"""The claim order's machinery: bulk skipping (``OrderRuns``), bulk listing (``ClaimIndex.mark``),
what a listing settles, and whom ``rotated_order`` helps first."""

from __future__ import annotations

import random

import pytest

from gradientmail.mailbox.memory import MemoryMailbox
from gradientmail.mailbox.wrappers import CountingMailbox
from gradientmail.queue.claim_index import ClaimIndex
from gradientmail.queue.claimer import Claimer
from gradientmail.queue.claims import try_claim
from gradientmail.queue.order_runs import OrderRuns
from gradientmail.queue.units import rotated_order, unit_grid


@pytest.fixture
def box():
    mailbox = MemoryMailbox(f"claim-order-{random.getrandbits(64):x}")
    yield mailbox
    mailbox.clear()


def _runs_permutation(rng: random.Random, size: int) -> list[int]:
    """A permutation made of ascending, descending and single-position runs, shuffled."""
    pieces, start = [], 0
    while start < size:
        length = min(size - start, rng.choice([1, 1, 2, 5, 17, 60]))
        piece = list(range(start, start + length))
        pieces.append(piece[::-1] if rng.random() < 0.5 else piece)
        start += length
    rng.shuffle(pieces)
    return [position for piece in pieces for position in piece]


def _walk(order: list[int], known: bytearray, index: int) -> int:
    """The unit-by-unit walk ``OrderRuns.next_free`` replaces."""
    while index < len(order) and known[order[index]]:
        index += 1
    return index


@pytest.mark.parametrize("seed", range(6))
def test_bulk_skip_picks_what_the_unit_by_unit_walk_picks(seed):
    rng = random.Random(seed)
    size = 400
    order = _runs_permutation(rng, size)
    runs = OrderRuns(order)
    assert len(runs) < size  # runs, not units
    known = bytearray(size)
    for density in (0.0, 0.3, 0.9, 1.0):
        for position in range(size):
            if rng.random() < density:
                known[position] = 1
        for index in [0, size - 1, size, *rng.sample(range(size), 60)]:
            assert runs.next_free(index, known) == _walk(order, known, index), (density, index)


def test_run_starts_given_by_the_caller_are_used():
    order = [3, 4, 5, 2, 1, 0]
    assert list(OrderRuns(order).starts) == [0, 3]
    runs = OrderRuns(order, starts=[0, 3])
    assert runs.next_free(0, bytearray([0, 1, 0, 1, 1, 1])) == 3
    assert runs.next_free(0, bytearray([1] * 6)) == 6


@pytest.mark.parametrize("seed", range(6))
def test_bulk_listing_marks_what_a_lookup_per_key_marks(seed):
    rng = random.Random(seed)
    identifiers = [f"{i:05d}" for i in range(3000)]
    index = ClaimIndex(identifiers)
    for density in (0.05, 0.5, 0.97, 1.0):
        claimed = sorted(rng.sample(index.keys, int(density * len(index.keys))))
        if seed % 2:
            claimed = sorted([*claimed, "units/00100x", "units/zzz"])  # keys that are not units
        start = rng.randrange(len(claimed) // 2 + 1)
        page = claimed[start : start + 1000]
        known = bytearray(rng.random() < 0.2 for _ in range(len(index)))
        expected = bytearray(known)
        new = 0
        for key in page:
            position = index.positions.get(key)
            if position is not None and not expected[position]:
                expected[position] = 1
                new += 1
        assert index.mark(page, known) == new
        assert known == expected


def test_a_listing_settles_only_what_it_showed(box):
    """A candidate before the listing's first key is not settled by it: listing again, not a
    blind create of a unit another node holds (the conflicts that grew with the nodes)."""
    identifiers = [f"{i:05d}" for i in range(3000)]
    try_claim(box, "02500", "other")
    try_claim(box, "00100", "other")
    counted = CountingMailbox(box)
    order = ["02500", "00100", "00005", *(i for i in identifiers if i not in {"02500", "00100", "00005"})]
    claimer = Claimer(counted, order, "me")
    assert claimer.claim_next() == "00005"
    assert claimer.stats["conflicts"] == 0
    assert counted.counts["put_if_absent"] == 1
    assert claimer.stats["listings"] == 2  # around 02500, then from the start for 00100


def test_rotated_order_helps_the_far_end_first_from_each_nodes_own_lane():
    units = list(unit_grid(steps=4, unit_steps=1, lanes=4))
    # Rank 0: own lane of groups 0-1, of groups 2-3, then the other lanes of groups 0-1 from
    # the last group back, each group from the lane after its own.
    assert rotated_order(units, 0, 4, block=2, lag=1) == [
        "000000-0.json",
        "000001-0.json",
        "000002-0.json",
        "000003-0.json",
        "000001-1.json",
        "000001-2.json",
        "000001-3.json",
        "000000-1.json",
        "000000-2.json",
        "000000-3.json",
        "000003-1.json",
        "000003-2.json",
        "000003-3.json",
        "000002-1.json",
        "000002-2.json",
        "000002-3.json",
    ]
    # Nodes that help at the same moment start on different lanes of the far group.
    first_help = {rank: rotated_order(units, rank, 4, block=2, lag=1)[4] for rank in range(4)}
    assert first_help == {0: "000001-1.json", 1: "000001-2.json", 2: "000001-3.json", 3: "000001-0.json"}


def test_rotated_order_helps_in_key_order():
    """Beyond ten lanes the lanes' key order is not their numbers' (``-10`` sorts before ``-2``):
    a group's other units are helped in key order, so that they are consecutive claims."""
    units = list(unit_grid(steps=1, unit_steps=1, lanes=12))
    order = rotated_order(units, 1, 12, block=1, lag=0)
    assert order[0] == "000000-1.json"
    assert order[1:] == [*sorted(units)[2:], sorted(units)[0]]
    index = ClaimIndex(units)
    assert len(OrderRuns(index.order(order))) == 2  # own unit and the keys after it, then the first
