"""The design note's shared-queue example, as written (smaller constants), on a LocalMailbox.

Only the surroundings are supplied here: ``sequences`` (the application's reader), a tiny model,
optimizer, device, learning-rate schedule and a stand-in session. The blocks marked "the design note" are
the design note's text; ``steps`` is 4 instead of 4,000 and ``unit_steps`` 2 instead of 20.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from documented_loop import run_documented_loop  # tests/helpers/ is on sys.path (tests/conftest.py)

from gradientmail import LocalMailbox, unit_grid
from gradientmail import Unit as LibraryUnit

SEQUENCE = 9
VOCAB = 32

pytestmark = pytest.mark.timeout(120)


def sequences(start: int, count: int) -> torch.Tensor:
    """The application's dataset reader: ``count`` token sequences from ``start`` (synthetic)."""
    rows = torch.arange(start, start + count).unsqueeze(1)
    return (rows + torch.arange(SEQUENCE)) % VOCAB


# -- the design note ------------------------------------------------------------------------------------
from dataclasses import dataclass  # noqa: E402


@dataclass(frozen=True)
class Unit:
    first: int
    count: int
    lane: int
    lanes: int


steps = 4
unit_steps = 2
nodes = 4

units = {
    f"{first // unit_steps:06d}-{lane}.json": Unit(
        first=first,
        count=min(unit_steps, steps - first),
        lane=lane,
        lanes=nodes,
    )
    for first in range(0, steps, unit_steps)
    for lane in range(nodes)
}

from collections.abc import Iterator  # noqa: E402

from torch import Tensor  # noqa: E402

BATCH = 1024


def load_unit(unit: Unit) -> Iterator[tuple[int, Tensor]]:
    share = BATCH // unit.lanes

    for step in range(unit.first, unit.first + unit.count):
        start = step * BATCH + unit.lane * share
        yield step, sequences(start, share)


# -- end of the design note -------------------------------------------------------------------------------


class TinyModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 8)
        self.out = torch.nn.Linear(8, VOCAB)

    def forward(self, tokens: Tensor, targets: Tensor) -> Tensor:
        logits = self.out(self.embed(tokens))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class StandInSession:
    """Just what the documented loop uses of a Session: a context manager with ``step``."""

    def __init__(self) -> None:
        self.samples = 0
        self.entered = self.exited = False

    def __enter__(self):
        self.entered = True
        return self

    def __exit__(self, *exc):
        self.exited = True
        return False

    def step(self, *, samples: int) -> None:
        self.samples += samples


def test_library_grid_matches_the_design_note_grid():
    grid = unit_grid(steps, unit_steps, nodes)
    assert list(grid) == list(units)
    assert all(
        (g.first, g.count, g.lane, g.lanes) == (u.first, u.count, u.lane, u.lanes)
        for g, u in zip(grid.values(), units.values(), strict=True)
    )
    assert isinstance(next(iter(grid.values())), LibraryUnit)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_documented_training_loop_runs_as_written(tmp_path):
    box = LocalMailbox(tmp_path / "run")
    rank = 0
    device = torch.device("cpu")
    model = TinyModel()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    session = StandInSession()
    seen_steps: list[int] = []

    def learning_rate(step: int) -> float:
        seen_steps.append(step)
        return 1e-3

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*CUDA is not available.*")
        warnings.filterwarnings("ignore", message=".*device_type of 'cuda'.*")
        run_documented_loop(
            units=units,
            box=box,
            rank=rank,
            nodes=nodes,
            BATCH=BATCH,
            load_unit=load_unit,
            model=model,
            optimizer=optimizer,
            session=session,
            learning_rate=learning_rate,
            device=device,
        )

    assert session.entered and session.exited
    assert sorted(seen_steps) == sorted(list(range(steps)) * nodes), "every lane of every step once"
    assert session.samples == steps * nodes * (BATCH // nodes) * 2048
