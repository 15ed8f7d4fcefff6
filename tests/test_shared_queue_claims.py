"""The claim protocol, the Claimer's listing, the unit helpers, and the virtual-clock simulation."""

from __future__ import annotations

import json
import random

import pytest
import torch

from gradientmail import MemoryMailbox
from gradientmail.errors import InvalidKeyError, UnsafeStoreError
from gradientmail.layout import CLAIMS_PREFIX, claim_key
from gradientmail.mailbox.wrappers import CountingMailbox
from gradientmail.patterns.claims import (
    Claimer,
    KeyTypeError,
    claim_body,
    read_claim,
    try_claim,
    validate_identifier,
    validate_learner_id,
)
from gradientmail.patterns.simulate import fixed_split_makespan, simulate
from gradientmail.patterns.units import Unit, rotated_order, unit_grid

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def box():
    mailbox = MemoryMailbox(f"claims-{random.getrandbits(64):x}")
    yield mailbox
    mailbox.clear()


class ListRecorder(CountingMailbox):
    """Counts requests like a store bills them, and records each listing and the keys read."""

    def __init__(self, inner):
        super().__init__(inner)
        self.listings: list[tuple[str | None, int]] = []

    def list(self, prefix="", start_after=None):
        record = [start_after, 0]  # [start_after, keys read]
        self.listings.append(record)
        for key in super().list(prefix, start_after):
            record[1] += 1
            yield key


# -- one claim -----------------------------------------------------------------------------


def test_claim_body_is_the_documented_json():
    body = json.loads(claim_body("node-1", "abc", worker=2))
    assert body["learner"] == "node-1" and body["token"] == "abc" and body["worker"] == 2
    assert isinstance(body["pid"], int) and body["host"] and body["claimed_at"] > 0


def test_exactly_one_claimer_wins(box):
    assert try_claim(box, "u1", "node-0") is True
    assert try_claim(box, "u1", "node-1") is False
    assert try_claim(box, "u1", "node-0") is False, "a restarted learner does not reclaim its unit"
    assert read_claim(box, "u1")["learner"] == "node-0"
    assert read_claim(box, "u2") is None


def test_tokens_do_not_come_from_random(box):
    random.seed(0)
    torch.manual_seed(0)
    try_claim(box, "a", "n")
    random.seed(0)
    torch.manual_seed(0)
    try_claim(box, "b", "n")
    assert read_claim(box, "a")["token"] != read_claim(box, "b")["token"]


class ForeignReadBack(MemoryMailbox):
    """A broken store: the create "succeeds" but the value read back is someone else's."""

    def get(self, key):
        value = super().get(key)
        if value is not None and key.startswith(CLAIMS_PREFIX):
            claim = json.loads(value)
            claim["token"] = "someone else"
            return json.dumps(claim).encode()
        return value


class LosesWrites(MemoryMailbox):
    def get(self, key):
        return None


def test_read_back_with_another_token_is_not_ours():
    mailbox = ForeignReadBack("claims-foreign")
    try:
        assert try_claim(mailbox, "u", "node-0") is False
        claimer = Claimer(mailbox, ["u", "v"], "node-0")
        assert claimer.claim_next() is None, "a claim that reads back foreign is never loaded"
        assert claimer.stats["conflicts"] == 1  # "u" was seen claimed in the listing
    finally:
        mailbox.clear()


def test_claim_that_cannot_be_read_back_is_an_unsafe_store():
    mailbox = LosesWrites("claims-lost")
    try:
        with pytest.raises(UnsafeStoreError, match="cannot be read back"):
            try_claim(mailbox, "u", "node-0")
    finally:
        mailbox.clear()


def test_identifier_and_learner_validation():
    assert validate_identifier("000001-2.json") == "000001-2.json"
    with pytest.raises(KeyTypeError, match="int"):
        validate_identifier(7)
    with pytest.raises(InvalidKeyError, match="'../x'"):
        validate_identifier("../x")
    assert validate_learner_id("node-0") == "node-0"
    with pytest.raises(InvalidKeyError, match="without '/'"):
        validate_learner_id("a/b")


# -- the Claimer -----------------------------------------------------------------------------


def test_claimer_follows_order_and_skips_claimed(box):
    order = ["c", "a", "d", "b"]
    try_claim(box, "a", "other")
    claimer = Claimer(box, order, "me")
    assert [claimer.claim_next() for _ in range(4)] == ["c", "d", "b", None]
    assert claimer.stats["claims"] == 3 and claimer.stats["conflicts"] == 0


def test_a_lost_race_moves_on(box):
    first = Claimer(box, ["a", "b", "c"], "x", listing="conflict")
    second = Claimer(box, ["a", "b", "c"], "y", listing="conflict")
    assert first.claim_next() == "a"
    assert second.claim_next() == "b", "second listed before its first attempt"
    assert first.claim_next() == "c"  # knows nothing of b: tries b, loses, lists, takes c
    assert first.stats["conflicts"] == 1
    assert second.claim_next() is None


