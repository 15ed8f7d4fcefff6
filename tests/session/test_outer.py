"""The outer optimizer: delayed Nesterov by default, chosen by name, object or environment."""

from __future__ import annotations

import pytest
from session_toys import (  # tests/helpers/ is on sys.path (tests/conftest.py)
    exchange,
    linear,
    run_toy,
    scalar,
    session,
    value,
)

from gradientmail.session import DelayedNesterov, Session
from gradientmail.session.outer import resolve_outer

pytestmark = pytest.mark.timeout(60)


def test_the_default_outer_is_delayed_nesterov(memory_mailbox):
    # Measured best by benchmarks/training.py; momentum moves the toy further than plain folds.
    model = scalar()
    with Session(model, mailbox=memory_mailbox, learner_id="me", every=None, every_steps=1):
        pass
    assert Session(model, mailbox=memory_mailbox, learner_id="x").outer == DelayedNesterov()
    assert run_toy(memory_mailbox, every_steps=1, rounds=8, outer=None) > 1.0


def test_outer_optimizer_is_chosen_by_name_or_object():
    assert resolve_outer("average").name == "average"
    assert resolve_outer("delayed_nesterov") == DelayedNesterov()
    custom = DelayedNesterov(lr=0.5, delay=2)
    assert resolve_outer(custom) is custom
    with pytest.raises(ValueError, match="expected one of"):
        resolve_outer("adam")
    with pytest.raises(TypeError, match="OuterOptimizer"):
        resolve_outer(3)
    with pytest.raises(ValueError, match="momentum"):
        DelayedNesterov(momentum=1.0)


def test_delayed_nesterov_adds_momentum_once_per_delay(memory_mailbox):
    model = scalar()
    outer = DelayedNesterov(lr=0.5, momentum=0.5, delay=2)
    with session(model, memory_mailbox, outer=outer) as s:
        exchange(s, model, 1.0)  # plain: +1
        assert value(model) == 1.0
        exchange(s, model, 1.0)  # +1, then m = 0.5*0 + (1+1)/2 = 1: + 0.5*0.5*1
        assert value(model) == 2.25
        exchange(s, model, 1.0)
        exchange(s, model, 1.0)  # +1, +1, then m = 0.5*1 + 1 = 1.5: + 0.25*1.5
        assert value(model) == 2.25 + 2.0 + 0.375


def test_the_outer_optimizer_can_be_chosen_by_environment(memory_mailbox, monkeypatch):
    monkeypatch.setenv("GRADIENTMAIL_SESSION_OUTER", "average")
    assert Session(linear(), mailbox=memory_mailbox, learner_id="a").outer.name == "average"
    monkeypatch.setenv("GRADIENTMAIL_SESSION_OUTER", "momentum")
    with pytest.raises(ValueError, match="outer='momentum'"):
        Session(linear(), mailbox=memory_mailbox, learner_id="a")
