"""The pace of a group's words: ``step()`` starts a collective only at word steps, spaced so
that the words cost a small constant share of the training, and the samples stay exact.

One process forms a gloo group of one (the collectives run for real); the multi-process
behaviour (lockstep, merges, errors at the same step) is in ``test_groups.py``.
"""

from __future__ import annotations

import pytest
import torch

from gradientmail import Session, consensus
from gradientmail.session.group import WordPace


def test_the_pace_asks_for_the_fewest_words_that_stay_within_budget():
    pace = WordPace(budget=0.005, limit=64)
    assert pace.every() == 1  # nothing measured yet: a word every step
    pace.spent(0.0002, began=0.0, steps=1)
    assert pace.every() == 1  # one word step: no step time yet
    pace.spent(0.0002, began=0.010, steps=2)  # 10 ms a step, 0.2 ms a word
    assert pace.every() == 4  # ceil(0.2 / (0.005 * 10))
    slow = WordPace(budget=0.005, limit=64)
    slow.spent(0.0002, began=0.0, steps=1)
    slow.spent(0.0002, began=1.0, steps=2)  # a second a step: the word is nothing next to it
    assert slow.every() == 1
    dear = WordPace(budget=0.005, limit=64)
    dear.spent(0.05, began=0.0, steps=1)
    dear.spent(0.05, began=0.001, steps=2)
    assert dear.every() == 64  # never fewer words than one every ``limit`` steps


@pytest.fixture
def group_of_one(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        yield dist
    finally:
        dist.destroy_process_group()


def test_steps_between_word_steps_start_no_collective_and_the_samples_stay_exact(
    group_of_one, memory_mailbox, monkeypatch
):
    dist = group_of_one
    monkeypatch.setattr(WordPace, "every", lambda self: 4)
    started = []
    real_all_reduce = dist.all_reduce

    def counted(*args, **kwargs):
        started.append(1)
        return real_all_reduce(*args, **kwargs)

    monkeypatch.setattr(dist, "all_reduce", counted)
    model = torch.nn.Linear(2, 1)
    steps = 42
    with Session(
        model, mailbox=memory_mailbox, learner_id="machine", every=None, every_steps=10, group=dist.group.WORLD
    ) as session:
        word_steps = []
        for step in range(steps):
            before = len(started)
            with torch.no_grad():
                model.weight.add_(1.0)
            session.step(samples=step + 1)
            if len(started) > before:
                word_steps.append(step)
    # The first word says nothing of the pace yet; each later one says rank 0's (4 steps).
    assert word_steps == [0, 1, *range(5, steps, 4)]
    assert session.samples == steps * (steps + 1) // 2  # every sample, summed at the word steps
    assert session.exchanges > 0  # exchanges started (at word steps) while training
    assert consensus(memory_mailbox, torch.nn.Linear(2, 1)) == {"machine": steps * (steps + 1) // 2}
