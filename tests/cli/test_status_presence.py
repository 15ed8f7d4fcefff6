"""``gradientmail status`` of a learner that died without a lease: its presence record stops
being renewed, and status says when it was last seen and that it may be dead, not "running".

A real process (``duplicate_session_nodes``) trains one batch in a Session and SIGKILLs itself;
the run is then read as it stands, and as a reader 47 minutes later reads it.
"""

from __future__ import annotations

import io
import multiprocessing
import time

import pytest
from duplicate_session_nodes import SessionNode, run
from process_harness import join_all

from gradientmail import LocalMailbox
from gradientmail.cli import status_table
from gradientmail.learner_id import default_learner_id
from gradientmail.status import RunReader, read_run

pytestmark = pytest.mark.timeout(120)

LATER_S = 47 * 60


def render(table) -> str:
    from rich.console import Console

    out = io.StringIO()
    Console(file=out, width=160, color_system=None).print(table)
    return out.getvalue()


def test_a_learner_killed_without_a_lease_shows_last_seen_and_may_be_dead(tmp_path, monkeypatch):
    for name in ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "GRADIENTMAIL_LEARNER_ID"):
        monkeypatch.delenv(name, raising=False)
    learner = default_learner_id()
    context = multiprocessing.get_context("fork")
    events = context.Queue()
    box = str(tmp_path / "box")
    killed = context.Process(target=run, args=(SessionNode(box, "session", events, kill_after_entering=True),))
    killed.start()
    assert events.get(timeout=60) == ("entered", killed.pid)
    assert join_all([killed], 60) == [-9]
    mailbox = LocalMailbox(box)

    now = read_run(mailbox)
    assert "running" in render(status_table(now))  # just now: nothing says otherwise yet
    [row] = now.learners
    assert (row.learner, row.finished, row.lease) == (learner, False, None)

    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + LATER_S)  # read 47 minutes later
    later = read_run(mailbox)
    shown = render(status_table(later))
    assert "may be dead" in shown and "last seen 47" in shown, shown
    assert "running" not in shown, shown
    [row] = later.learners
    assert row.may_be_dead is True and row.presence == "expired"
    assert row.seen_alive is not None and LATER_S - 60 < later.read_at - row.seen_alive < LATER_S + 60
    assert now.learners[0].may_be_dead is False


def test_a_learner_that_left_is_not_shown_as_possibly_dead(tmp_path, monkeypatch):
    for name in ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "GRADIENTMAIL_LEARNER_ID"):
        monkeypatch.delenv(name, raising=False)
    context = multiprocessing.get_context("fork")
    events = context.Queue()
    box = str(tmp_path / "box")
    node = context.Process(target=run, args=(SessionNode(box, "session", events),))
    node.start()
    assert events.get(timeout=60)[0] == "entered"
    assert events.get(timeout=60)[0] == "finished"
    assert join_all([node], 60) == [0]
    later = RunReader(LocalMailbox(box), wall=lambda: time.time() + LATER_S).read()
    shown = render(status_table(later))
    assert "finished" in shown and "may be dead" not in shown, shown
    [row] = later.learners
    assert (row.finished, row.presence, row.may_be_dead) == (True, "stopped", False)
