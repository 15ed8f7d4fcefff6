"""``consensus`` reads the run's model with every learner's progress; sessions in lockstep end as
one model.
"""

from __future__ import annotations

import uuid

import pytest
import torch
from session_toys import (  # tests/helpers/ is on sys.path (tests/conftest.py)
    exchange,
    linear,
    params,
    same,
    scalar,
    session,
    value,
)

from gradientmail import MailRejectedError, MemoryMailbox
from gradientmail.session import consensus

pytestmark = pytest.mark.timeout(60)


def test_consensus_holds_every_learners_progress(memory_mailbox):
    models = {name: scalar() for name in ("a", "b", "c")}
    sessions = {name: session(m, memory_mailbox, name) for name, m in models.items()}
    for s in sessions.values():
        s.__enter__()
    exchange(sessions["a"], models["a"], 3.0, samples=300)
    exchange(sessions["b"], models["b"], 6.0, samples=100)
    sessions["c"].__exit__(None, None, None)  # finished without progress
    result = scalar(-1.0)
    assert consensus(memory_mailbox, result) == {"a": 300, "b": 100, "c": 0}
    assert value(result) == 1.0 + 2.0  # each contribution / 3, during the run
    for name in ("a", "b"):
        sessions[name].__exit__(None, None, None)


def test_consensus_rejects_another_model_without_touching_it(memory_mailbox):
    with session(linear(), memory_mailbox, "a", every_steps=100):
        pass
    other = torch.nn.Linear(2, 2)
    before = params(other)
    with pytest.raises(MailRejectedError, match="'a'"):
        consensus(memory_mailbox, other)
    assert same(params(other), before)
    with pytest.raises(LookupError, match="no run state"):
        consensus(MemoryMailbox(f"empty-{uuid.uuid4().hex}"), linear())


def test_sessions_in_lockstep_end_as_one_model(memory_mailbox):
    models = [linear(seed=i) for i in range(3)]
    sessions = [session(m, memory_mailbox, learner=f"n{i}") for i, m in enumerate(models)]
    for s in sessions:
        s.__enter__()
    for _step in range(30):
        for i, s in enumerate(sessions):
            exchange(s, models[i], 0.01 * (i + 1))
    for s in sessions:
        exchange(s)
    spread = max((m.weight - models[0].weight).abs().max().item() for m in models)
    for s in sessions:
        s.__exit__(None, None, None)
    assert spread < 1e-5
    result = linear()
    consensus(memory_mailbox, result)
    assert torch.allclose(result.weight, models[-1].weight, atol=1e-5)
