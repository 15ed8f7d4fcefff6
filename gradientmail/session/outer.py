"""Outer optimizers: how a learner turns its local progress into its contribution to the run.

A learner's *progress* is how far its own optimizer moved the model since it last joined the
run's state (a pseudo-gradient, with the sign of a step). Every learner folds
``contribution(progress, N)`` into the shared state, where ``N`` is the number of learners
currently in the run. Dividing by ``N`` is what synchronous data parallelism does (it averages
the workers' gradients), so ``N`` nodes that each take a step move the run by one step.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor


class OuterState(Protocol):
    """One learner's outer optimizer while its session runs (it may keep state: momentum)."""

    def __call__(self, progress: dict[str, Tensor], active: int) -> dict[str, Tensor]:
        """The contribution to fold for ``progress`` with ``active`` learners (may reuse it)."""


class OuterOptimizer(Protocol):
    """A choice for ``Session(outer=...)``: a frozen configuration that makes one state."""

    name: str

    def start(self) -> OuterState: ...


@dataclass(frozen=True)
class Average:
    """Fold ``progress / N``: every node's progress counts once, averaged like synchronous DP.

    The plain rule: the run moves exactly as far as its learners did, on average (``drag`` 1.0).
    On the training benchmark it ends 1.04x DDP's loss where ``DelayedNesterov`` ends 1.02x.
    """

    name: str = "average"

    def start(self) -> OuterState:
        return _scale


def _scale(progress: dict[str, Tensor], active: int) -> dict[str, Tensor]:
    for tensor in progress.values():
        tensor.div_(active)
    return progress


@dataclass(frozen=True)
class DelayedNesterov:
    """``progress / N`` every time, plus a Nesterov momentum term every ``delay`` folds.

    After Liu et al. 2024 (asynchronous Local-SGD): momentum applied at every stale update
    overshoots, so the averaged contributions are buffered and the momentum ``m`` is updated
    (``m = momentum * m + mean of the buffer``) and applied (``lr * momentum * m``) only once per
    ``delay`` folds. Each learner keeps its own buffer and momentum (no extra bytes travel).
    The default outer optimizer: measured best on ``benchmarks/training.py`` (lr 1.0, delay 2
    or 8 were worse there; plain momentum at every fold is what Liu et al. found to hurt).
    """

    lr: float = 0.7
    momentum: float = 0.9
    delay: int = 4
    name: str = "delayed_nesterov"

    def __post_init__(self) -> None:
        if not 0 < self.lr <= 10:
            raise ValueError(f"DelayedNesterov.lr must be in (0, 10], not {self.lr!r}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"DelayedNesterov.momentum must be in [0, 1), not {self.momentum!r}")
        if isinstance(self.delay, bool) or not isinstance(self.delay, int) or self.delay < 1:
            raise ValueError(f"DelayedNesterov.delay must be an int >= 1, not {self.delay!r}")

    def start(self) -> OuterState:
        return _DelayedNesterovState(self)


class _DelayedNesterovState:
    def __init__(self, config: DelayedNesterov) -> None:
        self.config = config
        self.buffer: dict[str, Tensor] = {}
        self.velocity: dict[str, Tensor] = {}
        self.count = 0

    def __call__(self, progress: dict[str, Tensor], active: int) -> dict[str, Tensor]:
        progress = _scale(progress, active)
        _accumulate(self.buffer, progress)
        self.count += 1
        if self.count < self.config.delay:
            return progress
        momentum, lr = self.config.momentum, self.config.lr
        for name, buffered in self.buffer.items():
            velocity = self.velocity.get(name)
            if velocity is None:
                velocity = self.velocity[name] = torch.zeros_like(buffered)
            velocity.mul_(momentum).add_(buffered, alpha=1.0 / self.count)
            progress[name].add_(velocity, alpha=lr * momentum)
            buffered.zero_()
        self.count = 0
        return progress


def _accumulate(into: dict[str, Tensor], values: Mapping[str, Tensor]) -> None:
    for name, value in values.items():
        if name in into:
            into[name].add_(value)
        else:
            into[name] = value.clone()


OUTERS: dict[str, OuterOptimizer] = {"average": Average(), "delayed_nesterov": DelayedNesterov()}
"""The named choices for ``Session(outer=...)``."""


def resolve_outer(value: str | OuterOptimizer) -> OuterOptimizer:
    """An ``OuterOptimizer`` from its name or itself; a clear error for anything else."""
    if isinstance(value, str):
        try:
            return OUTERS[value]
        except KeyError:
            raise ValueError(
                f"outer={value!r}: expected one of {sorted(OUTERS)} or an "
                "OuterOptimizer such as DelayedNesterov(lr=0.5)"
            ) from None
    if callable(getattr(value, "start", None)) and isinstance(getattr(value, "name", None), str):
        return value
    raise TypeError(f"outer must be a name ({sorted(OUTERS)}) or an OuterOptimizer, not {type(value).__name__}")
