"""What the learner that holds a fragment's claim reads: beside the base, and bounded.

Its reads overlap (one transfer time, measured on the simulator's virtual clock, where a
request's time is its model's, not this machine's: a store with no latency whose every body
takes one second to carry makes the transfer times a fold waits for exact), and it absorbs at
most ``MAX_ABSORBED`` pending contributions, the rest going to the next version, each once.
"""

from __future__ import annotations

import logging

import pytest
import torch

from benchmarks._simulated_store import SimulatedMailbox, SimulatedStore, StoreModel
from benchmarks._virtual_clock import VirtualClock
from gradientmail import MemoryMailbox
from gradientmail.session.chain import BACKLOG_WARNING, MAX_ABSORBED, FragmentChain
from gradientmail.session.fragments import spec_of
from gradientmail.session.mail import Contribution

TENSORS = {"w": torch.zeros(256)}
BODY_S = 1.0
"""Seconds one stored fragment (or contribution) takes to carry, either way."""


def test_a_claim_holder_reads_the_pending_contributions_beside_the_base_in_one_transfer_time() -> None:
    clock = VirtualClock()
    store = SimulatedStore(
        MemoryMailbox("fold-transfers"),
        clock,
        StoreModel(
            latency_s=0.0, bandwidth_bytes_s=1024 / BODY_S, reads_per_s=None, writes_per_s=None, latency_spread=0.0
        ),
    )
    store.inner.clear()
    chain = {name: FragmentChain(SimulatedMailbox(store), 0, 1, spec_of(TENSORS)) for name in "abcd"}
    waited: dict[str, float] = {}

    def contribute(name: str, seq: int) -> None:
        view = chain[name].view(me=name, claim=True)
        assert view is not None
        chain[name].fold(view, name, {"w": torch.ones(256)}, Contribution(seq, 1, 1, 0.0))

    def scenario() -> None:
        chain["a"].create_base(TENSORS, "a")
        holder = chain["b"].view(me="b", claim=True)  # b claims version 1 ...
        assert holder is not None and holder.claimed
        contribute("c", 0)  # ... so c and d leave theirs pending
        contribute("d", 0)
        chain["b"].fold(holder, "b", {"w": torch.ones(256)}, Contribution(0, 1, 1, 0.0))  # version 1
        started = clock.now
        view = chain["a"].view(me="a", claim=True)  # a claims the next version: base and both pending
        waited["view"] = clock.now - started
        assert view is not None and view.claimed and len(view.absorbed) == 2

    clock.spawn(scenario)
    clock.run()
    store.inner.clear()
    # The base's download and the pending contributions' overlap (one transfer, plus the claim's
    # and the listing's bodiless round trips); read after the base, they would take two.
    assert waited["view"] == pytest.approx(BODY_S, rel=0.25)


def test_a_claim_holder_absorbs_at_most_max_absorbed_and_the_next_one_the_rest_each_once() -> None:
    mailbox = MemoryMailbox("claim-holder-bound")
    mailbox.clear()
    chain = lambda: FragmentChain(mailbox, 0, 1, spec_of(TENSORS))  # noqa: E731 - one per learner
    waiting = [f"w{i:02d}" for i in range(MAX_ABSORBED + 4)]
    chain().create_base(TENSORS, "a")
    blocker = chain()
    held = blocker.view(me="b", claim=True)
    assert held is not None and held.claimed
    for name in waiting:  # b holds version 1's claim: each leaves its contribution pending
        view = chain().view(me=name, claim=True)
        assert view is not None and view.claimed is False
        chain().fold(view, name, {"w": torch.ones(256)}, Contribution(0, 1, 1, 0.0))
    blocker.fold(held, "b", {"w": torch.ones(256)}, Contribution(0, 1, 1, 0.0))
    absorbed = []
    for name in ("x", "y"):
        view = chain().view(me=name, claim=True)
        assert view is not None and view.claimed
        absorbed.append(len(view.absorbed))
        chain().fold(view, name, {"w": torch.ones(256)}, Contribution(0, 1, 1, 0.0))
    assert absorbed == [MAX_ABSORBED, 4]
    final = chain().view(exact=True)
    mailbox.clear()
    assert final is not None and not final.absorbed
    assert set(final.base.learners) == {"b", "x", "y", *waiting}  # each contribution once
    assert torch.equal(final.base.tensors["w"], torch.full((256,), float(len(waiting) + 3)))


def test_a_backlog_that_grows_between_two_folds_of_a_learner_warns_once_naming_more_fragments(
    caplog: pytest.LogCaptureFixture,
) -> None:
    mailbox = MemoryMailbox("claim-holder-backlog")
    mailbox.clear()
    chain = lambda: FragmentChain(mailbox, 0, 1, spec_of(TENSORS))  # noqa: E731 - one per learner
    chain().create_base(TENSORS, "a")
    held = chain().view(me="b", claim=True)  # b claims version 1 and stalls: contributions pile up
    assert held is not None and held.claimed

    def leave_pending(names: list[str]) -> None:
        for name in names:
            view = chain().view(me=name, claim=True)
            assert view is not None and view.claimed is False
            chain().fold(view, name, {"w": torch.ones(256)}, Contribution(0, 1, 1, 0.0))

    watcher = chain()
    leave_pending([f"w{i:03d}" for i in range(BACKLOG_WARNING + 1)])
    with caplog.at_level(logging.WARNING, logger="gradientmail.session"):
        first = watcher.view(me="x", claim=True)  # above the bound, at a first fold: a burst?
        assert first is not None and first.claimed is False
        assert not caplog.records
        leave_pending([f"w{i:03d}" for i in range(BACKLOG_WARNING + 1, BACKLOG_WARNING + 3)])
        watcher.view(me="x", claim=True)  # still above it at the next, and more: warned
        assert len(caplog.records) == 1
        watcher.view(me="x", claim=True)  # once
    mailbox.clear()
    warnings = [record.getMessage() for record in caplog.records]
    assert len(warnings) == 1, warnings
    assert f"{BACKLOG_WARNING + 3} contributions of other learners wait" in warnings[0]
    assert "more fragments" in warnings[0] and "Session(fragments=" in warnings[0]
