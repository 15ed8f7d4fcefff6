"""One live process per learner_id: a second one is refused, in every mode,
and a restart after a crash is not.

Real node processes (``handover_nodes``) on a ``LocalMailbox``; the first node pauses at a known
batch and waits for the test, so the second starts while the first is certainly alive. The
judgement of records from another machine runs on a fake clock.
"""

from __future__ import annotations

import json
import multiprocessing
import queue
from collections import Counter

import pytest
import torch
from handover_nodes import Node, consumed, finish, start, written_positions
from queue_nodes import named_units

from gradientmail import DuplicateLearnerError, LocalMailbox
from gradientmail.layout import learner_key
from gradientmail.patterns.shared_queue import shared_queue
from gradientmail.presence import Presence

pytestmark = pytest.mark.timeout(90)

MODES = {"plain": {}, "resume": {"resume": True}, "lease": {"lease_s": 30.0}}
ALL = {(i, p) for i in range(10) for p in range(6)}  # 10 units x 6 batches = 60


def _event(events: queue.Queue, timeout: float = 60) -> tuple:
    try:
        return events.get(timeout=timeout)
    except queue.Empty:
        pytest.fail("a node process neither paused, finished nor was refused")


def _seen(out) -> Counter:
    return Counter(pair for pairs in consumed(out).values() for pair in pairs)


@pytest.mark.parametrize("mode", list(MODES))
def test_a_second_process_under_a_live_learner_id_is_refused(tmp_path, mode):
    box = LocalMailbox(tmp_path / "box")
    units = named_units(10)
    context = multiprocessing.get_context("fork")
    events, go = context.Queue(), context.Event()
    first = Node(box, "node-1", units, str(tmp_path), pause_after=5, events=events, go=go, **MODES[mode])
    [running] = start([first])
    try:
        assert _event(events)[0] == "paused"
        second = Node(box, "node-1", units, str(tmp_path), events=events, **MODES[mode])
        [duplicate] = start([second])
        finish([duplicate])
        kind, pid, *message = _event(events)
        assert (kind, pid) == ("refused", duplicate.pid), "the second incarnation was not refused"
        assert "learner 'node-1' is already running in this run" in message[0]
        assert f"pid {running.pid}" in message[0] and "give each process its own learner_id" in message[0]
    finally:
        go.set()
        finish([running])
    assert _event(events) == ("done", running.pid)
    seen = _seen(tmp_path)
    assert set(seen) == ALL and sum(seen.values()) == 60, "0 duplicates, nothing lost"


def test_of_several_started_at_once_exactly_one_runs(tmp_path):
    box = LocalMailbox(tmp_path / "box")
    units = named_units(10)
    context = multiprocessing.get_context("fork")
    events, go = context.Queue(), context.Event()
    nodes = [
        Node(box, "node-1", units, str(tmp_path), resume=True, lease_s=30.0, pause_after=3, events=events, go=go)
        for _ in range(3)
    ]
    processes = start(nodes, together=True)
    try:
        reports = [_event(events) for _ in nodes]
        assert sorted(kind for kind, *_ in reports) == ["paused", "refused", "refused"], reports
    finally:
        go.set()
        finish(processes)
    seen = _seen(tmp_path)
    assert set(seen) == ALL and sum(seen.values()) == 60


@pytest.mark.parametrize("mode", ["resume", "plain"])
def test_a_restart_after_sigkill_is_allowed(tmp_path, mode):
    """The dead incarnation's record still says running, but its process is gone."""
    box = LocalMailbox(tmp_path / "box")
    units = named_units(10)
    options = {"resume": True, "lease_s": 30.0} if mode == "resume" else {}
    finish(start([Node(box, "node-1", units, str(tmp_path), kill_after=8, **options)]), killed=1)
    assert json.loads(box.get(learner_key("node-1")))["state"] == "running"
    context = multiprocessing.get_context("fork")
    events = context.Queue()
    finish(start([Node(box, "node-1", units, str(tmp_path), run=2, events=events, **options)]))
    assert _event(events)[0] == "done", "the restart was refused"
    seen = _seen(tmp_path)
    if mode == "resume":
        assert set(seen) == ALL, "the restart resumed every unfinished unit"
        dead = next(p for name, p in consumed(tmp_path).items() if name.startswith("consumed-node-1-1-"))
        written = written_positions(tmp_path, "node-1")
        in_flight = sum(1 for index, position in dead if position > written.get(index, -1))
        assert sum(seen.values()) - len(seen) <= in_flight
    else:
        assert max(seen.values()) == 1  # the dead node's claims stay claimed in the design note's mode
    assert json.loads(box.get(learner_key("node-1")))["state"] == "stopped"


