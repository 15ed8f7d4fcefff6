"""``shared_queue(..., progress=True)``: plain lines off a terminal, a rich bar on one, no thread
left behind, never an error in the training loop."""

from __future__ import annotations

import io
import sys
import threading
import uuid

import pytest
import torch

from gradientmail import MemoryMailbox, MissingExtraError
from gradientmail.patterns.shared_queue import shared_queue
from gradientmail.queue.progress_display import ProgressDisplay


def load_two(value: int):
    for step in range(2):
        yield value * 2 + step, torch.full((2,), float(value))


def progress_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("gradientmail-display")]


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_off_a_terminal_prints_plain_lines_and_leaves_no_thread(capsys):
    box = MemoryMailbox(f"progress-{uuid.uuid4().hex}")
    units = {f"u{i}": i for i in range(4)}
    with shared_queue(units, mailbox=box, learner_id="node-P", load=load_two, workers=0, progress=True) as batches:
        assert len(progress_threads()) == 1
        steps = [step for step, _ in batches]
    assert len(steps) == 8
    assert progress_threads() == []
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("gradientmail:")]
    assert lines, "no progress line on stderr"
    assert "node-P finished" in lines[-1]
    assert "units 4/4 taken (4 by this node), 8 batches" in lines[-1]
    assert "batches/s on average" in lines[-1]


def test_progress_stops_with_the_block_after_break_and_after_an_error(capsys):
    box = MemoryMailbox(f"progress-{uuid.uuid4().hex}")
    units = {f"u{i}": i for i in range(4)}
    with shared_queue(units, mailbox=box, learner_id="node-B", load=load_two, workers=0, progress=True) as batches:
        for _ in batches:
            break
    assert progress_threads() == []
    other = MemoryMailbox(f"progress-{uuid.uuid4().hex}")
    with pytest.raises(RuntimeError, match="in the loop"):
        with shared_queue(
            units, mailbox=other, learner_id="node-C", load=load_two, workers=0, progress=True
        ) as batches:
            next(batches)
            raise RuntimeError("in the loop")
    assert progress_threads() == []
    assert "node-C finished" in capsys.readouterr().err


def test_progress_off_by_default_prints_nothing(capsys):
    box = MemoryMailbox(f"progress-{uuid.uuid4().hex}")
    with shared_queue({"u0": 0}, mailbox=box, learner_id="node-Q", load=load_two, workers=0) as batches:
        assert progress_threads() == []
        list(batches)
    assert "gradientmail:" not in capsys.readouterr().err


def test_progress_on_a_terminal_without_rich_names_the_extra_before_claiming(monkeypatch):
    monkeypatch.setitem(sys.modules, "rich.progress", None)  # import rich.progress fails
    monkeypatch.setattr(sys, "stderr", Terminal())
    box = MemoryMailbox(f"progress-{uuid.uuid4().hex}")
    with pytest.raises(MissingExtraError, match=r"pip install 'gradientmail\[cli\]'"):
        with shared_queue({"u0": 0}, mailbox=box, learner_id="node-R", load=load_two, workers=0, progress=True):
            pass
    assert list(box.list("units/")) == []
    assert progress_threads() == []


def test_progress_on_a_terminal_draws_a_rich_bar():
    pytest.importorskip("rich")
    terminal = Terminal()
    display = ProgressDisplay(
        learner_id="node-T", total=4, mine=lambda: 2, batches=lambda: 10, run_taken=lambda: 3, stream=terminal
    )
    display.start()
    assert display.terminal
    display.close()
    assert progress_threads() == []
    text = terminal.getvalue()
    assert "node-T units" in text and "3/4 units taken (2 by this node)" in text
    assert "10 batches" in text


def test_display_errors_never_reach_the_caller():
    def broken() -> int:
        raise OSError("store down")

    display = ProgressDisplay(
        learner_id="node-E", total=4, mine=broken, batches=broken, run_taken=broken, stream=io.StringIO()
    )
    display.start()
    display.close()  # does not raise
    assert progress_threads() == []
    assert display.lines == 0


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_progress_must_be_a_bool(memory_mailbox, value):
    with pytest.raises(TypeError, match="progress must be True or False"):
        with shared_queue(
            {"a": 1}, mailbox=memory_mailbox, learner_id="n", load=lambda unit: iter(()), workers=0, progress=value
        ):
            pytest.fail("entered with a non-bool progress")
