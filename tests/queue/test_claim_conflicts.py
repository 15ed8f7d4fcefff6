"""What a claimer does between a listing and the create that relies on it: nothing slow.

Two claimers that list at about the same moment both see the same unit free, and the one whose
create lands second loses (a conflict). The gap between what the listing shows and the create
is the window for that race, so the claimer draws the attempt's token (``claims.new_token``:
``os.urandom``, a system call) before the listing and asks for the host name once per process,
not for each claim. Checked here on the order of requests and calls, not on timing.
"""

from __future__ import annotations

import json

import pytest

from gradientmail import rotated_order, unit_grid
from gradientmail.layout import CLAIMS_PREFIX, SUMMARIES_PREFIX
from gradientmail.mailbox.wrappers import CountingMailbox
from gradientmail.queue import claims
from gradientmail.queue.claim_index import ClaimIndex
from gradientmail.queue.claimer import Claimer
from gradientmail.queue.claims import claim_body, read_claim, try_claim

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def box(memory_mailbox):
    return memory_mailbox


class Recorder(CountingMailbox):
    """Appends ``("list",)``, ``("create", key, token)`` and ``("summary", key)`` to a shared event log."""

    def __init__(self, inner, events):
        super().__init__(inner)
        self.events = events

    def list(self, prefix="", start_after=None):
        self.events.append(("list",))
        return super().list(prefix, start_after)

    def put_if_absent(self, key, data):
        if key.startswith(SUMMARIES_PREFIX):  # an "all claimed" summary, not a claim: no token
            self.events.append(("summary", key))
            return super().put_if_absent(key, data)
        self.events.append(("create", key, json.loads(data)["token"]))
        return super().put_if_absent(key, data)


@pytest.fixture
def events(monkeypatch):
    """The event log, with token draws and host name look-ups recorded in it too."""
    log: list[tuple] = []
    real_urandom = claims.os.urandom

    def urandom(size: int) -> bytes:
        value = real_urandom(size)
        log.append(("token", value.hex()))
        return value

    claims.host_name()  # the one look-up of this process, before anything is recorded
    monkeypatch.setattr(claims.os, "urandom", urandom)
    monkeypatch.setattr(claims.socket, "gethostname", lambda: log.append(("hostname",)) or "h")
    return log


def test_try_claim_writes_the_token_it_is_given(box):
    assert try_claim(box, "u", "node-0", token="abc") is True
    assert read_claim(box, "u")["token"] == "abc"
    assert try_claim(box, "u", "node-1", token="def") is False
    assert read_claim(box, "u")["token"] == "abc"


def test_claim_body_does_not_look_up_the_host_each_time(events):
    bodies = [json.loads(claim_body("node-0", f"t{i}")) for i in range(3)]
    assert ("hostname",) not in events
    assert len({body["host"] for body in bodies}) == 1


@pytest.mark.parametrize("listing", ["adaptive", "always"])
def test_nothing_is_drawn_between_a_listing_and_its_create(box, events, listing):
    """Four claimers in turn (each ``claim_next`` whole), rotated orders, lost races included."""
    lanes = 4
    units = unit_grid(steps=40, unit_steps=1, lanes=lanes)
    index = ClaimIndex(units)
    claimers = [
        Claimer(Recorder(box, events), rotated_order(units, rank, lanes), f"node-{rank}", listing=listing, index=index)
        for rank in range(lanes)
    ]
    # Uneven turns, so that claimers go stale and some creates lose.
    turns = [0, 0, 1, 2, 0, 3, 3, 1, 0, 2] * 40
    claimed: list[str] = []
    done: set[int] = set()
    for rank in turns:
        if rank in done:
            continue
        identifier = claimers[rank].claim_next()
        if identifier is None:
            done.add(rank)
        else:
            claimed.append(identifier)
    for claimer in claimers:
        while (identifier := claimer.claim_next()) is not None:
            claimed.append(identifier)

    assert sorted(claimed) == sorted(units), "every unit claimed exactly once"
    creates = [event for event in events if event[0] == "create"]
    assert len({token for _, _, token in creates}) == len(creates), "a fresh token per attempt"
    assert ("hostname",) not in events

    after_listing = 0
    between: list[tuple] | None = None  # what happened since the latest listing, if any
    for event in events:
        if event[0] == "list":
            between = [] if between is None else between
        elif event[0] == "create":
            if between is not None:
                assert between == [], f"{between} between a listing and the create of {event[1]}"
                after_listing += 1
            between = None
        elif between is not None:
            between.append(event)
    assert after_listing >= 10
    drawn = [event[1] for event in events if event[0] == "token"]
    assert {token for _, _, token in creates} <= set(drawn)
    stats = sum((claimer.stats for claimer in claimers), start=type(claimers[0].stats)())
    assert stats["claims"] == len(units)
    if listing == "adaptive":
        assert stats["conflicts"] > 0, "the schedule should include lost races"


def test_a_token_drawn_for_a_listing_is_used_once(box, events):
    """A listing that finds its candidate taken keeps the token for the next attempt."""
    for identifier in ("a", "b"):
        try_claim(box, identifier, "other")
    events.clear()
    claimer = Claimer(Recorder(box, events), ["a", "b", "c", "d"], "me", listing="always")
    assert claimer.claim_next() == "c"
    assert claimer.claim_next() == "d"
    kinds = [event[0] for event in events]
    assert kinds == ["token", "list", "create", "token", "list", "create"]
    assert events[2][2] == events[0][1] and events[5][2] == events[3][1]
    assert {key[len(CLAIMS_PREFIX) :] for _, key, _ in (events[2], events[5])} == {"c", "d"}
