"""A group's ranks other than 0 read the next unit ahead as soon as rank 0's loader started it,
so they do not stall at unit boundaries (rank 0's announcements name the next unit).

The announcements run on a scripted stand-in for the group (``announce`` is the only
collective these classes use); ``tests/session/test_groups.py`` runs real process groups.
"""

from __future__ import annotations

import threading

import torch

from gradientmail.queue.group import BATCH, END, WORDS, FollowerBatches, LeaderBatches


class ScriptedGroup:
    """Rank ``rank`` of 2; ``announce`` returns the scripted words (a follower) or records them (rank 0)."""

    def __init__(self, rank: int, script: list[list[int]] | None = None) -> None:
        self.rank, self.size = rank, 2
        self.script = list(script or [])
        self.said: list[list[int]] = []

    def announce(self, words):
        assert len(words) == WORDS
        self.said.append(list(words))
        return self.script.pop(0) if self.script else list(words)


def test_rank_0_names_the_unit_its_loader_started_after_the_current_one():
    started: list[int] = [4]
    tag = lambda index, position: torch.tensor([index, position])  # noqa: E731
    inner = iter([(0, ("a", tag(4, 0))), (1, ("b", tag(4, 1))), (2, ("c", tag(7, 0)))])
    group = ScriptedGroup(0)
    batches = LeaderBatches(inner, group, started)
    next(batches)
    started.append(7)  # the loader thread claimed unit 7 and began loading it
    next(batches)
    next(batches)
    assert [words[4] for words in group.said] == [-1, 7, -1]


def test_a_follower_starts_loading_the_named_next_unit_before_its_first_batch_is_announced():
    loading = {index: threading.Event() for index in range(2)}

    def load(unit: int):
        loading[unit].set()
        for position in range(2):
            yield unit * 2 + position, torch.full((2, 1), float(unit))

    script = [
        [BATCH, 0, 0, 0, -1],
        [BATCH, 0, 1, 1, 1],  # rank 0's loader has started unit 1
        [BATCH, 1, 0, 2, -1],
        [BATCH, 1, 1, 3, -1],
        [END, 0, 0, 0, 0],
    ]
    follower = FollowerBatches({"u0": 0, "u1": 1}, load, None, ScriptedGroup(1, script), prefetch=1)
    try:
        assert [next(follower)[0] for _ in range(2)] == [0, 1]
        # Unit 1 is being read while the loop still trains unit 0's last batch.
        assert loading[1].wait(timeout=30)
        assert [step for step, _ in follower] == [2, 3]
    finally:
        follower.close()
