"""What ``lease=`` costs the Session: the documented loop with and without it, 20 ms from its store.

One learner runs the documented loop (``with session, shared_queue(units, ..., resume=True)``)
over one-batch units on a ``LocalMailbox`` behind ``DelayedMailbox`` (20 ms a request), a
Session of 4 fragments exchanging every second (tens of local steps), each step a small MLP's
training step. The same run goes once with ``lease=timedelta(seconds=30)`` and once without,
in alternating order, on fresh stores:

- ``lease_fold_rate``: folds completed per second of the loop with the lease / without (median
  of the repeats' ratios; target >= 0.9). With a lease, every fold that holds batches whose
  records are not written first confirms that this learner still owns its units.
- ``lease_exit_ratio``: seconds to leave the ``with`` block (the final fold, the records, the
  releases) with the lease / without (target <= 1.5).

Usage: ``python -m benchmarks.session_lease [--quick] [--repeats N] [--seconds S]``; the last
line is one JSON object.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from datetime import timedelta
from typing import Any

from benchmarks._common import emit, parser, table, verdicts

LATENCY_S = 0.020
"""Seconds each mailbox request takes (a store 20 ms away)."""
LEASE = timedelta(seconds=30)
EVERY = timedelta(seconds=1)
FRAGMENTS = 4
UNITS = 2000
"""More one-batch units than a run consumes: the loop leaves by ``break`` after ``--seconds``."""


def load(identifier: int) -> Any:
    import torch

    yield identifier, torch.full((32, 64), float(identifier % 7))


def one_run(lease: timedelta | None, seconds: float) -> dict[str, float]:
    """The documented loop for ``seconds``, then leaving the block: folds, loop and exit seconds."""
    import torch

    from gradientmail import Session
    from gradientmail.mailbox.local import LocalMailbox
    from gradientmail.mailbox.wrappers import DelayedMailbox
    from gradientmail.patterns.shared_queue import shared_queue

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    units = {f"u{index:05d}": index for index in range(UNITS)}
    with tempfile.TemporaryDirectory(prefix="gm-session-lease-") as directory:
        box = DelayedMailbox(LocalMailbox(directory), LATENCY_S)
        session = Session(model, mailbox=box, learner_id="node-0", every=EVERY, fragments=FRAGMENTS)
        queue = shared_queue(units, mailbox=box, learner_id="node-0", load=load, resume=True, lease=lease)
        with session, queue as batches:
            began = time.perf_counter()
            for _step, batch in batches:
                loss = torch.nn.functional.mse_loss(model(batch), batch)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                session.step(samples=len(batch))
                if time.perf_counter() - began >= seconds:
                    break
            looped = time.perf_counter() - began
            folds, steps = session.exchanges, session.steps
            leaving = time.perf_counter()
        left = time.perf_counter() - leaving
    return {"folds": folds, "steps": steps, "loop_s": looped, "exit_s": left, "fold_rate": folds / looped}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    options = parser(__doc__)
    options.add_argument("--repeats", type=int, default=None, help="pairs of runs (default 3, quick 1)")
    options.add_argument("--seconds", type=float, default=None, help="seconds of training loop per run (default 3)")
    args = options.parse_args(argv)
    repeats = args.repeats or (1 if args.quick else 3)
    seconds = args.seconds or (2.0 if args.quick else 3.0)
    pairs = []
    for repeat in range(repeats):
        order = (None, LEASE) if repeat % 2 == 0 else (LEASE, None)
        runs = {("lease" if lease else "none"): one_run(lease, seconds) for lease in order}
        pairs.append(runs)
    rates = [pair["lease"]["fold_rate"] / pair["none"]["fold_rate"] for pair in pairs]
    exits = [pair["lease"]["exit_s"] / pair["none"]["exit_s"] for pair in pairs]
    rows = []
    for repeat, pair in enumerate(pairs):
        for name in ("none", "lease"):
            run = pair[name]
            rows.append(
                (
                    f"{repeat + 1}: {'lease=30 s' if name == 'lease' else 'no lease'}",
                    run["steps"],
                    run["folds"],
                    f"{run['fold_rate']:.2f}",
                    f"{run['exit_s']:.2f}",
                )
            )
    print(
        f"one-batch units, {LATENCY_S * 1000:.0f} ms a request, {FRAGMENTS} fragments, every {EVERY.total_seconds():g} s"
    )
    print(table(("run", "steps", "folds", "folds/s", "exit s"), rows))
    figures: dict[str, Any] = {
        "lease_fold_rate": statistics.median(rates),
        "lease_fold_rate_spread": [min(rates), max(rates)],
        "lease_exit_ratio": statistics.median(exits),
        "lease_exit_ratio_spread": [min(exits), max(exits)],
        "lease_exit_s": statistics.median(pair["lease"]["exit_s"] for pair in pairs),
        "no_lease_exit_s": statistics.median(pair["none"]["exit_s"] for pair in pairs),
    }
    for line in verdicts(figures):
        print(line)
    emit(figures)
    return figures


if __name__ == "__main__":
    main()
