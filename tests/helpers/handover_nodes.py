"""Node processes for the hand-over tests: units whose step labels repeat or go backwards, and
several processes under one learner_id.

Each batch is ``tensor([unit index, position])`` (its index in the unit's ``load()``) and is
labelled with ``labels[position]``, so a test can tell batches apart whatever the labels. A node
appends ``index position step`` per consumed batch to ``consumed-{learner}-{run}-{pid}.txt`` (one
write per line: a SIGKILL loses nothing done) and reports on ``events`` (a queue):
``("paused", pid)`` when it waits for ``go``, ``("refused", pid, message)`` when it was refused
with ``DuplicateLearnerError``, ``("done", pid)`` at its end.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from elastic_nodes import ProgressLog  # tests/helpers/ is on sys.path (tests/conftest.py)
from process_harness import join_all  # tests/helpers/ is on sys.path (tests/conftest.py)

from gradientmail import DuplicateLearnerError
from gradientmail.patterns.shared_queue import shared_queue


def _append(path: Path, line: str) -> None:
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(line + "\n")


@dataclass(frozen=True)
class LabelledLoad:
    """Yields one batch per label: ``(labels[position], tensor([index, position]))``."""

    labels: tuple[int, ...]
    delay: float = 0.0

    def __call__(self, item: Any):
        for position, label in enumerate(self.labels):
            if self.delay:
                time.sleep(self.delay)
            yield label, torch.tensor([item.index, position])


@dataclass
class Node:
    mailbox: Any
    learner: str
    units: dict[str, Any]
    out_dir: str
    labels: tuple[int, ...] = (0,) * 6
    run: int = 1
    delay: float = 0.0
    workers: int = 0
    prefetch: int = 2
    resume: bool = False
    lease_s: float | None = None
    kill_after: int | None = None
    pause_after: int | None = None
    events: Any = None
    go: Any = None
    barrier: Any = None


def run_node(node: Node) -> None:
    pid = os.getpid()
    consumed = Path(node.out_dir) / f"consumed-{node.learner}-{node.run}-{pid}.txt"
    mailbox = ProgressLog(node.mailbox, node.out_dir, node.learner, field="position", run=node.run)
    lease = timedelta(seconds=node.lease_s) if node.lease_s else None
    if node.barrier is not None:
        node.barrier.wait(timeout=60)
    received = 0
    try:
        with shared_queue(
            node.units,
            mailbox=mailbox,
            learner_id=node.learner,
            load=LabelledLoad(node.labels, node.delay),
            prefetch=node.prefetch,
            workers=node.workers,
            resume=node.resume,
            lease=lease,
        ) as batches:
            for step, batch in batches:
                index, position = (int(v) for v in batch)
                assert step == node.labels[position], "the label travels with its batch"
                _append(consumed, f"{index} {position} {step}")
                received += 1
                if node.kill_after is not None and received >= node.kill_after:
                    os.kill(pid, signal.SIGKILL)
                if node.pause_after is not None and received == node.pause_after:
                    node.events.put(("paused", pid))
                    assert node.go.wait(60), "the test never let the node go on"
    except DuplicateLearnerError as exc:
        node.events.put(("refused", pid, str(exc)))
        return
    if node.events is not None:
        node.events.put(("done", pid))


def start(nodes: list[Node], *, together: bool = False) -> list[Any]:
    """Fork one process per node (``together``: all released by one barrier)."""
    context = multiprocessing.get_context("fork")
    barrier = context.Barrier(len(nodes)) if together else None
    processes = []
    for node in nodes:
        node.barrier = barrier
        process = context.Process(target=run_node, args=(node,), name=node.learner)
        process.start()
        processes.append(process)
    return processes


def finish(processes: list[Any], *, timeout: float = 60, killed: int = 0) -> None:
    """Wait for every process; ``killed`` of them must have died of SIGKILL, the rest exit 0."""
    codes = join_all(processes, timeout)
    assert sorted(codes) == sorted([-signal.SIGKILL] * killed + [0] * (len(codes) - killed)), codes


def consumed(out_dir: str | Path) -> dict[str, list[tuple[int, int]]]:
    """File stem → the ``(unit index, position)`` of each batch that process consumed."""
    found = {}
    for path in sorted(Path(out_dir).glob("consumed-*.txt")):
        found[path.stem] = [(int(i), int(p)) for i, p, _ in (line.split() for line in path.read_text().splitlines())]
    return found


def written_positions(out_dir: str | Path, learner: str, run: int = 1) -> dict[int, int]:
    """Unit index → the last position of the progress writes of ``learner``'s incarnation ``run``
    known to have completed."""
    path = Path(out_dir) / f"written-{learner}-{run}.txt"
    last: dict[int, int] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            name, position = line.split()
            last[int(name)] = max(last.get(int(name), -1), int(position))
    return last
