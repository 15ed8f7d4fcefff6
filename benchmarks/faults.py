"""Every batch in the model exactly once through crashes: kill trials on real node processes.

Each trial runs three node processes on one ``LocalMailbox`` (on ``/dev/shm`` when writable):
the documented loop, ``shared_queue(resume=True, lease=...)`` inside a ``Session`` exchanging every 50 ms, over 24
units of 6 batches; every batch trained adds 1 to each parameter of a small model and counts
one sample. One node is SIGKILLed after a random number of batches (5 to 40), the parent
restarts it at once under the same learner id (``resume=True`` takes its units back), and the
run finishes. Then ``consensus`` says how many samples the run's state holds; the dataset has
144. What it prints per trial and in total:

- ``faults_lost``: samples of the dataset missing from the model (dataset - in model, if > 0);
- ``faults_doubled``: samples the model holds twice (in model - dataset, if > 0);
- ``faults_retrained``: batches trained twice (the killed node's batches whose progress never
  reached the run: trained again by design, and counted once);
- ``faults_errors``: trials where a surviving or restarted node failed, or a unit was not done.

Before issue #23 item 1 the killed node's batches since its last exchange were lost (its units
were recorded done when consumed); the ``FoldGate`` records a batch only once the run holds
its progress. The bound on ``faults_doubled``: a batch whose fold landed while its record's
write was in flight at the kill (docs/elastic.md).

Usage: ``python -m benchmarks.faults [--quick] [--trials N] [--seed S] [--fragments F]``
(default 50 trials, about 4 minutes on 2 cores; ``--quick``: 2 trials, CI). Not yet covered:
SIGSTOP/SIGCONT freezes, clock offsets, slow-store wrappers and SeaweedFS (see the note of
issue #23). The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import shutil
import signal
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from benchmarks._common import emit, table

UNITS, STEPS = 24, 6
NODES = 3
"""Three node processes; one is killed and restarted per trial."""
KILL_AFTER = (5, 40)
"""The killed node's batches before its kill, drawn uniformly (a node's share is about 48):
20 to 160 ms of training, across zero to three of its exchanges (every 50 ms)."""
EVERY_S = 0.05


@dataclass(frozen=True)
class NodeSpec:
    box: str
    learner: str
    out: str
    run: int
    kill_after: int | None
    lease_s: float
    every_s: float
    fragments: int
    train_s: float


def load_unit(identifier: str):
    import torch

    index = int(identifier)
    for step in range(STEPS):
        yield step, torch.tensor([index, step])


def node(spec: NodeSpec) -> None:
    """The documented loop; appends ``unit step`` per batch received to its own file."""
    import torch

    from gradientmail import LocalMailbox, Session
    from gradientmail.patterns.shared_queue import shared_queue

    torch.set_num_threads(1)
    box = LocalMailbox(spec.box)
    model = torch.nn.Linear(4, 4)
    session = Session(
        model, mailbox=box, learner_id=spec.learner, every=timedelta(seconds=spec.every_s), fragments=spec.fragments
    )
    units = {f"{i:04d}": f"{i:04d}" for i in range(UNITS)}
    received = 0
    with (
        open(Path(spec.out) / f"consumed-{spec.learner}-{spec.run}.txt", "a", encoding="ascii") as log,
        session,
        shared_queue(
            units,
            mailbox=box,
            learner_id=spec.learner,
            load=load_unit,
            workers=0,
            resume=True,
            lease=timedelta(seconds=spec.lease_s),
        ) as batches,
    ):
        for step, batch in batches:
            log.write(f"{int(batch[0])} {step}\n")
            log.flush()  # a SIGKILL loses nothing this loop did
            time.sleep(spec.train_s)
            with torch.no_grad():
                model.weight.add_(1.0)
            session.step(samples=1)
            received += 1
            if spec.kill_after is not None and received >= spec.kill_after:
                os.kill(os.getpid(), signal.SIGKILL)


@dataclass
class Trial:
    killed_after: int
    in_model: int
    retrained: int
    error: str = ""


def run_trial(root: Path, rng: random.Random, fragments: int, kill_range: tuple[int, int]) -> Trial:
    box, out = root / "box", root / "out"
    out.mkdir(parents=True)
    context = multiprocessing.get_context("fork")
    kill_after = rng.randint(*kill_range)
    victim = rng.randrange(NODES)

    def spec(rank: int, run: int, kill: int | None) -> NodeSpec:
        return NodeSpec(str(box), f"node-{rank}", str(out), run, kill, 1.0, EVERY_S, fragments, 0.004)

    processes = {
        rank: context.Process(target=node, args=(spec(rank, 1, kill_after if rank == victim else None),))
        for rank in range(NODES)
    }
    for process in processes.values():
        process.start()
    error = ""
    processes[victim].join(120)
    if processes[victim].exitcode != -signal.SIGKILL:
        error = f"node-{victim} ended with {processes[victim].exitcode} before its kill"
    restart = context.Process(target=node, args=(spec(victim, 2, None),))
    restart.start()
    for process in [*processes.values(), restart]:
        process.join(180)
        if process.is_alive():
            process.kill()
            process.join()
            error = error or "a node did not finish within 180 s"
    codes = [p.exitcode for r, p in processes.items() if r != victim] + [restart.exitcode]
    if any(code != 0 for code in codes):
        error = error or f"nodes ended with {codes}"

    import torch

    from gradientmail import LocalMailbox, consensus
    from gradientmail.status import read_run

    mailbox = LocalMailbox(box)
    in_model = sum(consensus(mailbox, torch.nn.Linear(4, 4)).values())
    if len(read_run(mailbox).done) != UNITS:
        error = error or "not every unit was done"
    seen: Counter[str] = Counter()
    for path in out.glob("consumed-*.txt"):
        seen.update(path.read_text().splitlines())
    retrained = sum(n - 1 for n in seen.values())
    if len(seen) != UNITS * STEPS:
        error = error or f"{UNITS * STEPS - len(seen)} batches never trained"
    return Trial(kill_after, in_model, retrained, error)


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 trials (CI)")
    parser.add_argument("--trials", type=int, default=None, help="kill trials (default 50)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fragments", type=int, default=2, help="Session fragments (default 2)")
    options = parser.parse_args(argv)
    trials = options.trials or (2 if options.quick else 50)
    rng = random.Random(options.seed)
    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    dataset = UNITS * STEPS
    print(
        f"Kill trials: {NODES} node processes, shared_queue(resume=True, lease=1 s) in a Session "
        f"(every {EVERY_S} s, {options.fragments} fragments), {UNITS} units x {STEPS} batches = {dataset} samples; "
        f"one node SIGKILLed after {KILL_AFTER[0]}-{KILL_AFTER[1]} batches and restarted at once"
    )
    results: list[Trial] = []
    began = time.monotonic()
    for index in range(trials):
        root = Path(tempfile.mkdtemp(prefix="gm-faults-", dir=shm))
        try:
            results.append(run_trial(root, rng, options.fragments, KILL_AFTER))
        finally:
            shutil.rmtree(root, ignore_errors=True)
        trial = results[-1]
        print(
            f"trial {index + 1}/{trials}: killed after {trial.killed_after}, in model {trial.in_model}/{dataset}, "
            f"retrained {trial.retrained}{', ERROR ' + trial.error if trial.error else ''}",
            flush=True,
        )
    lost = sum(max(0, dataset - t.in_model) for t in results)
    doubled = sum(max(0, t.in_model - dataset) for t in results)
    rows = [
        ["trials (faults injected)", trials],
        ["samples in the dataset, all trials", dataset * trials],
        ["samples in the model, all trials", sum(t.in_model for t in results)],
        ["lost", lost],
        ["doubled", doubled],
        ["batches trained twice (by design: not in the run when killed)", sum(t.retrained for t in results)],
        ["trials with an error", sum(1 for t in results if t.error)],
    ]
    print(table(["kill trials, LocalMailbox", "value"], rows))
    print(f"wall time {time.monotonic() - began:.0f}s")
    figures = {
        "faults_trials": trials,
        "faults_injected": trials,
        "faults_samples_dataset": dataset * trials,
        "faults_samples_in_model": sum(t.in_model for t in results),
        "faults_lost": lost,
        "faults_doubled": doubled,
        "faults_retrained": sum(t.retrained for t in results),
        "faults_errors": sum(1 for t in results if t.error),
    }
    emit(figures)
    return figures


if __name__ == "__main__":
    main()
