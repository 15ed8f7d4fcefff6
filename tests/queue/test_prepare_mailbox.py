"""The store check: the node that creates run.json probes the store in full, and a store that
ignores conditional writes is refused before any claim."""

from __future__ import annotations

import json
import uuid

import pytest
from queue_loads import claimed_ids, load_item
from queue_nodes import named_units

from gradientmail import MemoryMailbox, SharedQueueDataset
from gradientmail.errors import (
    UnsafeStoreError,
)
from gradientmail.layout import RUN_KEY
from gradientmail.mailbox.wrappers import CountingMailbox
from gradientmail.patterns.shared_queue import shared_queue
from gradientmail.run_record import prepare_mailbox

pytestmark = pytest.mark.timeout(60)


class IgnoresConditions(MemoryMailbox):
    """A store that silently overwrites on put_if_absent, like some S3-compatible servers."""

    def put_if_absent(self, key, data):
        self.put(key, data)
        return True


@pytest.mark.parametrize("workers", [0])
def test_store_without_conditional_writes_is_refused_before_any_claim(workers):
    mailbox = IgnoresConditions("unsafe-store-test")
    try:
        with pytest.raises(UnsafeStoreError):
            with shared_queue(named_units(3), mailbox=mailbox, learner_id="a", load=load_item, workers=workers):
                pass
        with pytest.raises(UnsafeStoreError):
            list(SharedQueueDataset(named_units(3), mailbox=mailbox, learner_id="a", load=load_item))
        assert claimed_ids(mailbox) == []
    finally:
        mailbox.clear()


def test_only_the_node_that_creates_run_json_probes_the_store(memory_mailbox):
    units = named_units(1)
    first, second, third = (CountingMailbox(memory_mailbox) for _ in range(3))
    prepare_mailbox(first, len(units))
    # run.json created, then verify_mailbox: probe created twice, read back, deleted.
    assert dict(first.counts) == {"put_if_absent": 3, "get": 1, "delete": 1}
    prepare_mailbox(second, len(units))
    prepare_mailbox(third, len(units))
    # Refused a duplicate run.json (the evidence the probe looks for), then read it back.
    assert dict(second.counts) == dict(third.counts) == {"put_if_absent": 1, "get": 1}
    assert json.loads(memory_mailbox.get(RUN_KEY))["units"] == 1
    assert list(memory_mailbox.list("")) == [RUN_KEY], "no probe key left behind"


def test_every_node_probes_a_store_that_ignores_conditions_and_is_refused():
    mailbox = IgnoresConditions(f"unsafe-every-node-{uuid.uuid4().hex}")
    try:
        mailbox.put(RUN_KEY, b"{}")  # as if an earlier node had created it
        for learner in ("a", "b", "c"):
            counted = CountingMailbox(mailbox)
            dataset = SharedQueueDataset(
                named_units(3), mailbox=counted, learner_id=learner, load=load_item, resume=False
            )
            with pytest.raises(UnsafeStoreError, match="second put_if_absent"):
                list(dataset)
            assert counted.counts["put_if_absent"] == 3, "run.json 'created' again, so the full probe ran"
        assert claimed_ids(mailbox) == []
    finally:
        mailbox.clear()


class RefusesEverything(MemoryMailbox):
    """A broken store: every create reports that the key already exists, and writes nothing."""

    def put_if_absent(self, key, data):
        return False


def test_a_store_that_refuses_every_create_is_refused():
    mailbox = RefusesEverything(f"refuses-{uuid.uuid4().hex}")
    try:
        with pytest.raises(UnsafeStoreError, match="run.json.*cannot be read"):
            list(SharedQueueDataset(named_units(3), mailbox=mailbox, learner_id="a", load=load_item))
        with pytest.raises(UnsafeStoreError, match="run.json"):
            with shared_queue(named_units(3), mailbox=mailbox, learner_id="a", load=load_item, workers=0):
                pass
    finally:
        mailbox.clear()
