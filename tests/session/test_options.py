"""A Session's arguments: the learner id fits every key it will write, bad arguments are
refused naming them, and the environment overrides them.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
from session_toys import (  # tests/helpers/ is on sys.path (tests/conftest.py)
    linear,
    session,
)

from gradientmail.session import Session

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("learner", ["a/b", "", ".hidden", "tab\t", 3])
def test_learner_id_must_be_one_key_segment(memory_mailbox, learner):
    with pytest.raises((ValueError, TypeError)):
        Session(linear(), mailbox=memory_mailbox, learner_id=learner)


@pytest.mark.parametrize("length", [200, 230, 231, 240, 482, 600])
def test_a_learner_id_too_long_for_any_key_it_will_write_is_refused_up_front(memory_mailbox, length):
    learner = "n" * length
    try:
        s = Session(linear(), mailbox=memory_mailbox, learner_id=learner)
    except ValueError as error:
        assert "512 bytes" in str(error) or "255 bytes" in str(error)
        return
    with s:  # accepted: then every key it writes fits, from enter to exit
        s.step(samples=1)


def test_arguments_are_checked(memory_mailbox):
    with pytest.raises(TypeError, match="Mailbox"):
        Session(linear(), mailbox=object(), learner_id="a")
    with pytest.raises(ValueError, match="never exchange"):
        Session(linear(), mailbox=memory_mailbox, learner_id="a", every=None)
    with pytest.raises(ValueError, match="every_steps"):
        Session(linear(), mailbox=memory_mailbox, learner_id="a", every_steps=0)
    with pytest.raises(TypeError, match="timedelta"):
        Session(linear(), mailbox=memory_mailbox, learner_id="a", every=10)
    with pytest.raises(ValueError, match="positive"):
        Session(linear(), mailbox=memory_mailbox, learner_id="a", max_staleness=timedelta(0))
    with session(linear(), memory_mailbox) as s:
        with pytest.raises(ValueError, match=">= 0"):
            s.step(samples=-1)
        with pytest.raises(TypeError):
            s.step(samples=1.5)
        s.step(samples=torch.tensor(3))
        assert s.samples == 3


def test_environment_overrides_the_arguments(memory_mailbox, monkeypatch):
    monkeypatch.setenv("GRADIENTMAIL_SESSION_EVERY_S", "none")
    monkeypatch.setenv("GRADIENTMAIL_SESSION_EVERY_STEPS", "7")
    monkeypatch.setenv("GRADIENTMAIL_SESSION_MAX_STALENESS_S", "90")
    s = Session(linear(), mailbox=memory_mailbox, learner_id="a", every=timedelta(seconds=1))
    assert (s.every, s.every_steps, s.max_staleness) == (None, 7, timedelta(seconds=90))
    monkeypatch.setenv("GRADIENTMAIL_SESSION_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="GRADIENTMAIL_SESSION_TIMEOUT_S"):
        Session(linear(), mailbox=memory_mailbox, learner_id="a")
