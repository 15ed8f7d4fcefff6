"""What ``Session.step`` costs relative to a small model's training step, in the same process.

Three kinds of ``step()`` call are timed against one training step of a small MLP (forward,
backward, ``optimizer.step``, ``zero_grad``) measured here first:

- ``step_overhead``: no exchange due, none finished (almost every call); target < 0.01;
- ``step_overhead_exchange``: an exchange is due: the parameters are copied to the CPU and handed
  to the background thread (the mailing, listing and merging run there, not timed here);
- ``step_overhead_merge``: a finished exchange's merge (one peer) is applied to the model.

Figures are ratios to the training step (best of several repeats), so they compare across
machines. Usage: ``python -m benchmarks.session [--quick]``; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time
import uuid
from collections.abc import Callable
from datetime import timedelta

import torch

from benchmarks._common import verdicts
from gradientmail import MemoryMailbox
from gradientmail.session import Session


def small_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.ReLU(), torch.nn.Linear(256, 128))


def best_per_call(run: Callable[[int], float], calls: int, repeats: int) -> float:
    """Smallest seconds per call over ``repeats`` runs of ``calls`` calls (least disturbed run)."""
    return min(run(calls) / calls for _ in range(repeats))


class Trainer:
    """A small model, its optimizer and one fixed batch: ``step()`` is one training step."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = small_model()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.inputs, self.targets = torch.randn(64, 128), torch.randn(64, 128)

    def step(self) -> None:
        loss = torch.nn.functional.mse_loss(self.model(self.inputs), self.targets)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def training_step_seconds(calls: int, repeats: int) -> float:
    trainer = Trainer()

    def run(n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            trainer.step()
        return time.perf_counter() - start

    run(max(10, calls // 10))  # warm up allocator and kernels
    return best_per_call(run, calls, repeats)


def quiet_step_seconds(calls: int, repeats: int) -> float:
    box = MemoryMailbox(f"bench-{uuid.uuid4().hex}")
    session = Session(small_model(), mailbox=box, learner_id="bench", every=timedelta(hours=1))
    with session:

        def run(n: int) -> float:
            step = session.step
            start = time.perf_counter()
            for _ in range(n):
                step(samples=64)
            return time.perf_counter() - start

        run(1000)
        seconds = best_per_call(run, calls, repeats)
        assert session.exchanges == 0 and not session.in_flight
    box.clear()
    return seconds


def exchange_step_seconds(calls: int) -> tuple[float, float]:
    """Median seconds of a ``step()`` that starts an exchange, and of one that applies a merge.

    Each timed ``step()`` follows a real training step, as in a training loop (so the
    parameters are as warm in the caches as they are there).
    """
    box = MemoryMailbox(f"bench-{uuid.uuid4().hex}")
    trainer = Trainer()
    # One fragment: the timed step snapshots the whole model (the most a step ever copies; with
    # the default cut each exchange copies one fragment of it).
    options = {"every": None, "catch_up": False, "fragments": 1}
    peer = Session(small_model(), mailbox=box, learner_id="peer", every_steps=1, **options)
    # Three steps per round, the second one due: every_steps=3, and one step before the rounds.
    session = Session(trainer.model, mailbox=box, learner_id="bench", every_steps=3, **options)
    starts, merges = [], []
    with peer, session:
        session.step(samples=64)
        for _ in range(calls):
            peer.step(samples=64)  # fresh peer mail, so that every exchange merges
            peer.wait()
            trainer.step()
            session.step(samples=64)  # not due, nothing in flight
            assert not session.in_flight
            trainer.step()
            start = time.perf_counter()
            session.step(samples=64)  # due: snapshot and hand-off
            starts.append(time.perf_counter() - start)
            assert session.in_flight
            session.wait(timedelta(seconds=60), apply=False)  # let the background finish, untimed
            trainer.step()
            start = time.perf_counter()
            session.step(samples=64)  # applies the merge; the next exchange is not due yet
            merges.append(time.perf_counter() - start)
            assert not session.in_flight
        assert session.merges == calls, session.merges
    box.clear()
    starts.sort()
    merges.sort()
    return starts[len(starts) // 2], merges[len(merges) // 2]


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats (CI: runs, not judged)")
    args = parser.parse_args(argv)
    # One thread: a small model's step is then not at the mercy of how many cores are idle.
    torch.set_num_threads(1)
    train_calls, quiet_calls, repeats, exchange_calls = (50, 20_000, 3, 10) if args.quick else (300, 200_000, 7, 50)
    train = training_step_seconds(train_calls, repeats)
    quiet = quiet_step_seconds(quiet_calls, repeats)
    exchange, merge = exchange_step_seconds(exchange_calls)
    params = sum(p.numel() for p in small_model().parameters())
    figures = {
        "step_overhead": quiet / train,
        "step_overhead_exchange": exchange / train,
        "step_overhead_merge": merge / train,
    }
    rows = [
        ("training step (baseline)", train, 1.0),
        ("session.step, nothing due", quiet, figures["step_overhead"]),
        ("session.step, exchange due", exchange, figures["step_overhead_exchange"]),
        ("session.step, applies a merge", merge, figures["step_overhead_merge"]),
    ]
    print(
        f"Session.step cost vs a training step: MLP 128-256-128 ({params:,} parameters), batch 64, "
        f"CPU, {torch.get_num_threads()} threads{' (quick)' if args.quick else ''}"
    )
    print(f"{'call':<32}{'time':>12}{'vs training step':>20}")
    for name, seconds, ratio in rows:
        print(f"{name:<32}{seconds * 1e6:>10.2f}us{ratio:>19.2%}")
    for line in verdicts({"step_overhead": figures["step_overhead"]}):
        print(line)
    print(json.dumps({name: round(value, 6) for name, value in figures.items()}))
    return figures


if __name__ == "__main__":
    main()
