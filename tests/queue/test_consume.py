"""The iterator the loop holds calls the hooks it was built with: guard, pace and end of the batches."""

from __future__ import annotations

import pytest
import torch

from gradientmail.mailbox import MemoryMailbox
from gradientmail.queue.consume import LoopHooks
from gradientmail.queue.dataset import SharedQueueDataset
from gradientmail.queue.thread_pump import ThreadBatches


def _two_batches(value: int):
    for step in range(2):
        yield step, torch.tensor([value])


def _dataset(name: str) -> SharedQueueDataset[int]:
    return SharedQueueDataset({"a": 1, "b": 2}, mailbox=MemoryMailbox(name), learner_id="n0", load=_two_batches)


def test_hooks_given_at_construction_run_around_each_batch() -> None:
    calls: list[str] = []
    hooks = LoopHooks(guard=lambda: calls.append("guard"), on_end=lambda: calls.append("end"))
    batches = ThreadBatches(_dataset("consume-hooks"), 2, None, hooks=hooks)
    try:
        got = [(step, int(batch)) for step, batch in batches]
    finally:
        batches.close()
    assert sorted(got) == [(0, 1), (0, 2), (1, 1), (1, 2)]
    # The guard before each of the four batches and before the look that finds none; the end once.
    assert calls == ["guard"] * 5 + ["end"]
    assert list(batches) == []  # ended for good: the end hook is not called again
    assert calls.count("end") == 1


def test_a_guard_that_raises_ends_the_batches_for_good() -> None:
    class Replaced(Exception):
        pass

    def guard() -> None:
        raise Replaced("another incarnation of this learner took over")

    batches = ThreadBatches(_dataset("consume-guard"), 2, None, hooks=LoopHooks(guard=guard))
    try:
        with pytest.raises(Replaced, match="another incarnation"):
            next(batches)
        assert list(batches) == []
    finally:
        batches.close()
