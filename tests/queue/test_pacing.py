"""Claims paced by the loop in the endgame (``queue.pacing``): a unit is taken just in time for
the loop that will start it, never a buffer ahead, while mid-run the buffer fills as before."""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Iterator

import pytest
import torch
from queue_nodes import Item, named_units
from test_claim_ahead import claimed

from gradientmail import LocalMailbox
from gradientmail.errors import MailboxError
from gradientmail.mailbox.wrappers import CountingMailbox, FaultyMailbox
from gradientmail.patterns.shared_queue import shared_queue
from gradientmail.presence import Presence
from gradientmail.queue import pacing
from gradientmail.queue.pacing import ALONE_GRACE_S, ENDGAME_MARGIN, BufferGauge, Endgame, UnitPacer


class Clock:
    """A clock the test moves."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def loop_step(gauge: BufferGauge, clock: Clock, seconds: float) -> None:
    """The loop asks for a batch, gets it (one leaves the buffer), then trains ``seconds``."""
    gauge.asked()
    gauge.consumed()
    gauge.returned()
    clock.now += seconds


def test_the_gauge_measures_the_loop_s_step_and_its_waits(clock):
    gauge = BufferGauge(loaders=1, clock=clock)
    assert gauge.step_s() is None and not gauge.waiting()
    gauge.produced(None)
    loop_step(gauge, clock, 4.0)  # the first step: no step time until the next ask
    assert gauge.step_s() is None and gauge.buffered() == 0
    gauge.asked()
    assert gauge.waiting()
    clock.now += 0.5  # it waits half a second for its batch
    assert gauge.waited() == pytest.approx(0.5)
    gauge.produced(None)
    gauge.consumed()
    gauge.returned()
    assert gauge.step_s() == pytest.approx(4.0) and not gauge.waiting()
    assert gauge.next_ask(clock.now) == pytest.approx(clock.now + 4.0)
    assert gauge.waited() == pytest.approx(0.5)


def test_in_the_endgame_a_slow_loop_s_loader_claims_just_before_the_loop_needs_the_unit(clock):
    gauge = BufferGauge(loaders=1, clock=clock)
    pacer = UnitPacer(gauge, None, lambda: True, clock=clock, sleep=lambda s: None)
    assert pacer.delay() == 0.0  # nothing buffered, pace unknown: the first unit at once
    assert pacer.wait()
    clock.now += 0.01  # the claim and the first batch take 10 ms
    pacer.produced()
    assert pacer.lead_s() == pytest.approx(0.02)
    assert pacer.delay() == math.inf  # a batch buffered, the loop's pace unknown: wait for it
    loop_step(gauge, clock, 4.0)  # the loop trains the first batch for 4 s
    gauge.produced(None)  # the second unit's batch
    loop_step(gauge, clock, 0.0)  # asked again 4 s later: a step is 4 s; it trains the second now
    # Nothing buffered and the loop will ask in 4 s: claim 20 ms before that, not now.
    assert pacer.delay() == pytest.approx(4.0 - 0.02)
    gauge.produced(None)  # one more batch buffered: one more step before the loop needs a unit
    assert pacer.delay() == pytest.approx(8.0 - 0.02)
    clock.now += 9.0  # the loop is overdue and has not asked: its next ask is now, one batch ahead
    assert pacer.delay() == pytest.approx(4.0 - 0.02)
    gauge.asked()  # it asks: the buffered batch reaches it, then it needs a new unit a step later
    assert pacer.delay() == pytest.approx(4.0 - 0.02)
    gauge.consumed()
    gauge.returned()
    clock.now += 5.0
    gauge.asked()  # it asks with nothing buffered: now
    assert pacer.delay() < 0


def test_mid_run_the_loader_claims_whenever_the_buffer_has_room(clock):
    gauge = BufferGauge(loaders=1, clock=clock)
    pacer = UnitPacer(gauge, None, lambda: False, clock=clock, sleep=lambda s: pytest.fail("waited"))
    for _ in range(5):
        assert pacer.wait()
        pacer.produced()
    assert gauge.buffered() == 5


def test_a_loader_waiting_for_its_turn_stops_when_the_loop_leaves(clock):
    gauge = BufferGauge(loaders=1, clock=clock)
    pacer = UnitPacer(gauge, None, lambda: True, clock=clock, sleep=lambda s: gauge.close())
    gauge.produced(None)  # a batch buffered, pace unknown: it waits, and the loop leaves meanwhile
    assert pacer.wait() is False


def test_other_loaders_claims_count_as_a_batch_ahead_each(clock):
    gauge = BufferGauge(loaders=2, clock=clock)
    first = UnitPacer(gauge, 0, lambda: True, clock=clock, sleep=lambda s: None)
    second = UnitPacer(gauge, 1, lambda: True, clock=clock, sleep=lambda s: None)
    assert first.wait()  # worker 0 claims; its unit has no batch yet
    assert second.delay() == math.inf, "pace unknown and worker 0's unit on its way: wait"
    first.ended()  # worker 0's claim found nothing
    assert second.delay() == 0.0


def now(count) -> None:
    """Run the count of nodes right away (it runs on a thread of its own in the library)."""
    count()


def presence(mailbox, learner: str) -> Presence:
    record = Presence(mailbox, learner, uuid.uuid4().hex, renew_s=3600)
    record.start()
    return record


@pytest.fixture
def me(memory_mailbox) -> Iterator[Presence]:
    """This node's own presence record."""
    record = presence(memory_mailbox, "me")
    yield record
    record.close()


