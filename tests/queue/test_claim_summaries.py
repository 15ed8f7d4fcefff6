"""'All claimed' span summaries (``claimed/``): written once a span is known complete, read to skip
listing its claims, never trusted beyond this run's own span keys; claims stay exactly-once."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator

import pytest

from gradientmail.layout import CLAIMS_PREFIX, SUMMARIES_PREFIX, parse_summary_key, summary_key
from gradientmail.mailbox.memory import MemoryMailbox
from gradientmail.mailbox.wrappers import CountingMailbox
from gradientmail.queue import claimer as claimer_module
from gradientmail.queue.claim_index import ClaimIndex
from gradientmail.queue.claimer import Claimer
from gradientmail.queue.claims import try_claim

UNITS = [f"u{n:03d}" for n in range(40)]
SPAN = 8


class ListingRecorder(CountingMailbox):
    """Counts requests and remembers every key a listing handed out."""

    def __init__(self, inner: MemoryMailbox) -> None:
        super().__init__(inner)
        self.listed: list[str] = []

    def list(self, prefix: str = "", start_after: str | None = None) -> Iterator[str]:
        for key in super().list(prefix, start_after):
            self.listed.append(key)
            yield key


@pytest.fixture
def store():
    box = MemoryMailbox(f"summaries-{uuid.uuid4().hex}")
    yield box
    box.clear()


@pytest.fixture
def every_writer(monkeypatch):
    """Every claimer writes every summary it sees complete (not one in ``SUMMARY_WRITERS``)."""
    monkeypatch.setattr(claimer_module, "SUMMARY_WRITERS", 1)
    monkeypatch.setattr(claimer_module, "SUMMARY_WANTED", 1)


def summaries(box) -> list[str]:
    return sorted(box.list(SUMMARIES_PREFIX))


def test_summary_key_round_trip_and_refuses_garbage():
    assert parse_summary_key(summary_key(3, 0xABC)) == (3, 0xABC)
    for bad in ["claimed/3.abc", "claimed/00000003", "claimed/0000000x.00000abc", "units/00000003.00000abc"]:
        assert parse_summary_key(bad) is None
    keys = ClaimIndex(UNITS).summary_keys(SPAN)
    assert sorted(keys.values()) == list(range(5))
    assert all(key.startswith(SUMMARIES_PREFIX) and parse_summary_key(key)[0] == span for key, span in keys.items())
    # another span size or another unit set: other keys for the same span numbers
    assert not set(keys) & set(ClaimIndex(UNITS).summary_keys(4))
    assert not set(keys) & set(ClaimIndex(UNITS[1:] + ["v"]).summary_keys(SPAN))


def test_summary_written_once_its_span_is_claimed_and_not_while_an_attempt_is_in_flight(store, every_writer):
    index = ClaimIndex(UNITS)
    span0 = next(key for key, span in index.summary_keys(SPAN).items() if span == 0)
    claimer = Claimer(store, UNITS, "node-a", listing="always", summary_span=SPAN, page=4, index=index)
    first = claimer.pick()  # the attempt on u000 is in flight: its create may yet fail
    assert first.identifier == "u000"
    for identifier in UNITS[1:SPAN]:
        assert try_claim(store, identifier, "node-b")
    second = claimer.pick()  # lists: u001..u007 claimed, u000 still in flight
    assert second.identifier == UNITS[SPAN]
    assert summaries(store) == []
    assert claimer.settle(first, claimer.attempt(first)) == "u000"
    assert claimer.settle(second, claimer.attempt(second)) == UNITS[SPAN]
    third = claimer.pick()  # its listing shows span 0 complete
    assert summaries(store) == [span0]
    assert claimer.stats["summaries_written"] == 1
    claimer.settle(third, claimer.attempt(third))
    while claimer.claim_next() is not None:
        pass
    assert claimer.stats["summaries_written"] + claimer.stats["summaries_lost"] == len(summaries(store))
    assert claimer.stats["summaries_lost"] == 0


def test_summarised_spans_are_not_listed(store):
    index = ClaimIndex(UNITS)
    done = 4 * SPAN  # spans 0-3 claimed and summarised, span 4 free
    for identifier in UNITS[:done]:
        assert try_claim(store, identifier, "node-a")
    for key, span in index.summary_keys(SPAN).items():
        if span < 4:
            assert store.put_if_absent(key, b"")
    claimed_early = {CLAIMS_PREFIX + identifier for identifier in UNITS[:done]}

    def run(summary_span: int) -> tuple[list[str], ListingRecorder, Claimer]:
        box = ListingRecorder(store)
        claimer = Claimer(box, UNITS, f"node-{summary_span}", listing="always", summary_span=summary_span, index=index)
        won = []
        while (identifier := claimer.claim_next()) is not None:
            won.append(identifier)
        return won, box, claimer

    won, box, claimer = run(SPAN)
    assert won == UNITS[done:]
    assert not claimed_early & set(box.listed)  # no claim of a summarised span was listed
    assert claimer.stats["summary_listings"] >= 1
    for identifier in won:  # the second run finds them claimed: release them for it
        store.delete(CLAIMS_PREFIX + identifier)
    won, box, _ = run(0)  # without summaries: the same units, after listing every claim
    assert won == UNITS[done:]
    assert claimed_early <= set(box.listed)
    assert not [key for key in box.listed if key.startswith(SUMMARIES_PREFIX)]


def test_foreign_and_garbled_summaries_are_ignored_with_a_warning(store, caplog):
    index = ClaimIndex(UNITS)
    for key in [
        summary_key(0, 0),  # span 0, but not this run's check
        next(iter(ClaimIndex(UNITS).summary_keys(4))),  # this run's units, another span size
        "claimed/garbage",
        "claimed/00000001.zzzzzzzz",
    ]:
        assert store.put_if_absent(key, b"every unit is claimed, trust me")
    claimer = Claimer(store, UNITS, "node-a", listing="always", summary_span=SPAN, index=index)
    with caplog.at_level(logging.WARNING, logger="gradientmail.queue"):
        won = []
        while (identifier := claimer.claim_next()) is not None:
            won.append(identifier)
    assert won == UNITS  # nothing skipped: no unit had a claim
    assert claimer.stats["foreign_summaries"] == 4 * claimer.stats["summary_listings"] > 0
    warnings = [record for record in caplog.records if "ignoring" in record.getMessage()]
    assert len(warnings) == 1  # once per claimer, not once per key or listing


def test_exactly_once_with_summaries_over_several_claimers(store, every_writer):
    units = [f"{group:04d}-{lane}" for group in range(60) for lane in range(4)]
    index = ClaimIndex(units)
    claimers = [
        Claimer(store, units[rank:] + units[:rank], f"node-{rank}", summary_span=16, page=32, index=index)
        for rank in range(4)
    ]
    won: list[str] = []
    active = list(claimers)
    turn = 0
    while active:
        claimer = active[turn % len(active)]
        identifier = claimer.claim_next()
        if identifier is None:
            active.remove(claimer)
        else:
            won.append(identifier)
            turn += 1 + len(won) % 3  # uneven turns
    assert sorted(won) == sorted(units)  # every unit once
    written = summaries(store)
    assert written  # summaries were written...
    spans = index.summary_keys(16)
    assert set(written) <= set(spans)  # ...only this run's
    claims = set(store.list(CLAIMS_PREFIX))
    for key in written:  # ...each only once its span's claims all existed
        span = spans[key]
        assert {index.keys[p] for p in range(span * 16, min(len(units), span * 16 + 16))} <= claims
    stats = sum((claimer.stats for claimer in claimers), start=claimers[0].stats.__class__())
    assert stats["summaries_written"] == len(written)


def test_summary_span_must_be_a_non_negative_int(store):
    for bad in [-1, 1.5, True, "8"]:
        with pytest.raises(ValueError, match="summary_span"):
            Claimer(store, UNITS, "node-a", summary_span=bad)


@pytest.mark.slow
def test_simulated_nodes_skip_summarised_spans_and_pay_for_them(monkeypatch):
    """64 nodes on spans of 64 units: summaries are read and written, every unit is claimed once,
    and the simulator bills their listings and creates like any other request."""
    from gradientmail.queue.units import unit_grid
    from gradientmail.sim.queue import simulate

    def run(span: int):
        monkeypatch.setitem(Claimer.__init__.__kwdefaults__, "summary_span", span)
        lanes = 64
        units = unit_grid(8192 // lanes, 1, lanes)
        return simulate(units, [(1, 2, 2, 4)[rank % 4] for rank in range(lanes)], rotate_lanes=lanes, jitter=0.2)

    plain, summarised = run(0), run(64)
    for result in (plain, summarised):
        assert result.claims == 8192  # every unit claimed, none skipped
    stats = summarised.claim_stats
    assert stats["summarised"] > 0 and stats["summaries_written"] > 0
    assert not plain.claim_stats["summary_listings"] and not plain.claim_stats["summaries_written"]
    startup = plain.requests["put_if_absent"] - plain.claim_stats["attempts"]
    creates = stats["attempts"] + stats["summaries_written"] + stats["summaries_lost"]
    assert summarised.requests["put_if_absent"] == startup + creates
    assert summarised.requests["list"] >= stats["listings"] + stats["summary_listings"]


def refusing_summaries(inner: MemoryMailbox):
    """A store that refuses every write and listing under ``claimed/`` (a policy, a quota)."""
    from gradientmail.errors import MailboxError
    from gradientmail.mailbox.wrappers import FaultyMailbox

    def fault(operation: str, key: str) -> BaseException | None:
        return MailboxError(f"{operation} {key}: access denied") if key.startswith(SUMMARIES_PREFIX) else None

    return FaultyMailbox(inner, fault)


def test_a_store_refusing_summaries_never_stops_a_claim(store, every_writer, caplog):
    """Summaries only save listings: a refused one is logged once and turned off, and the claim
    being settled when it failed is still handed out (a won unit is never stranded)."""
    refusing = refusing_summaries(store)
    claimer = Claimer(refusing, UNITS, "n0", summary_span=SPAN)
    with caplog.at_level(logging.WARNING, logger="gradientmail.queue"):
        won = [claimer.claim_next() for _ in UNITS]
    assert won == UNITS and claimer.claim_next() is None
    assert sorted(key[len(CLAIMS_PREFIX) :] for key in store.list(CLAIMS_PREFIX)) == UNITS
    assert claimer.stats["summary_failures"] == 1
    assert len([r for r in caplog.records if "claim summaries" in r.getMessage()]) == 1


def test_a_late_joiner_whose_summary_listing_fails_claims_what_is_left(store, every_writer):
    first = Claimer(store, UNITS, "n0", summary_span=SPAN)
    for _ in range(3 * SPAN):
        first.claim_next()
    assert summaries(store), "the first node wrote summaries of the spans it completed"
    late = Claimer(refusing_summaries(store), UNITS, "n1", summary_span=SPAN)
    left = []
    while (unit := late.claim_next()) is not None:
        left.append(unit)
    assert left == UNITS[3 * SPAN :]


@pytest.mark.slow
def test_a_stray_object_named_claimed_never_strands_a_unit(tmp_path):
    """A file ``claimed`` where the summaries' folder would be (a user's, a tool's): every unit of a
    run long enough to write summaries is still trained once."""
    import torch

    from gradientmail import LocalMailbox
    from gradientmail.patterns.shared_queue import shared_queue

    box = LocalMailbox(tmp_path / "box")
    box.put("claimed", b"not a folder")
    units = {f"{n:05d}": n for n in range(2 * claimer_module.SUMMARY_SPAN + 5)}
    with shared_queue(
        units, mailbox=box, learner_id="n0", load=lambda n: [(n, torch.tensor([n]))], workers=0
    ) as batches:
        trained = [step for step, _ in batches]
    assert sorted(trained) == list(range(len(units)))
