"""Node processes and loaders for the shared-queue tests.

Everything here is module-level so that it pickles for spawned processes. A node runs
``shared_queue`` exactly as a training script would and records what it did to files in
``out_dir`` (one file per process, appended line by line), which the tests then check against
the claims in the mailbox:

- ``consumed-{learner}.txt``: ``identifier step`` per batch the training loop received;
- ``loaded-{learner}-{pid}.txt``: ``identifier`` per unit a loader started (worker processes
  included);
- ``node-{learner}.json``: start and end time, batches, units claimed (``units_claimed_by``).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from process_harness import join_all  # tests/helpers/ is on sys.path (tests/conftest.py)

from gradientmail import Unit, units_claimed_by
from gradientmail.layout import CLAIMS_PREFIX
from gradientmail.patterns.shared_queue import shared_queue


@dataclass(frozen=True)
class Item:
    """A test unit: ``steps`` batches named after the unit, so every batch says where it came from."""

    name: str
    index: int
    steps: int = 1


def named_units(count: int, steps: int = 1) -> dict[str, Item]:
    return {f"{i:05d}": Item(f"{i:05d}", i, steps) for i in range(count)}


def _append(path: Path, line: str) -> None:
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(line + "\n")


@dataclass(frozen=True)
class RecordingLoad:
    """Loads an ``Item`` (or a ``Unit`` of the design note's grid): records the unit, sleeps ``delay`` per batch.

    Each batch is ``tensor([index, step])`` so the consumer can tell which unit it came from.
    """

    out_dir: str
    learner: str
    delay: float = 0.0

    def __call__(self, value: Item | Unit):
        if isinstance(value, Unit):
            name = f"{value.first:06d}-{value.lane}.json"
            index, first, count = value.first * value.lanes + value.lane, value.first, value.count
        else:
            name, index, first, count = value.name, value.index, 0, value.steps
        _append(Path(self.out_dir) / f"loaded-{self.learner}-{os.getpid()}.txt", name)
        for step in range(first, first + count):
            if self.delay:
                time.sleep(self.delay)
            yield step, torch.tensor([index, step])


@dataclass
class NodeSpec:
    mailbox: Any
    learner: str
    units: dict[str, Any]
    out_dir: str
    delay: float = 0.0
    workers: int = 1
    prefetch: int = 4
    order: list[str] | None = None
    step_time: float = 0.0  # the training loop's time per batch (a sleep): the node's speed
    stop_after: int | None = None
    resume: bool | None = None  # shared_queue's default when None
    barrier: Any = None
    names: dict[int, str] = field(default_factory=dict)


def run_node(spec: NodeSpec) -> None:
    """One node: wait for the others, drain the queue, record every batch."""
    out = Path(spec.out_dir)
    names = spec.names or {}
    load = RecordingLoad(spec.out_dir, spec.learner, spec.delay)
    if spec.barrier is not None:
        spec.barrier.wait(timeout=60)
    start = time.monotonic()
    claimed_before = units_claimed_by(spec.learner)  # a forked node inherits its parent's counts
    received = 0
    lines = []
    with shared_queue(
        spec.units,
        mailbox=spec.mailbox,
        learner_id=spec.learner,
        load=load,
        prefetch=spec.prefetch,
        workers=spec.workers,
        order=spec.order,
        **({} if spec.resume is None else {"resume": spec.resume}),
    ) as batches:
        for step, batch in batches:
            if spec.step_time:
                time.sleep(spec.step_time)
            index, batch_step = (int(v) for v in batch)
            assert batch_step == step
            lines.append(f"{names.get(index, f'{index:05d}')} {step}")
            received += 1
            if spec.stop_after is not None and received >= spec.stop_after:
                break
    end = time.monotonic()
    (out / f"consumed-{spec.learner}.txt").write_text("".join(line + "\n" for line in lines))
    (out / f"node-{spec.learner}.json").write_text(
        json.dumps(
            {
                "start": start,
                "end": end,
                "batches": received,
                "units_claimed": units_claimed_by(spec.learner) - claimed_before,
            }
        )
    )


def run_nodes(specs: list[NodeSpec], *, isolated: bool = False, timeout: float = 120) -> None:
    """Fork one process per spec (sharing a start barrier) and wait for all to succeed.

    ``isolated`` first spawns a clean launcher process that forks the nodes: for tests whose
    process runs threads (moto's server), which must not be forked mid-request. Spawning each
    node instead would import torch once per node (seconds each on a small CI machine).
    """
    if isolated:
        launcher = multiprocessing.get_context("spawn").Process(
            target=_launch, args=(specs, timeout), name="node launcher"
        )
        launcher.start()
        launcher.join(timeout + 60)
        if launcher.is_alive():
            launcher.kill()
            launcher.join()
        assert launcher.exitcode == 0, f"node launcher failed ({launcher.exitcode}); see its output"
        return
    context = multiprocessing.get_context("fork")
    barrier = context.Barrier(len(specs))
    processes = []
    for spec in specs:
        spec.barrier = barrier
        processes.append(context.Process(target=run_node, args=(spec,), name=f"node {spec.learner}"))
    for process in processes:
        process.start()
    codes = join_all(processes, timeout)
    failed = {p.name: code for p, code in zip(processes, codes) if code != 0}
    assert not failed, f"node processes failed: {failed}"


def _launch(specs: list[NodeSpec], timeout: float) -> None:
    # A spawned process defaults to spawning its own children; a node started by torchrun or
    # SLURM is a fresh interpreter whose DataLoader forks workers (Linux), as here.
    multiprocessing.set_start_method("fork", force=True)
    run_nodes(specs, timeout=timeout)


def read_lines(out_dir: str | Path, pattern: str) -> dict[str, list[str]]:
    """File name → its lines, for every file matching ``pattern`` in ``out_dir``."""
    return {
        path.name: path.read_text().split() if pattern.startswith("loaded") else path.read_text().splitlines()
        for path in sorted(Path(out_dir).glob(pattern))
    }


def claims(mailbox: Any) -> dict[str, dict[str, Any]]:
    """Identifier → claim body for every claim in the mailbox."""
    found = {}
    for key in mailbox.list(CLAIMS_PREFIX):
        found[key[len(CLAIMS_PREFIX) :]] = json.loads(mailbox.get(key))
    return found


# -- checks on what the node processes recorded -----------------------------------------------
def consumed_by_learner(out: Path) -> dict[str, list[tuple[str, int]]]:
    """Learner → the (identifier, step) pairs its training loop received, in order."""
    result = {}
    for name, lines in read_lines(out, "consumed-*.txt").items():
        learner = name[len("consumed-") : -len(".txt")]
        result[learner] = [(ident, int(step)) for ident, step in (line.split() for line in lines)]
    return result


def loads_per_unit(out: Path) -> Counter[str]:
    """How many times each unit's loader was started, over every process and worker."""
    loads: Counter[str] = Counter()
    for names in read_lines(out, "loaded-*.txt").values():
        loads.update(names)
    return loads


def node_report(out: Path, learner: str) -> dict:
    return json.loads((out / f"node-{learner}.json").read_text())


def check_exactly_once(mailbox, out: Path, units: dict, steps_of) -> dict[str, list[str]]:
    """Every step of every unit consumed once in all, only by its claim's owner; returns units per learner."""
    owners = {ident: claim["learner"] for ident, claim in claims(mailbox).items()}
    assert set(owners) == set(units), "every unit is claimed, and only units of the mapping"
    consumed = consumed_by_learner(out)
    seen: Counter[tuple[str, int]] = Counter()
    for learner, pairs in consumed.items():
        for ident, _ in pairs:
            assert owners[ident] == learner, f"{learner} consumed {ident}, claimed by {owners[ident]}"
        seen.update(pairs)
    expected = {(ident, step) for ident in units for step in steps_of(units[ident])}
    assert set(seen) == expected
    assert max(seen.values()) == 1, [pair for pair, n in seen.items() if n > 1][:5]
    loaded = loads_per_unit(out)
    assert set(loaded) == set(units) and max(loaded.values()) == 1, "a unit was loaded twice"
    by_learner: dict[str, list[str]] = {}
    for ident, learner in owners.items():
        by_learner.setdefault(learner, []).append(ident)
    for learner in consumed:
        # units_claimed_by counts the claims of the node's DataLoader worker processes too.
        assert node_report(out, learner)["units_claimed"] == len(by_learner.get(learner, []))
    return by_learner