def test_the_endgame_starts_when_the_unclaimed_units_fit_in_the_nodes_buffers(memory_mailbox, me, clock):
    left = [1000]
    peers = [presence(memory_mailbox, f"peer-{i}") for i in range(3)]
    counted = CountingMailbox(memory_mailbox)
    endgame = Endgame(lambda: left[0], counted, holds=9, clock=clock, run=now)
    clock.now += ALONE_GRACE_S
    assert not endgame()
    assert counted.counts["list"] == 0, "far from the end, the nodes are not counted"
    threshold = ENDGAME_MARGIN * 9 * 4
    left[0] = threshold + 1
    clock.now += 1.0  # (the unclaimed units are counted at most every 10 ms while the end is far)
    assert not endgame() and endgame.nodes == 4
    assert counted.counts["list"] == 1
    left[0] = threshold
    clock.now += 1.0
    assert endgame()
    left[0] = 10**6  # (an elastic release): the endgame lasts
    assert endgame()
    for peer in peers:
        peer.close()


def test_a_node_alone_has_no_endgame_after_its_first_second(memory_mailbox, me, clock):
    endgame = Endgame(lambda: 3, memory_mailbox, holds=9, clock=clock, run=now)
    assert endgame(), "in its first second its peers may not have registered yet"
    clock.now += ALONE_GRACE_S
    assert not endgame(), "alone: it starts whatever it holds before anybody else could"
    peer = presence(memory_mailbox, "late")
    clock.now += pacing.NODES_RECOUNT_S
    assert endgame(), "a peer joined: counted again"
    peer.close()


def test_a_peer_registering_during_the_first_second_is_counted_when_it_ends(memory_mailbox, me, clock):
    endgame = Endgame(lambda: 3, memory_mailbox, holds=9, clock=clock, run=now)
    assert endgame() and endgame.nodes == 1
    peer = presence(memory_mailbox, "peer")
    clock.now += ALONE_GRACE_S
    assert endgame() and endgame.nodes == 2
    peer.close()


def test_a_count_of_the_nodes_that_fails_leaves_the_node_running(memory_mailbox, me, clock):
    failing = FaultyMailbox(memory_mailbox, lambda op, key: MailboxError("refused") if op == "list" else None)
    endgame = Endgame(lambda: 3, failing, holds=9, clock=clock, run=now)
    assert endgame()
    clock.now += ALONE_GRACE_S
    assert not endgame() and endgame.nodes == 1


class SlowLoop:
    """Loads one-batch units for the pacing test; nothing slow about the load itself."""

    def __call__(self, item: Item):
        yield 0, torch.tensor([item.index])


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [0, 1])
def test_in_the_endgame_a_slow_loop_holds_one_unit_ahead_not_a_buffer(tmp_path, workers):
    """One-batch units, ``prefetch=8``, a peer registered: the node never holds a buffer of units
    it has not started (claimed units stay within one of the batches the loop took)."""
    mailbox = LocalMailbox(tmp_path / "box")
    peer = presence(mailbox, "peer")
    ahead = []
    with shared_queue(
        named_units(30), mailbox=mailbox, learner_id="slow", load=SlowLoop(), prefetch=8, workers=workers
    ) as batches:
        for taken, _ in enumerate(batches, start=1):
            time.sleep(0.1)  # training: slower than a claim and a load by far
            ahead.append(len(claimed(mailbox)) - taken)
            if taken == 12:
                break
    peer.close()
    assert max(ahead) <= 2, f"units claimed beyond those the loop took, after each step: {ahead}"
