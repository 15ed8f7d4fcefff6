"""An exchange that fails after some of its folds landed: their merges are applied all the same,
so a loop that catches the error and goes on keeps the run exact (nothing counted twice)."""

from __future__ import annotations

import threading

import pytest
import torch

from gradientmail import MailboxError, MemoryMailbox
from gradientmail.mailbox.wrappers import FaultyMailbox
from gradientmail.session import Session, consensus


def scalar() -> torch.nn.Linear:
    model = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    return model


@pytest.mark.parametrize("fragments", [1, 2, 4])
@pytest.mark.parametrize("failing_step", [3, 4, 5])
def test_a_progress_write_that_fails_after_the_folds_landed_counts_nothing_twice(fragments, failing_step):
    """Two learners add 1 per step for 10 steps each (``average``: the run gains 1 per round);
    learner a's progress record write fails once, after its folds of that exchange landed, and
    its loop catches the error and goes on. The run ends at 10 (it ended at 11 here before)."""
    box = MemoryMailbox(f"partial-{fragments}-{failing_step}")
    refuse = threading.Event()

    def fault(operation: str, key: str) -> BaseException | None:
        if refuse.is_set() and operation == "put" and key.startswith("progress/"):
            refuse.clear()
            return MailboxError("progress write refused", operation=operation, key=key)
        return None

    models = {"a": scalar(), "b": scalar()}
    options = {"every": None, "every_steps": 4, "outer": "average", "fragments": fragments}
    sessions = {
        "a": Session(models["a"], mailbox=FaultyMailbox(box, fault), learner_id="a", **options),
        "b": Session(models["b"], mailbox=box, learner_id="b", **options),
    }
    errors = []
    with sessions["a"], sessions["b"]:
        for step in range(10):
            for name, session in sessions.items():
                with torch.no_grad():
                    models[name].weight.add_(1.0)
                if name == "a" and step == failing_step:
                    refuse.set()
                try:
                    session.step(samples=1)
                    session.wait()
                except MailboxError as exc:
                    errors.append(exc)
    result = scalar()
    assert consensus(box, result) == {"a": 10, "b": 10}
    assert float(result.weight.detach()) == pytest.approx(10.0)
    assert len(errors) == 1  # raised once, at the step that applied the failed exchange
