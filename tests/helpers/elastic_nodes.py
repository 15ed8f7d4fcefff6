"""Node processes for the elastic shared-queue tests (module-level, so that they pickle).

A node runs ``shared_queue`` with ``resume=`` / ``lease=`` exactly as a training script would and
appends what it did to files in ``out_dir`` as it goes (one ``open``/``write`` per line, so a
SIGKILL loses nothing the node had done):

- ``consumed-{learner}-{run}.txt``: ``identifier step`` per batch its training loop received;
- ``written-{learner}.txt``: ``identifier step`` per progress record whose write had completed
  (``ProgressLog``), from which a test bounds what a killed node can have left unrecorded.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from process_harness import join_all  # tests/helpers/ is on sys.path (tests/conftest.py)
from queue_nodes import RecordingLoad

from gradientmail.layout import WORK_PREFIX
from gradientmail.mailbox.wrappers import MailboxWrapper
from gradientmail.patterns.shared_queue import shared_queue
from gradientmail.queue.takeover import take_over


def _append(path: Path, line: str) -> None:
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(line + "\n")


class ProgressLog(MailboxWrapper):
    """Logs every completed write of a progress record (``work/{learner}/...``) to a file:
    ``identifier value`` per write, ``value`` the record's ``field`` (-1 when it has none), into
    ``written-{learner}.txt`` or ``written-{learner}-{run}.txt`` (one log per incarnation)."""

    def __init__(self, inner: Any, out_dir: str, learner: str, field: str = "step", run: int | None = None) -> None:
        super().__init__(inner)
        self.out_dir = out_dir
        self.learner = learner
        self.field = field
        self.run = run

    def __reduce__(self):
        return (ProgressLog, (self.inner, self.out_dir, self.learner, self.field, self.run))

    def put(self, key: str, data: bytes) -> None:
        self.inner.put(key, data)
        prefix = f"{WORK_PREFIX}{self.learner}/"
        if key.startswith(prefix):
            import json

            value = json.loads(data).get(self.field)
            name = self.learner if self.run is None else f"{self.learner}-{self.run}"
            _append(
                Path(self.out_dir) / f"written-{name}.txt", f"{key[len(prefix) :]} {-1 if value is None else value}"
            )


@dataclass
class ElasticSpec:
    mailbox: Any
    learner: str
    units: dict[str, Any]
    out_dir: str
    run: int = 1
    delay: float = 0.0  # seconds per batch loaded
    train: float = 0.0  # seconds per batch consumed
    workers: int = 1
    prefetch: int = 4
    resume: bool | None = False  # None: shared_queue's default
    lease_s: float | None = None
    stop_after: int | None = None
    kill_after: int | None = None
    barrier: Any = None
    order: list[str] | None = None
    names: dict[int, str] = field(default_factory=dict)
    session_every: float | None = None  # train inside a Session exchanging this often (seconds)
    fragments: int = 1


def run_elastic_node(spec: ElasticSpec) -> None:
    out = Path(spec.out_dir)
    mailbox = ProgressLog(spec.mailbox, spec.out_dir, spec.learner)
    load = RecordingLoad(spec.out_dir, spec.learner, spec.delay)
    lease = timedelta(seconds=spec.lease_s) if spec.lease_s else None
    if spec.barrier is not None:
        spec.barrier.wait(timeout=60)
    consumed = out / f"consumed-{spec.learner}-{spec.run}.txt"
    received = 0
    session, model = _session(spec, mailbox)
    with (
        session,
        shared_queue(
            spec.units,
            mailbox=mailbox,
            learner_id=spec.learner,
            load=load,
            prefetch=spec.prefetch,
            workers=spec.workers,
            order=spec.order,
            **({} if spec.resume is None else {"resume": spec.resume}),  # None: the default
            lease=lease,
        ) as batches,
    ):
        for step, batch in batches:
            index, batch_step = (int(v) for v in batch)
            assert batch_step == step
            _append(consumed, f"{spec.names.get(index, f'{index:05d}')} {step}")
            if spec.train:
                time.sleep(spec.train)
            if model is not None:
                with torch.no_grad():
                    model.weight.add_(1.0)
                session.step(samples=1)
            received += 1
            if spec.kill_after is not None and received >= spec.kill_after:
                os.kill(os.getpid(), signal.SIGKILL)
            if spec.stop_after is not None and received >= spec.stop_after:
                break


def _session(spec: ElasticSpec, mailbox: Any) -> tuple[Any, Any]:
    """A ``Session`` over a small model (one sample per batch), or a no-op context without one."""
    if spec.session_every is None:
        return contextlib.nullcontext(), None
    from gradientmail import Session

    model = torch.nn.Linear(8, 8)
    every = timedelta(seconds=spec.session_every)
    return Session(model, mailbox=mailbox, learner_id=spec.learner, every=every, fragments=spec.fragments), model


def run_elastic_nodes(specs: list[ElasticSpec], *, timeout: float = 60, killed: set[str] = frozenset()) -> None:
    """Fork one process per spec (sharing a start barrier); all but ``killed`` must succeed."""
    context = multiprocessing.get_context("fork")
    barrier = context.Barrier(len(specs))
    processes = []
    for spec in specs:
        spec.barrier = barrier
        processes.append(context.Process(target=run_elastic_node, args=(spec,), name=spec.learner))
    for process in processes:
        process.start()
    codes = dict(zip((p.name for p in processes), join_all(processes, timeout)))
    for name, code in codes.items():
        expected = -signal.SIGKILL if name in killed else 0
        assert code == expected, f"node processes ended with {codes} (expected {name}: {expected})"


def consumed_pairs(out_dir: str | Path) -> dict[str, list[tuple[str, int]]]:
    """``{learner}-{run}`` → the (identifier, step) pairs its training loop received, in order."""
    result = {}
    for path in sorted(Path(out_dir).glob("consumed-*.txt")):
        name = path.name[len("consumed-") : -len(".txt")]
        result[name] = [(ident, int(step)) for ident, step in (line.split() for line in path.read_text().splitlines())]
    return result


def written_steps(out_dir: str | Path, learner: str) -> dict[str, int]:
    """Unit → the last step of ``learner``'s progress records known to have been written."""
    path = Path(out_dir) / f"written-{learner}.txt"
    last: dict[str, int] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            ident, step = line.split()
            last[ident] = max(last.get(ident, -1), int(step))
    return last


def reclaim_racer(root: Any, learner: str, identifiers: list[str], barrier, results) -> None:
    """Try to take over every orphaned unit in ``identifiers`` (``root``: a directory path or a
    mailbox); report the ones won."""
    from gradientmail import LocalMailbox

    mailbox = LocalMailbox(root, create=False) if isinstance(root, str) else root
    mailbox.get("run.json")  # connect first: the race is the takeovers, not start-up
    barrier.wait(timeout=60)
    won = [
        ident
        for ident in identifiers
        if take_over(
            mailbox, ident, learner, f"incarnation-{learner}", expect=lambda claim: claim.get("learner") == "dead"
        )
        is not None
    ]
    results.put((learner, won))
