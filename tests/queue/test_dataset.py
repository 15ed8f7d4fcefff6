"""SharedQueueDataset on its own: every unit once, in each node's order, claims counted, in a
user's own DataLoader."""

from __future__ import annotations

import json
import multiprocessing
from array import array

import pytest
from queue_loads import load_item
from queue_nodes import claims, named_units
from torch.utils.data import DataLoader

import gradientmail
from gradientmail import MemoryMailbox, SharedQueueDataset, units_claimed_by
from gradientmail.layout import RUN_KEY
from gradientmail.meeting_point import meeting_point, store_identity
from gradientmail.patterns.shared_queue import shared_queue
from gradientmail.queue.claim_index import ClaimIndex, PositionOrder

FORK = multiprocessing.get_context("fork")

pytestmark = pytest.mark.timeout(60)


def test_dataset_iterates_every_unit_in_order(memory_mailbox):
    units = named_units(5, steps=3)
    dataset = SharedQueueDataset(units, mailbox=memory_mailbox, learner_id="solo", load=load_item)
    batches = [(step, tuple(int(v) for v in tensor)) for step, tensor in dataset]
    assert batches == [(s, (i, s)) for i in range(5) for s in range(3)]
    assert {ident: claim["learner"] for ident, claim in claims(memory_mailbox).items()} == dict.fromkeys(units, "solo")
    run = json.loads(memory_mailbox.get(RUN_KEY))
    assert run["units"] == 5 and run["created"] > 0
    assert list(dataset) == [], "every unit is claimed: a second pass finds no work"


def test_claim_body_fields(memory_mailbox):
    dataset = SharedQueueDataset(named_units(1), mailbox=memory_mailbox, learner_id="node-3", load=load_item)
    list(dataset)
    claim = claims(memory_mailbox)["00000"]
    assert set(claim) >= {"learner", "token", "host", "pid", "worker", "claimed_at"}
    assert claim["learner"] == "node-3" and claim["worker"] is None and len(claim["token"]) == 32


def test_order_is_each_nodes_preference(memory_mailbox):
    units = named_units(4)
    order = ["00002", "00000", "00003", "00001"]
    dataset = SharedQueueDataset(units, mailbox=memory_mailbox, learner_id="a", load=load_item, order=order)
    assert [int(t[0]) for _, t in dataset] == [2, 0, 3, 1]


def test_nodes_skip_units_claimed_by_others(memory_mailbox):
    units = named_units(6)
    first = iter(SharedQueueDataset(units, mailbox=memory_mailbox, learner_id="a", load=load_item))
    second = iter(SharedQueueDataset(units, mailbox=memory_mailbox, learner_id="b", load=load_item))
    got = {"a": [], "b": []}
    for _ in range(3):
        got["a"].append(int(next(first)[1][0]))
        got["b"].append(int(next(second)[1][0]))
    assert list(first) == [] and list(second) == []
    assert sorted(got["a"] + got["b"]) == list(range(6))
    assert units_claimed_by("a") >= 3


def test_units_claimed_by_counts_this_process():
    mailbox = MemoryMailbox("claimed-by-test")
    try:
        before = units_claimed_by("counted")
        list(SharedQueueDataset(named_units(7), mailbox=mailbox, learner_id="counted", load=load_item))
        assert units_claimed_by("counted") - before == 7
        assert units_claimed_by("nobody-ever") == 0
    finally:
        mailbox.clear()


def test_dataset_in_users_own_dataloader_with_workers(local_mailbox):
    units = named_units(30, steps=2)
    dataset = SharedQueueDataset(units, mailbox=local_mailbox, learner_id="dl", load=load_item)
    before = units_claimed_by("dl")
    loader = DataLoader(dataset, batch_size=None, num_workers=2, multiprocessing_context=FORK)
    pairs = [(int(tensor[0]), step) for step, tensor in loader]
    assert sorted(pairs) == [(i, s) for i in range(30) for s in range(2)]
    assert units_claimed_by("dl") - before == 30, "claims in worker processes are counted"
    workers = {claim["worker"] for claim in claims(local_mailbox).values()}
    assert workers <= {0, 1}


def test_empty_mapping_yields_nothing_and_claims_nothing(memory_mailbox):
    assert list(SharedQueueDataset({}, mailbox=memory_mailbox, learner_id="a", load=load_item)) == []
    with shared_queue({}, mailbox=memory_mailbox, learner_id="a", load=load_item, workers=0) as batches:
        assert list(batches) == []
    assert list(memory_mailbox.list()) == []


def test_exported_from_package():
    assert gradientmail.SharedQueueDataset is SharedQueueDataset
    assert gradientmail.shared_queue is shared_queue


def test_a_copy_for_another_node_counts_its_claims_as_that_node(memory_mailbox):
    """A copy that claims as node-1 counts its units as node-1's on the store (the figure node-1's
    Session reports), and none as the original's node-0."""
    units = named_units(3, steps=1)
    index = ClaimIndex(list(units))
    first = SharedQueueDataset(
        units, mailbox=memory_mailbox, learner_id="node-0", load=load_item, claim_index=index, resume=False
    )
    second = first.for_node(mailbox=memory_mailbox, learner_id="node-1", order=PositionOrder(index, [0, 1, 2]))
    assert len(list(second)) == 3
    store = store_identity(memory_mailbox)
    assert (units_claimed_by("node-1", store), units_claimed_by("node-0", store)) == (3, 0)
    assert (second.units_claimed(), first.units_claimed()) == (3, 0)
    assert meeting_point(memory_mailbox, "node-1").queue_figures().units == 3


def test_a_copy_for_another_node_claims_under_its_own_name_and_order(memory_mailbox):
    units = named_units(4, steps=1)
    index = ClaimIndex(list(units))
    first = SharedQueueDataset(
        units, mailbox=memory_mailbox, learner_id="node-0", load=load_item, claim_index=index, resume=False
    )
    backwards = PositionOrder(index, array("i", reversed(range(len(index)))))
    second = first.for_node(mailbox=memory_mailbox, learner_id="node-1", order=backwards)
    assert (first.learner_id, list(first.order)) == ("node-0", list(units))  # the original is unchanged
    next(iter(second))  # node-1 claims the last unit first: its own order
    assert {ident: claim["learner"] for ident, claim in claims(memory_mailbox).items()} == {"00003": "node-1"}
    with pytest.raises(ValueError, match="claim_index"):
        first.for_node(
            mailbox=memory_mailbox, learner_id="node-2", order=PositionOrder(ClaimIndex(list(units)), [0, 1, 2, 3])
        )
