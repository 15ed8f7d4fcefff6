"""Which unit a Claimer tries next and when it lists claims first: requests per claimed unit
stay about constant."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from gradientmail import MemoryMailbox, SharedQueueDataset, Unit, rotated_order, unit_grid
from gradientmail.layout import claim_key
from gradientmail.mailbox.wrappers import CountingMailbox
from gradientmail.queue.claimer import Claimer
from gradientmail.queue.claims import try_claim
from gradientmail.queue.crowd import STRETCH
from gradientmail.sim.queue import simulate

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


def test_claimer_lists_when_catching_up_with_a_known_claim(box):
    identifiers = [f"{i:05d}" for i in range(60)]
    try_claim(box, "00040", "other")  # seen by the claimer's first listing
    counted = CountingMailbox(box)
    claimer = Claimer(counted, identifiers, "me")
    listed_before = {}
    for identifier in [f"{i:05d}" for i in range(60) if i != 40]:
        lists = counted.counts["list"]
        assert claimer.claim_next() == identifier
        listed_before[identifier] = counted.counts["list"] > lists
    assert claimer.claim_next() is None
    assert claimer.stats["conflicts"] == 0
    # Blind once alone long enough; a listing again where the next unit is 00040 (a walk that
    # goes on by the same step looks only at its next unit: NEAR_WALK).
    assert not any(listed_before[f"{i:05d}"] for i in range(20, 39))
    assert listed_before["00039"]
    assert not any(listed_before[f"{i:05d}"] for i in range(45, 60))


def take_turns(claimers: list[Claimer]) -> list[str]:
    """Each claimer claims one unit in turn until none finds a free one."""
    got: list[str] = []
    while True:
        claimed = [claimer.claim_next() for claimer in claimers]
        got.extend(identifier for identifier in claimed if identifier is not None)
        if all(identifier is None for identifier in claimed):
            return got


def test_claimers_listing_before_every_claim_never_conflict(box):
    identifiers = [f"{i:05d}" for i in range(200)]
    claimers = [Claimer(box, identifiers, name, listing="always") for name in "ab"]
    assert sorted(take_turns(claimers)) == identifiers
    for claimer in claimers:
        assert claimer.stats["conflicts"] == 0 and claimer.stats["blind"] == 0
        assert claimer.stats["jumps"] == 0
        assert claimer.stats["listings"] >= claimer.stats["claims"] - 1, "both list before each claim"


def test_claimers_in_a_crowd_jump_ahead_and_list_far_less(box):
    # Four claimers with the same order: a claimer that lists before every claim.
    identifiers = [f"{i:05d}" for i in range(2000)]
    claimers = [Claimer(box, identifiers, f"node-{rank}") for rank in range(4)]
    assert sorted(take_turns(claimers)) == identifiers
    claims = sum(claimer.stats["claims"] for claimer in claimers)
    listings = sum(claimer.stats["listings"] for claimer in claimers)
    conflicts = sum(claimer.stats["conflicts"] for claimer in claimers)
    assert sum(claimer.stats["jumps"] for claimer in claimers) > 0
    assert listings < claims * 0.6  # listing before every claim: about 1 per claim
    assert conflicts < claims / 20


def test_after_a_jump_a_claimer_walks_a_stretch_of_consecutive_units(box):
    identifiers = [f"{i:05d}" for i in range(2000)]
    claimers = [Claimer(box, identifiers, f"node-{rank}") for rank in range(4)]
    won: dict[str, list[int]] = {claimer.learner_id: [] for claimer in claimers}
    while True:
        claimed = [(claimer, claimer.claim_next()) for claimer in claimers]
        for claimer, identifier in claimed:
            if identifier is not None:
                won[claimer.learner_id].append(int(identifier))
        if all(identifier is None for _, identifier in claimed):
            break
    jumped = [claimer for claimer in claimers if claimer.stats["jumps"]]
    assert jumped
    for claimer in jumped:
        numbers = won[claimer.learner_id]
        longest = max(
            len(list(run)) for _, run in itertools.groupby(enumerate(numbers), lambda pair: pair[1] - pair[0])
        )
        assert longest >= STRETCH, f"{claimer.learner_id} never walked a stretch"


def test_a_claimer_that_knows_everything_is_claimed_makes_no_request(box):
    counted = CountingMailbox(box)
    claimer = Claimer(counted, [f"{i:03d}" for i in range(50)], "solo")
    assert [claimer.claim_next() for _ in range(50)] == [f"{i:03d}" for i in range(50)]
    requests = counted.requests
    assert claimer.claim_next() is None and counted.requests == requests, "no final listing"
    # The same when the last listing showed every remaining unit claimed by others.
    other = Claimer(CountingMailbox(box), ["x", "y"], "b")
    try_claim(box, "y", "c")
    assert other.claim_next() == "x"  # listed first: y is known claimed
    requests = other.mailbox.requests
    assert other.claim_next() is None and other.mailbox.requests == requests


def test_listing_starts_at_low_and_stops_at_the_page_that_covers_the_candidate(box):
    identifiers = [f"{i:05d}" for i in range(5000)]
    for identifier in identifiers[:3000:2]:  # every other unit of the first 3,000 is taken
        try_claim(box, identifier, "other")
    recorder = ListRecorder(box)
    claimer = Claimer(recorder, identifiers, "me", summary_span=0)  # summaries: test_claim_summaries.py
    assert claimer.claim_next() == "00001"
    assert recorder.listings == [[None, 1000]], "one page from the start, no more"
    assert recorder.counts["list"] == 1
    # The next candidates were settled by that page: skipped without listing again.
    assert claimer.claim_next() == "00003"
    assert recorder.listings[-1][0] == claim_key("00002"), "re-lists from low, never the past"


def test_listing_never_reaches_further_back_than_a_page(box):
    identifiers = [f"{i:05d}" for i in range(5000)]
    recorder = ListRecorder(box)
    claimer = Claimer(recorder, list(reversed(identifiers)), "me", listing="always", summary_span=0)
    assert claimer.claim_next() == "04999"
    # A page ending at the candidate: the walk's next units, below it, are settled too.
    assert recorder.listings[0][0] == claim_key("03999"), "at most a page behind the candidate"
    assert claimer.claim_next() == "04998"
    assert recorder.listings[1][0] == claim_key("03998")


@pytest.mark.slow
@pytest.mark.parametrize(("listing", "bound"), [("adaptive", 2.7), ("always", 3.01)])
def test_requests_per_claim_stay_constant_as_the_run_grows(listing, bound):
    def cost(units: int) -> float:
        result = simulate(unit_grid(units // 4, 1, 4), [1, 2, 2, 4], rotate_lanes=4, listing=listing, jitter=0.2)
        assert result.claims == units
        return result.requests_per_claim

    small, large = cost(400), cost(4000)
    assert large <= bound, "create + read back, a listing only where needed, a few per node start"
    assert large <= small + 0.02, "the cost does not grow with the number of claims"
    assert small - large < 0.15, "start-up and learning are spread over more claims, no more"


def test_claimers_that_never_list_pay_for_it():
    careful = simulate(unit_grid(200, 1, 4), [1, 2, 2, 4], rotate_lanes=4)
    blind = simulate(unit_grid(200, 1, 4), [1, 2, 2, 4], rotate_lanes=4, listing="never")
    assert careful.requests_per_claim < blind.requests_per_claim
    assert careful.conflicts_per_claim < 0.05 < blind.conflicts_per_claim


def test_a_single_learner_pays_two_requests_per_claim():
    result = simulate(unit_grid(1000, 1, 2), [1])
    assert result.requests_per_claim < 2.01


@pytest.mark.parametrize(
    ("shape", "most"),
    [
        (None, 3.1),  # every node in the mapping's order: all compete, each claim lists first
        ({"block": 1, "lag": 0}, 3.1),  # the design note's plain rotation: the same
        ({}, 2.8),  # rotated_order's default: stretches of own units, created without listing
        ({"block": 8, "lag": 1}, 2.7),
    ],
)
def test_requests_and_conflicts_by_preference_order(shape, most):
    speeds = [1, 2, 2, 4] * 4
    result = simulate(
        unit_grid(60, 1, 16), speeds, rotate_lanes=None if shape is None else 16, jitter=0.2, **(shape or {})
    )
    assert result.claims == 960
    assert result.requests_per_claim < most
    assert result.conflicts_per_claim <= 0.05


def test_each_claim_costs_less_than_three_requests_in_a_round_of_nodes(box):
    """Four real datasets behind CountingMailbox, served one batch each in turn (no clock)."""
    nodes, groups = 4, 100
    units = unit_grid(groups * 2, 2, nodes)  # 400 units of two batches each
    mailboxes = [CountingMailbox(box) for _ in range(nodes)]
    batches = [
        iter(
            SharedQueueDataset(
                units,
                mailbox=mailboxes[rank],
                learner_id=f"node-{rank}",
                load=_two_batches,
                order=rotated_order(units, rank, nodes),
                resume=False,  # the design note's claim protocol: what this test counts
            )
        )
        for rank in range(nodes)
    ]
    served = 0
    while batches:
        for iterator in list(batches):
            if next(iterator, None) is None:
                batches.remove(iterator)
            else:
                served += 1
    assert served == 2 * len(units)
    requests = sum(mailbox.requests for mailbox in mailboxes)
    assert requests / len(units) < 2.6, [dict(mailbox.counts) for mailbox in mailboxes]
    # The design note's plain rotation in the same round: nodes compete for the same next units.
    store = MemoryMailbox(f"plain-{random.getrandbits(64):x}")
    plain = [CountingMailbox(store) for _ in range(nodes)]
    batches = [
        iter(
            SharedQueueDataset(
                units,
                mailbox=plain[rank],
                learner_id=f"node-{rank}",
                load=_two_batches,
                order=rotated_order(units, rank, nodes, block=1, lag=0),
            )
        )
        for rank in range(nodes)
    ]
    try:
        while batches:
            for iterator in list(batches):
                if next(iterator, None) is None:
                    batches.remove(iterator)
        assert sum(mailbox.requests for mailbox in plain) > requests
    finally:
        store.clear()


def _two_batches(unit: Unit):
    for step in range(unit.first, unit.first + unit.count):
        yield step, torch.zeros(1)


def test_simulated_bill_matches_counting_mailbox():
    from gradientmail.sim.paged_memory import PagedCountingMailbox, PagedMemoryMailbox

    store = PagedMemoryMailbox(f"bill-{random.getrandbits(64):x}")
    try:
        for i in range(2500):
            store.put_if_absent(f"units/{i:05d}", b"x")
        store.put_if_absent("run.json", b"x")
        for prefix, after, take in [
            ("units/", None, 10),
            ("units/", None, 1000),
            ("units/", None, 1001),
            ("units/", "units/00500", 2000),
            ("units/", None, 5000),
            ("", None, 5000),
            ("units/", "units/01499", 1001),
            ("v/", None, 3),
        ]:
            fast, real = PagedCountingMailbox(store), CountingMailbox(MemoryMailbox(store.name))
            got = list(itertools.islice(fast.list(prefix, after), take))
            assert got == list(itertools.islice(real.list(prefix, after), take))
            assert fast.counts == real.counts, (prefix, after, take)
    finally:
        store.clear()


@pytest.mark.parametrize("shape", [{}, {"block": 1, "lag": 0}, {"block": 3, "lag": 2}])
@pytest.mark.parametrize(("units", "lanes", "nodes"), [(24, 4, 4), (23, 4, 9), (1003, 7, 16), (50, 1, 3)])
def test_simulated_rotated_positions_are_rotated_order(shape, units, lanes, nodes):
    """The simulator's arithmetic rotation gives every node exactly ``rotated_order``'s preference,
    a shorter last group and more nodes than lanes included."""
    from gradientmail.queue.claim_index import ClaimIndex
    from gradientmail.sim.queue import rotated_positions

    mapping = dict(itertools.islice(unit_grid(-(-units // lanes), 1, lanes).items(), units))
    index = ClaimIndex(mapping)
    orders = list(rotated_positions(index, list(mapping), nodes, lanes, **shape))
    assert len(orders) == nodes
    for rank, order in enumerate(orders):
        assert list(order) == rotated_order(mapping, rank, lanes, **shape), rank
        assert index.order(order) is order.positions  # the claimer takes them as they are


def test_claimer_walks_a_position_order(box):
    from gradientmail.queue.claim_index import ClaimIndex, PositionOrder

    identifiers = [f"u{i}" for i in range(12)]
    index = ClaimIndex(identifiers)
    wanted = identifiers[::-1]
    order = PositionOrder(index, index.order(wanted))
    assert list(order) == wanted and order[2:4] == wanted[2:4]
    claimer = Claimer(box, order, "a", index=index)
    assert [claimer.claim_next() for _ in range(13)] == [*wanted, None]
    with pytest.raises(ValueError, match="positions"):
        PositionOrder(index, [0, 1])


def test_dataset_takes_listing_claim_index_and_prepared(box):
    from gradientmail.layout import RUN_KEY
    from gradientmail.queue.claim_index import ClaimIndex

    units = unit_grid(steps=4, unit_steps=1, lanes=2)
    counting = CountingMailbox(box)
    index = ClaimIndex(units)
    dataset = SharedQueueDataset(
        units,
        mailbox=counting,
        learner_id="a",
        load=_two_batches,
        listing="never",
        claim_index=index,
        prepared=True,
        resume=False,
    )
    assert len(list(dataset)) == len(units)
    assert box.get(RUN_KEY) is None  # prepared: the caller ran prepare_mailbox, iterating skips it
    assert counting.counts["list"] == 0  # listing="never"
    assert counting.counts["put_if_absent"] == len(units)
    with pytest.raises(ValueError, match="listing"):
        SharedQueueDataset(units, mailbox=box, learner_id="a", load=_two_batches, listing="sometimes")


def test_simulate_refuses_an_order_that_is_not_a_permutation():
    units = unit_grid(steps=2, unit_steps=1, lanes=2)
    good = list(units)
    with pytest.raises(ValueError, match="not a unit"):
        simulate(units, [1, 1], orders=[good, [*good[:-1], "nope"]])
    with pytest.raises(ValueError, match="exactly once"):
        simulate(units, [1, 1], orders=[good, [*good[:-1], good[0]]])