def test_alone_a_claimer_stops_listing(box):
    counted = CountingMailbox(box)
    claimer = Claimer(counted, [f"{i:04d}" for i in range(200)], "solo")
    while claimer.claim_next() is not None:
        pass
    assert claimer.stats["claims"] == 200
    # create + read back per claim, a handful of listings in all.
    assert counted.counts["put_if_absent"] == 200 and counted.counts["get"] == 200
    assert counted.counts["list"] <= 6


def test_listing_starts_at_low_and_stops_at_the_page_that_covers_the_candidate(box):
    identifiers = [f"{i:05d}" for i in range(5000)]
    for identifier in identifiers[:3000:2]:  # every other unit of the first 3,000 is taken
        try_claim(box, identifier, "other")
    recorder = ListRecorder(box)
    claimer = Claimer(recorder, identifiers, "me")
    assert claimer.claim_next() == "00001"
    assert recorder.listings == [[None, 1000]], "one page from the start, no more"
    assert recorder.counts["list"] == 1
    # The next candidates were settled by that page: skipped without listing again.
    assert claimer.claim_next() == "00003"
    assert recorder.listings[-1][0] == claim_key("00002"), "re-lists from low, never the past"


def test_listing_never_reaches_further_back_than_a_page(box):
    identifiers = [f"{i:05d}" for i in range(5000)]
    recorder = ListRecorder(box)
    claimer = Claimer(recorder, list(reversed(identifiers)), "me", listing="always")
    assert claimer.claim_next() == "04999"
    assert recorder.listings[0][0] == claim_key("03998"), "at most a page behind the candidate"
    assert claimer.claim_next() == "04998"
    assert recorder.listings[1][0] == claim_key("03997")


@pytest.mark.parametrize("listing", ["adaptive", "always"])
def test_requests_per_claim_stay_constant_as_the_run_grows(listing):
    def cost(units: int) -> float:
        result = simulate(unit_grid(units // 4, 1, 4), [1, 2, 2, 4], rotate_lanes=4, listing=listing, jitter=0.2)
        assert result.claims == units
        return result.requests_per_claim

    small, large = cost(400), cost(4000)
    assert large <= 3.01, "list + create + read back, plus a few requests per node start"
    assert abs(large - small) < 0.06, "the cost does not grow with the number of claims"


def test_claimers_that_never_list_pay_for_it():
    careful = simulate(unit_grid(200, 1, 4), [1, 2, 2, 4], rotate_lanes=4)
    blind = simulate(unit_grid(200, 1, 4), [1, 2, 2, 4], rotate_lanes=4, listing="never")
    assert careful.requests_per_claim < blind.requests_per_claim
    assert careful.conflicts_per_claim < 0.01 < blind.conflicts_per_claim


def test_a_single_learner_pays_two_requests_per_claim():
    result = simulate(unit_grid(1000, 1, 2), [1])
    assert result.requests_per_claim < 2.01


# -- the seed's schedule, virtually ---------------------------------------------------------------


@pytest.mark.parametrize("rotate", [4, None])
def test_seed_schedule(rotate):
    units = unit_grid(steps=6, unit_steps=1, lanes=4)
    result = simulate(units, unit_times=[1, 2, 2, 4], rotate_lanes=rotate)
    assert result.makespan == 12
    assert result.units_by_learner == {"node-0": 11, "node-1": 5, "node-2": 5, "node-3": 3}
    assert fixed_split_makespan(len(units), [1, 2, 2, 4]) == 24


def test_simulated_units_of_several_batches():
    units = unit_grid(steps=24, unit_steps=4, lanes=4)  # the same 24 units, 4 batches each
    result = simulate(units, unit_times=[1, 2, 2, 4], rotate_lanes=4)
    assert result.makespan == pytest.approx(12)
    assert sorted(result.units_by_learner.values()) == [3, 5, 5, 11]


# -- the unit helpers ----------------------------------------------------------------------------


def test_unit_grid_is_the_seeds_mapping():
    steps, unit_steps, nodes = 4000, 20, 4
    seed = {
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
    assert list(grid.items()) == list(seed.items())
    assert len(grid) == 800 and grid["000000-2.json"] == Unit(first=0, count=20, lane=2, lanes=4)


def test_unit_grid_shortens_the_last_group():
    grid = unit_grid(steps=45, unit_steps=20, lanes=2)
    assert grid["000002-1.json"] == Unit(first=40, count=5, lane=1, lanes=2)
    with pytest.raises(ValueError, match="unit_steps"):
        unit_grid(10, 0, 2)


def test_rotated_order():
    units = unit_grid(steps=2, unit_steps=1, lanes=4)
    assert rotated_order(units, 1, 4) == [
        "000000-1.json", "000000-2.json", "000000-3.json", "000000-0.json",
        "000001-1.json", "000001-2.json", "000001-3.json", "000001-0.json",
    ]
    assert rotated_order(units, 4, 4) == list(units)
    assert rotated_order(["a", "b", "c"], 1, 2) == ["b", "a", "c"]
    with pytest.raises(ValueError, match="rank"):
        rotated_order(units, -1, 4)