# -- records of this process and of other machines ----------------------------------------------
class FakeTime:
    """Monotonic and wall clocks that advance only when the code under test sleeps."""

    def __init__(self, on_sleep=lambda: None) -> None:
        self.now = 1000.0
        self.on_sleep = on_sleep

    def clock(self) -> float:
        return self.now

    def wall(self) -> float:
        return 1_700_000_000.0 + self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        self.on_sleep()


def _elsewhere(box, fake: FakeTime, beat: int = 1, state: str = "running", age: float = 2.0) -> None:
    box.put(
        learner_key("node-1"),
        json.dumps(
            {
                "learner": "node-1",
                "incarnation": "theirs",
                "state": state,
                "beat": beat,
                "time": fake.wall() - age,
                "renew_s": 10.0,
                "host": "other-host",
                "boot": "b",
                "pidns": "pid:[1]",
                "pid": 4242,
                "pid_start": 7,
            }
        ).encode(),
    )


def _presence(box, fake: FakeTime, incarnation: str = "mine") -> Presence:
    return Presence(box, "node-1", incarnation, renew_s=3600, clock=fake.clock, sleep=fake.sleep, wall=fake.wall)


def test_a_renewed_record_from_another_machine_is_alive(memory_mailbox):
    beats = iter(range(2, 100))
    fake = FakeTime()
    fake.on_sleep = lambda: _elsewhere(memory_mailbox, fake, beat=next(beats))  # it renews
    _elsewhere(memory_mailbox, fake)
    with pytest.raises(DuplicateLearnerError, match=r"already running .*host other-host pid 4242") as caught:
        _presence(memory_mailbox, fake).start()
    assert (caught.value.learner, caught.value.host, caught.value.pid) == ("node-1", "other-host", 4242)
    assert json.loads(memory_mailbox.get(learner_key("node-1")))["incarnation"] == "theirs"


def test_an_unchanged_record_from_another_machine_expires(memory_mailbox, caplog):
    fake = FakeTime()
    _elsewhere(memory_mailbox, fake)
    began = fake.now
    presence = _presence(memory_mailbox, fake)
    with caplog.at_level("WARNING", logger="gradientmail"):
        presence.start()
    # Said right away, at WARNING: what it waits for, how long, and what to do about it.
    [said] = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert "host other-host pid 4242" in said and "up to 30 s" in said and "default_learner_id()" in said
    assert fake.now - began >= 30, "watched for three of its renewal intervals first"
    assert json.loads(memory_mailbox.get(learner_key("node-1")))["incarnation"] == "mine"
    presence.close()
    assert json.loads(memory_mailbox.get(learner_key("node-1")))["state"] == "stopped"


def test_a_live_learner_whose_clock_runs_an_hour_behind_is_refused_not_taken_over(memory_mailbox):
    """Its record's date is an hour old by this machine's clock, but it renews: only watching
    tells a live writer from a dead one, so the date alone never lets a second process in."""
    beats = iter(range(2, 100))
    fake = FakeTime()
    fake.on_sleep = lambda: _elsewhere(memory_mailbox, fake, beat=next(beats), age=3600)
    _elsewhere(memory_mailbox, fake, age=3600)
    with pytest.raises(DuplicateLearnerError, match=r"already running .*host other-host pid 4242"):
        _presence(memory_mailbox, fake).start()
    assert json.loads(memory_mailbox.get(learner_key("node-1")))["incarnation"] == "theirs"


