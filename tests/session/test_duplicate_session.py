"""One live process per learner id, for a Session without ``shared_queue``: two copies of one
script on one host with no launcher rank both default to ``{host}-0``; the second is refused.

Real processes (``duplicate_session_nodes``) on one ``LocalMailbox``. The first node trains one
batch and waits for the test, so the second starts while the first is certainly alive; the
second must stop with ``DuplicateLearnerError`` inside ``Session.__enter__``, before it writes
anything but its look at the presence record, and the run must hold exactly the first node's
samples. A restart after a SIGKILL is admitted.
"""

from __future__ import annotations

import multiprocessing
import queue

import pytest
import torch
from duplicate_session_nodes import SESSION_STEPS, STEPS, UNITS, SessionNode, run
from process_harness import join_all

from gradientmail import LocalMailbox, Session, consensus
from gradientmail.learner_id import default_learner_id

pytestmark = pytest.mark.timeout(120)

EXPECTED = {"session": SESSION_STEPS, "dataloader": UNITS * STEPS}
"""Samples the run holds when only the first node trains."""


def _event(events: queue.Queue) -> tuple:
    try:
        return events.get(timeout=60)
    except queue.Empty:
        pytest.fail("a node process neither entered, finished nor was refused")


def _default_id(monkeypatch) -> str:
    for name in ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "GRADIENTMAIL_LEARNER_ID"):
        monkeypatch.delenv(name, raising=False)
    return default_learner_id()


@pytest.mark.parametrize("mode", ["session", "dataloader"])
def test_a_second_process_under_the_default_learner_id_is_refused_before_it_writes(tmp_path, monkeypatch, mode):
    learner = _default_id(monkeypatch)
    context = multiprocessing.get_context("fork")
    events, go = context.Queue(), context.Event()
    box = str(tmp_path / "box")
    first = context.Process(target=run, args=(SessionNode(box, mode, events, go=go),))
    first.start()
    try:
        assert _event(events) == ("entered", first.pid)
        second = context.Process(target=run, args=(SessionNode(box, mode, events),))
        second.start()
        kind, pid, *rest = _event(events)
        assert (kind, pid) == ("refused", second.pid), f"the second process was not refused: {kind} {rest}"
        message, written = rest
        assert f"learner {learner!r} is already running" in message
        assert f"pid {first.pid}" in message
        assert "learner_id=" in message and "RANK" in message, message
        assert written == [], f"the refused process wrote {written}"
    finally:
        go.set()
    assert join_all([first, second], 60) == [0, 0]
    assert _event(events) == ("finished", first.pid, EXPECTED[mode])
    assert consensus(LocalMailbox(box), torch.nn.Linear(1, 1, bias=False)) == {learner: EXPECTED[mode]}


def test_a_session_restarted_after_a_crash_is_admitted(tmp_path, monkeypatch):
    learner = _default_id(monkeypatch)
    context = multiprocessing.get_context("fork")
    events = context.Queue()
    box = str(tmp_path / "box")
    killed = context.Process(target=run, args=(SessionNode(box, "session", events, kill_after_entering=True),))
    killed.start()
    assert _event(events) == ("entered", killed.pid)
    assert join_all([killed], 60) == [-9]
    restart = context.Process(target=run, args=(SessionNode(box, "session", events),))
    restart.start()
    assert _event(events) == ("entered", restart.pid)
    assert _event(events) == ("finished", restart.pid, SESSION_STEPS)
    assert join_all([restart], 60) == [0]
    assert learner in consensus(LocalMailbox(box), torch.nn.Linear(1, 1, bias=False))


def test_one_process_reuses_its_learner_id_once_each_holder_has_left(tmp_path):
    """A notebook re-running a cell, and a Session beside the learner's queue, in one process."""
    from gradientmail.patterns.shared_queue import shared_queue

    box = LocalMailbox(tmp_path / "box")
    units = {f"{i:03d}": i for i in range(4)}
    for _ in range(2):  # the same cell, run twice
        model = torch.nn.Linear(1, 1, bias=False)
        session = Session(model, mailbox=box, learner_id="cell")
        with (
            session,
            shared_queue(
                units, mailbox=box, learner_id="cell", load=lambda i: [(0, torch.tensor(i))], workers=0
            ) as got,
        ):
            for _ in got:
                session.step(samples=1)
    assert consensus(box, torch.nn.Linear(1, 1, bias=False)) == {"cell": 4}
