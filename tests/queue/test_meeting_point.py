"""A learner's queue and Session meet by their store's identity and learner id, never by how the
store prints."""

from __future__ import annotations

import json
import uuid

import torch
from session_toys import exchange, scalar, session  # tests/helpers/ is on sys.path (tests/conftest.py)

from gradientmail import LocalMailbox, MemoryMailbox, SharedQueueDataset, units_claimed_by
from gradientmail.mailbox.base import describe
from gradientmail.mailbox.wrappers import CountingMailbox, MailboxWrapper
from gradientmail.meeting_point import meeting_point


class Unnamed(MemoryMailbox):
    """A store without a URL that prints like every other one of its kind."""

    url = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return "Unnamed()"


def _queue(mailbox: MemoryMailbox | LocalMailbox, learner: str) -> SharedQueueDataset:
    return SharedQueueDataset({"a": 0, "b": 1}, mailbox=mailbox, learner_id=learner, load=lambda unit: iter(()))


def test_stores_that_print_alike_do_not_meet():
    learner = f"meet-{uuid.uuid4().hex[:8]}"
    queued, other = Unnamed(f"q-{learner}"), Unnamed(f"o-{learner}")
    assert describe(queued) == describe(other)  # one description, two stores
    _queue(queued, learner)
    assert meeting_point(queued, learner).queue_figures().units == 0, "the queue reports where it runs"
    assert meeting_point(other, learner).queue_figures().units is None, "another store sees no queue"
    assert meeting_point(other, learner).gate is not meeting_point(queued, learner).gate


def test_wrapped_stores_that_print_alike_do_not_meet():
    """A wrapper (a request counter, say) reaches its store by the store's identity, not by how it prints."""
    learner = f"meet-{uuid.uuid4().hex[:8]}"
    queued, other = MailboxWrapper(Unnamed(f"q-{learner}")), MailboxWrapper(Unnamed(f"o-{learner}"))
    assert describe(queued) == describe(other)  # one description, two stores
    _queue(queued, learner)
    assert meeting_point(queued, learner).queue_figures().units == 0, "the queue reports where it runs"
    assert meeting_point(other, learner).queue_figures().units is None, "another store sees no queue"


def test_a_wrapper_meets_the_store_it_wraps():
    learner = f"meet-{uuid.uuid4().hex[:8]}"
    store = Unnamed(f"s-{learner}")
    _queue(CountingMailbox(store), learner)  # the queue's requests counted, the Session's not
    assert meeting_point(store, learner).queue_figures().units == 0
    assert meeting_point(MailboxWrapper(store), learner) is meeting_point(store, learner)


def test_two_mailbox_objects_over_one_store_meet(tmp_path):
    learner = f"meet-{uuid.uuid4().hex[:8]}"
    _queue(LocalMailbox(tmp_path / "run", create=True), learner)
    again = LocalMailbox(tmp_path / "run")  # as a Session given its own mailbox object would
    assert meeting_point(again, learner).queue_figures().units == 0
    assert meeting_point(again, learner) is meeting_point(LocalMailbox(tmp_path / "run"), learner)


def test_each_learner_meets_its_own_queue():
    run = f"meet-{uuid.uuid4().hex[:8]}"  # units_claimed_by counts per learner id, process-wide
    box = MemoryMailbox(run)
    _queue(box, f"{run}-0")
    assert meeting_point(box, f"{run}-0").queue_figures().units == 0
    assert meeting_point(box, f"{run}-1").queue_figures().units is None


def test_a_learner_s_claims_on_another_store_are_not_reported_here():
    learner = f"meet-{uuid.uuid4().hex[:8]}"
    elsewhere, here = MemoryMailbox(f"e-{learner}"), MemoryMailbox(f"h-{learner}")
    assert list(_queue(elsewhere, learner)) == []  # claims both units; they hold no batch
    _queue(here, learner)
    assert meeting_point(here, learner).queue_figures().units == 0, "this store's queue claimed nothing"
    assert meeting_point(elsewhere, learner).queue_figures().units == 2
    assert units_claimed_by(learner) == 2  # the learner's claims in this process, every store


def test_the_progress_record_holds_what_the_learners_queue_hands_over(memory_mailbox):
    # The queue reports its figures to the Session through their meeting point: the record
    # shows no units before this learner has a queue on the store, then the units it claimed.
    learner = f"counted-{uuid.uuid4().hex[:8]}"  # units_claimed_by counts per learner id, process-wide
    model = scalar()
    with session(model, memory_mailbox, learner) as s:
        exchange(s, model, 1.0)
        assert json.loads(memory_mailbox.get(f"progress/{learner}.json"))["units"] is None
        units = {f"u{i}": i for i in range(3)}
        dataset = SharedQueueDataset(
            units, mailbox=memory_mailbox, learner_id=learner, load=lambda i: [(i, torch.zeros(1))]
        )
        assert [step for step, _ in dataset] == [0, 1, 2]
        exchange(s, model, 1.0)
        record = json.loads(memory_mailbox.get(f"progress/{learner}.json"))
    assert record["units"] == 3