def test_an_old_record_from_another_machine_is_watched_then_taken_over(memory_mailbox):
    fake = FakeTime()
    _elsewhere(memory_mailbox, fake, age=3600)  # its date is old: a dead writer, or a clock behind
    began = fake.now
    presence = _presence(memory_mailbox, fake)
    presence.start()
    assert fake.now - began >= 30, "watched for three of its renewal intervals first"
    assert json.loads(memory_mailbox.get(learner_key("node-1")))["incarnation"] == "mine"
    presence.close()


def test_stopped_or_unreadable_records_do_not_block(memory_mailbox):
    fake = FakeTime()
    for arrange in (
        lambda: _elsewhere(memory_mailbox, fake, state="stopped"),
        lambda: memory_mailbox.put(learner_key("node-1"), b"[" * 100_000),
    ):
        arrange()
        began = fake.now
        presence = _presence(memory_mailbox, fake)
        if memory_mailbox.get(learner_key("node-1")).startswith(b"["):
            with pytest.warns(UserWarning, match="not one this library wrote"):
                presence.start()
        else:
            presence.start()
        assert fake.now == began, "judged without waiting"
        presence.close()


def test_an_open_queue_in_this_process_is_alive_until_closed(memory_mailbox):
    fake = FakeTime()
    first = _presence(memory_mailbox, fake, "one")
    first.start()
    with pytest.raises(DuplicateLearnerError, match="already running in this process: a shared_queue"):
        _presence(memory_mailbox, fake, "two").start()
    first.close()
    second = _presence(memory_mailbox, fake, "two")
    second.start()
    second.close()


# -- an incarnation that was replaced stops ---------------------------------
def test_a_nested_shared_queue_is_told_it_runs_in_this_very_process(memory_mailbox):
    """Not "already running (host h pid <its own pid>)", which reads like another process."""
    load = lambda n: [(0, torch.tensor([n]))]  # noqa: E731
    units = {"a": 1, "b": 2}
    with shared_queue(units, mailbox=memory_mailbox, learner_id="n0", load=load, workers=0):
        with pytest.raises(DuplicateLearnerError, match="in this process") as caught:
            with shared_queue(units, mailbox=memory_mailbox, learner_id="n0", load=load, workers=0):
                pass
    assert "give this one its own learner_id" in str(caught.value)


def test_a_reader_whose_clock_runs_minutes_ahead_watches_before_taking_over(memory_mailbox):
    """Two minutes of skew used to make a fresh record look 'long dead' at once."""
    fake = FakeTime()
    _elsewhere(memory_mailbox, fake, age=120)  # written 2 s ago by its clock, 120 s by ours
    began = fake.now
    presence = _presence(memory_mailbox, fake)
    presence.start()  # the record does not change while watched: then, and only then, dead
    assert fake.now - began >= 30
    presence.close()


def test_a_paused_incarnation_replaced_meanwhile_stops_at_its_next_batch(memory_mailbox):
    """SIGSTOP for longer than its peers wait, a replacement registered meanwhile: on resuming,
    the first check confirms ownership with the store, finds the record taken, and raises."""
    fake = FakeTime()
    paused = _presence(memory_mailbox, fake, "paused")
    paused.start()
    paused.check()  # fresh: no request, no error
    replacement = _presence(memory_mailbox, FakeTime(), "replacement")
    _take_over(memory_mailbox, replacement)
    fake.now += 4 * 3600  # the pause, longer than three renewals
    with pytest.raises(DuplicateLearnerError, match="was replaced by another process") as caught:
        paused.check()
    assert caught.value.learner == "node-1"
    with pytest.raises(DuplicateLearnerError):
        paused.check()  # for good
    paused.close()
    record = json.loads(memory_mailbox.get(learner_key("node-1")))
    assert (record["incarnation"], record["state"]) == ("replacement", "running")  # left alone
    replacement.close()


def _take_over(box, presence: Presence) -> None:
    """Register ``presence`` over the live record, as a replacement that judged it dead does."""
    record = json.loads(box.get(learner_key("node-1")))
    box.put(learner_key("node-1"), json.dumps({**record, "state": "stopped"}).encode())
    presence.start()
