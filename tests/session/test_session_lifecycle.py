"""A Session's life: entering writes a first progress record, each exchange another, exit folds
the final progress and leaves the member list, paying what it owed; misuse is an error.
"""

from __future__ import annotations

import json
import time

import pytest
from session_toys import (  # tests/helpers/ is on sys.path (tests/conftest.py)
    exchange,
    linear,
    push,
    scalar,
    session,
    stored_spec,
    value,
)

from gradientmail import DuplicateLearnerError, SessionError
from gradientmail.layout import member_key, state_key
from gradientmail.session import consensus
from gradientmail.session.chain import KEEP, TOMBSTONE, FragmentChain
from gradientmail.session.mail import decode

pytestmark = pytest.mark.timeout(60)


def test_exit_folds_the_final_progress_and_leaves_the_member_list(local_mailbox):
    model = scalar()
    with session(model, local_mailbox, learner="node-0") as s:
        assert list(local_mailbox.list("session/members/"))[0].startswith("session/members/node-0.")
        for _ in range(5):
            exchange(s, model, 1.0, samples=16)
        push(model, 2.0)  # progress after the last exchange
    assert value(model) == 7.0
    assert list(local_mailbox.list("session/members/")) == []
    result = scalar()
    assert consensus(local_mailbox, result) == {"node-0": 80}
    assert value(result) == 7.0
    newest = FragmentChain(local_mailbox, 0, 1, {}).list_versions()[-1]
    header = decode(local_mailbox.get(state_key(newest)), key="k", spec=stored_spec(model)).header
    assert header.learners["node-0"].final and header.learners["node-0"].step == 5
    record = json.loads(local_mailbox.get("progress/node-0.json"))
    assert set(record) == {
        "learner",
        "steps",
        "samples",
        "samples_in_run",
        "samples_per_s",
        "units",
        "started",
        "last_seen",
        "finished",
    }
    assert record["learner"] == "node-0" and record["finished"] is True
    assert record["steps"] == 5 and record["samples"] == 80 and record["samples_per_s"] > 0
    assert record["samples_in_run"] == 80  # the final fold holds every sample
    assert record["started"] <= record["last_seen"]


def test_progress_is_written_at_each_exchange(memory_mailbox):
    with session(linear(), memory_mailbox, learner="n") as s:
        s.step(samples=3)
        s.wait()
        first = json.loads(memory_mailbox.get("progress/n.json"))
        s.step(samples=3)
        s.wait()
        second = json.loads(memory_mailbox.get("progress/n.json"))
    assert (first["steps"], first["samples"], first["finished"]) == (1, 3, False)
    assert (second["steps"], second["samples"]) == (2, 6)


def test_entering_writes_a_first_progress_record(memory_mailbox):
    # `gradientmail status` lists a learner from the start, not from its first exchange.
    with session(linear(), memory_mailbox, learner="n", every_steps=1000):
        record = json.loads(memory_mailbox.get("progress/n.json"))
    assert (record["learner"], record["steps"], record["finished"]) == ("n", 0, False)


def test_a_learner_counts_once_in_n_whatever_member_keys_earlier_incarnations_left(memory_mailbox):
    memory_mailbox.put(member_key("n", time.time() - 1), b"{}")  # left by a crashed run of "n"
    model, peer_model = scalar(), scalar()
    with session(model, memory_mailbox, learner="n") as s, session(peer_model, memory_mailbox, "peer"):
        assert len(list(memory_mailbox.list("session/members/n."))) == 2  # nothing of it deleted
        exchange(s, model, 4.0)
        assert value(model) == 2.0  # N = 2: "n" and "peer", not 3


def test_a_second_session_under_a_live_learner_id_is_refused_before_it_writes_anything(memory_mailbox):
    live_model, peer_model = scalar(), scalar()
    with session(live_model, memory_mailbox, "live") as live, session(peer_model, memory_mailbox, "peer") as peer:
        keys = set(memory_mailbox.list())
        with pytest.raises(DuplicateLearnerError, match="'live' is already running in this process: a Session"):
            with session(scalar(), memory_mailbox, "live"):
                pytest.fail("a second Session of a live learner entered")
        assert set(memory_mailbox.list()) == keys  # nothing written, nothing deleted
        exchange(peer, peer_model, 4.0)
        assert value(peer_model) == 2.0  # N is still 2: the live learner counts
        exchange(live, live_model)


def test_step_outside_the_context_and_double_enter_are_errors(memory_mailbox):
    s = session(linear(), memory_mailbox)
    with pytest.raises(SessionError, match="inside"):
        s.step(samples=1)
    with s:
        with pytest.raises(SessionError, match="already entered"):
            s.__enter__()
    with pytest.raises(SessionError, match="inside"):
        s.step(samples=1)


def test_joining_exchanging_and_leaving_are_logged(memory_mailbox, caplog):
    model = linear()
    with caplog.at_level("DEBUG", logger="gradientmail"):
        with session(model, memory_mailbox, "logged") as s:
            exchange(s, model, 1.0)
    messages = [record.getMessage() for record in caplog.records if record.name == "gradientmail.session"]
    assert any(m.startswith("logged joined the run") for m in messages), messages
    assert any(m.startswith("logged exchange 1: version") for m in messages), messages
    assert any(m.startswith("logged left the run") for m in messages), messages


@pytest.mark.parametrize("exchanges", [1, 3, 6, 9])
def test_a_learner_that_leaves_pays_the_retirements_it_owed(memory_mailbox, monkeypatch, exchanges):
    # A lone writer builds on the versions it holds and downloads only every KEEP folds: the
    # versions it wrote since then were not yet proved superseded. Leaving pays them, so the
    # store keeps the last KEEP versions, as documented, however the last folds fell.
    monkeypatch.setenv("GRADIENTMAIL_SESSION_RETIRE_AFTER_S", "0")
    model = scalar()
    with session(model, memory_mailbox, "alone") as s:
        for _ in range(exchanges):
            exchange(s, model, 1.0)
    versions = FragmentChain(memory_mailbox, 0, 1, {}).list_versions()
    live = [v for v in versions if memory_mailbox.get(state_key(v)) != TOMBSTONE]
    assert live == versions[-KEEP:]
