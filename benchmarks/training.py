"""Does GradientMail reach DDP's model quality in a fraction of DDP's time? Real training, 4 nodes.

A byte-level MLP (414k parameters: 64 bytes of context, embedding 16, one GELU layer of 320)
learns to predict the next byte of the Python standard library's own ``.py`` files (every 10th
file held out for validation; nothing is downloaded). Four node processes emulate machines of
speeds 1:2:2:4 by padding each batch to 12/24/24/48 ms (``--quick``: 1/2/2/4 ms), and every method
starts from the same initial parameters with Adam (lr 2e-3) on the same units of 20 batches of
32 contexts: 96 units per pass by default, 384 with ``--long`` (4x: the README's figures):

- ``single``: one process trains all the units in order, no padding: the quality yardstick;
- ``ddp``: ``torch.distributed`` (gloo, 4 ranks), a fixed quarter of the units per rank,
  gradients all-reduced every step, so every step waits for the slowest rank;
- ``fixed_split``: the same quarters without any exchange, the 4 models averaged at the end;
- ``gradientmail:<outer>``: ``shared_queue`` over the units (fast nodes take more) and a
  ``Session`` (fragments chosen by the Session), one run per outer optimizer and one with the
  state in bfloat16; its model is ``consensus``;
- time to quality: GradientMail again over two passes of the data while a monitor process
  evaluates ``consensus`` every 0.5 s and stops the nodes once DDP's final loss is reached.

Exchange cadence: about 25 local steps of the fastest node per exchange, by time, so
slower nodes take proportionally fewer (about 25/12/12/6 steps at 12/24/24/48 ms). The
parent measures one unpadded training step of this model (median of 40, one thread) and sets
``every_s = 25 x max(fastest pad, step)``: the pad counts the step inside it (a batch takes at
least its pad from its start), so on this machine ``every_s`` is 25 x 12 ms = 0.3 s. ``--every
S`` overrides it; the header prints the resulting H (fastest node's local steps per exchange).

Validation loss is the mean cross-entropy (nats per byte) over 4,096 fixed held-out contexts.
Makespan is first start to last node finished (start-up excluded, every method alike).
Figures: ``loss_over_ddp`` and ``loss_over_single`` (GradientMail's one-pass loss over theirs),
``makespan_over_ddp``, ``time_to_ddp_loss`` (seconds to DDP's loss / DDP's makespan); each also
per outer optimizer, with its min and max over ``--repeats`` (the plain key is the median).
The verdicts printed at the end are the targets of the mode run: one pass at H ~ 25
(``pass_loss_over_ddp``, ``makespan_over_ddp``, ``time_to_ddp_loss``) or ``--long``
(``long_loss_over_ddp``, ``long_time_to_ddp_loss``, ``long_makespan_over_ddp``); the JSON line
repeats the medians under those names.

Usage: ``python -m benchmarks.training [--quick | --long] [--repeats K] [--every S] [--png PATH]``.
The one-pass run (3 repeats) takes about 8 minutes on 2 cores; ``--long`` (3 repeats) about 28
minutes and draws ``docs/training-loss.png`` (the one-pass run draws only with ``--png``);
``--quick`` (CI: ``tests/project/test_training_benchmark.py``) runs every method on 8 units of 4
batches at 1-4 ms per batch in 10-30 s, and judges nothing. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import multiprocessing.context
import os
import shutil
import statistics
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from benchmarks._common import TARGETS, emit, table, verdicts
from benchmarks._training_nodes import (
    BATCH,
    OUTERS,
    WIRE_VARIANTS,
    MonitorConfig,
    NodeConfig,
    Plan,
    make_model,
    measure_step_s,
    monitor_main,
    node_main,
    validation_loss,
    validation_set,
)

PASS = Plan(
    units=96,
    unit_batches=20,
    sleeps=(0.012, 0.024, 0.024, 0.048),
    every_s=None,  # derived: EXCHANGE_STEPS local steps of the fastest node
    monitor_s=0.5,
    checkpoint_s=1.0,
    timeout_s=240.0,
)
LONG = replace(PASS, units=4 * PASS.units, checkpoint_s=2.0, timeout_s=4 * PASS.timeout_s)
"""``--long``: 4x the units of one pass for every method (the README's figures)."""
QUICK = Plan(
    units=8,
    unit_batches=4,
    sleeps=(0.001, 0.002, 0.002, 0.004),
    every_s=None,
    monitor_s=0.2,
    checkpoint_s=0.25,
    timeout_s=180.0,  # a guard against a hang: a busy machine's process start-ups alone can take a minute
)
PLANS = {"quick": QUICK, "pass": PASS, "long": LONG}
GROUP_SIZE = 2
"""``--groups``: processes per learner (a "machine" of 2 GPUs)."""
GROUP_SLEEPS = {"quick": (0.001, 0.001, 0.002, 0.002), "pass": (0.012, 0.012, 0.024, 0.024)}
"""``--groups``: speeds 1:1:2:2, group 0 the two fast processes, group 1 the two slow ones."""
EXCHANGE_STEPS = 25
"""Exchange at about 25 local steps of the fastest node (by time: slower nodes take fewer)."""
VERDICTS: dict[str, dict[str, str]] = {
    "pass": {
        "pass_loss_over_ddp": "loss_over_ddp",
        "makespan_over_ddp": "makespan_over_ddp",
        "time_to_ddp_loss": "time_to_ddp_loss",
        "int8_loss_over_float32": "int8_loss_over_float32",
    },
    "long": {
        "long_loss_over_ddp": "loss_over_ddp",
        "long_time_to_ddp_loss": "time_to_ddp_loss",
        "long_makespan_over_ddp": "makespan_over_ddp",
        "int8_loss_over_float32": "int8_loss_over_float32",
    },
}
"""Per mode: the target judged (a ``TARGETS`` name) and the figure (median) it judges."""
DEFAULT_OUTER = OUTERS[0]
INT8_VARIANT = f"{DEFAULT_OUTER}+int8"
"""The default outer over the simulated 8-bit wire: its loss is judged against float32's."""
VARIANTS = (*OUTERS, *WIRE_VARIANTS)
"""Every Session variant run for one pass; the time-to-quality runs are for ``OUTERS``."""
DEFAULT_PNG = Path(__file__).resolve().parent.parent / "docs" / "training-loss.png"
MAX_FILE_BYTES = 200_000
VALIDATION_EVERY = 10
"""Every 10th file (sorted by path) is held out for validation."""

RATIOS = ("loss_over_ddp", "loss_over_single", "makespan_over_ddp", "time_to_ddp_loss")

Curve = list[tuple[float, float]]
"""(seconds since the run's start, validation loss)"""


# -- the corpus ----------------------------------------------------------------------------------


def stdlib_files() -> list[Path]:
    """The standard library's ``.py`` files, sorted, without tests, site-packages or huge files."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "__pycache__"}
    found = []
    for directory, subdirectories, files in os.walk(root):
        subdirectories[:] = sorted(name for name in subdirectories if name not in skip)
        for name in files:
            path = Path(directory, name)
            if name.endswith(".py") and path.stat().st_size <= MAX_FILE_BYTES:
                found.append(path)
    return sorted(found)


@dataclass(frozen=True)
class Corpus:
    files: int
    train_bytes: int
    validation_bytes: int


def write_corpus(data_dir: Path) -> Corpus:
    """``train.bin`` and ``val.bin`` (every 10th file), the files separated by a blank line,
    written as token files (a byte per ``uint16`` token) by ``gradientmail.data.write_tokens``."""
    from gradientmail.data import write_tokens

    files = stdlib_files()
    train = b"\n\n".join(p.read_bytes() for i, p in enumerate(files) if i % VALIDATION_EVERY)
    held_out = b"\n\n".join(p.read_bytes() for i, p in enumerate(files) if not i % VALIDATION_EVERY)
    for name, text in (("train", train), ("val", held_out)):
        raw = data_dir / f"{name}.txt"
        raw.write_bytes(text)
        write_tokens(data_dir / f"{name}.bin", [raw])  # bytes as tokens, exactly these bytes
        raw.unlink()
    return Corpus(len(files), len(train), len(held_out))


# -- running node processes ----------------------------------------------------------------------


@dataclass
class Run:
    """What one method's run produced."""

    method: str
    loss: float  # final validation loss
    makespan: float  # seconds, first start to last end
    curve: Curve = field(default_factory=list)
    seconds_to_target: float | None = None  # time-to-quality runs: None = never reached
    detail: str = ""
    fragments: int | None = None  # gradientmail: Session.fragments
    int8_over_sent: float | None = None  # +int8: bytes as 8-bit values / float32 bytes written
    read_per_exchange: float | None = None  # model sizes a learner read per whole exchange (mean)
    written_per_exchange: float | None = None  # ... and wrote


def pick_temp_root() -> str | None:
    """``/dev/shm`` when writable (mail then costs no disk time), else the default temp dir."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


def node_context() -> multiprocessing.context.BaseContext:
    """Fresh processes forked from a server that imported torch once (4 imports cost ~10 s here)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(
        [
            "torch",
            "torch._dynamo",
            "torch.distributed",
            "benchmarks._training_nodes",
            "gradientmail.session",
            "gradientmail.queue.context",
        ]
    )
    return context


def stop(processes: Iterable[multiprocessing.process.BaseProcess]) -> None:
    """End what is still running (after a failure or a timeout), politely first."""
    started = [process for process in processes if process.pid is not None]
    for process in started:
        if process.is_alive():
            process.terminate()
    for process in started:
        process.join(timeout=5)
        if process.is_alive():
            process.kill()
            process.join(timeout=5)


class Bench:
    """Runs each method in fresh processes and evaluates the models they leave behind."""

    def __init__(self, plan: Plan, base: Path, data_dir: Path) -> None:
        self.plan = plan
        self.base = base
        self.data_dir = data_dir
        self.context = node_context()
        self.validation = validation_set(data_dir)
        self.model = make_model()
        self.initial_loss = validation_loss(self.model, self.validation)
        self.runs = 0

    # -- plumbing --

    def run_dir(self, label: str) -> Path:
        self.runs += 1
        path = self.base / f"{self.runs:02d}-{label.replace(':', '-')}"
        path.mkdir()
        return path

    def start(self, jobs: Sequence[tuple[Callable[[Any], None], Any]], run_dir: Path) -> list[dict]:
        """Run ``target(config)`` for each job in its own process; their results, in order."""
        processes = [
            self.context.Process(target=target, args=(config,), name=config.name, daemon=True)
            for target, config in jobs
        ]
        try:
            for process in processes:
                process.start()
            deadline = time.monotonic() + self.plan.timeout_s
            while any(process.is_alive() for process in processes):
                failed = [p for p in processes if p.exitcode not in (None, 0)]
                if failed:
                    raise RuntimeError(self.failure(run_dir, failed[0].name, failed[0].exitcode))
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{run_dir.name}: still running after {self.plan.timeout_s:.0f}s")
                time.sleep(0.05)
            for process in processes:
                if process.exitcode != 0:
                    raise RuntimeError(self.failure(run_dir, process.name, process.exitcode))
            return [json.loads((run_dir / f"result-{config.name}.json").read_text()) for _, config in jobs]
        finally:
            stop(processes)

    @staticmethod
    def failure(run_dir: Path, name: str, exitcode: int | None) -> str:
        report = run_dir / f"result-{name}.json"
        error = json.loads(report.read_text()).get("error", "") if report.exists() else ""
        return f"{run_dir.name}: {name} exited with code {exitcode}\n{error}"

    def node(self, method: str, rank: int, run_dir: Path, **options: Any) -> NodeConfig:
        return NodeConfig(
            method=method,
            name=f"node-{rank}",
            rank=rank,
            world=self.plan.nodes,
            data_dir=str(self.data_dir),
            run_dir=str(run_dir),
            plan=self.plan,
            sleep_s=self.plan.sleeps[rank],
            **options,
        )

    def quarters(self) -> list[tuple[int, ...]]:
        """Rank r trains units r, r + 4, ... (a DistributedSampler-style fixed split)."""
        return [tuple(range(rank, self.plan.units, self.plan.nodes)) for rank in range(self.plan.nodes)]

    # -- evaluation --

    def loss_of(self, states: Sequence[dict[str, torch.Tensor]]) -> float:
        """Validation loss of the parameter average of ``states`` (one state: that model)."""
        averaged = {name: sum(state[name].float() for state in states) / len(states) for name in states[0]}
        self.model.load_state_dict(averaged)
        return validation_loss(self.model, self.validation)

    def checkpoint_curve(self, results: Sequence[dict], start: float) -> Curve:
        """The average of every node's k-th checkpoint (or its last, if it finished), for each k."""
        saved = [result["checkpoints"] for result in results if result["checkpoints"]]
        curve = [(0.0, self.initial_loss)]
        for k in range(max((len(s) for s in saved), default=0)):
            picks = [s[min(k, len(s) - 1)] for s in saved]
            states = [torch.load(path, weights_only=True) for _, path in picks]
            curve.append((max(at for at, _ in picks) - start, self.loss_of(states)))
        return curve

    def consensus_loss(self, run_dir: Path) -> float:
        from gradientmail import LocalMailbox, consensus

        consensus(LocalMailbox(run_dir / "mailbox"), self.model)
        return validation_loss(self.model, self.validation)

    # -- the methods --

    def fixed(self, method: str, checkpoints: bool) -> Run:
        """single, ddp or fixed_split: fixed units per process, then the final model(s)."""
        run_dir = self.run_dir(method)
        if method == "single":
            configs = [
                replace(
                    self.node(method, 0, run_dir, checkpoints=checkpoints),
                    world=1,
                    sleep_s=0.0,
                    units=tuple(range(self.plan.units)),
                )
            ]
        else:
            configs = [
                self.node(method, rank, run_dir, units=units, checkpoints=checkpoints)
                for rank, units in enumerate(self.quarters())
            ]
        results = self.start([(node_main, config) for config in configs], run_dir)
        start = min(r["start"] for r in results)
        makespan = max(r["end"] for r in results) - start
        finals = [torch.load(run_dir / f"final-{c.name}.pt", weights_only=True) for c in configs]
        loss = self.loss_of(finals[:1] if method == "ddp" else finals)
        curve = self.checkpoint_curve(results[:1] if method == "ddp" else results, start) if checkpoints else []
        shutil.rmtree(run_dir)
        return Run(method, loss, makespan, curve)

    def gradientmail(self, outer: str, target: float | None = None) -> Run:
        """One pass (``target`` None) or two passes with a monitor that stops at ``target``."""
        passes = 1 if target is None else 2
        label = f"gradientmail:{outer}" + ("" if target is None else ":to-target")
        run_dir = self.run_dir(label)
        configs = [
            self.node("gradientmail", rank, run_dir, passes=passes, outer=outer) for rank in range(self.plan.nodes)
        ]
        jobs: list[tuple[Callable[[Any], None], Any]] = [(node_main, c) for c in configs]
        if target is not None:
            monitor = MonitorConfig(
                name="monitor",
                run_dir=str(run_dir),
                data_dir=str(self.data_dir),
                plan=self.plan,
                nodes=self.plan.nodes,
                target=target,
                deadline_s=self.plan.timeout_s - 10,
            )
            jobs.append((monitor_main, monitor))
        results = self.start(jobs, run_dir)
        nodes = results[: self.plan.nodes]
        start = min(r["start"] for r in nodes)
        makespan = max(r["end"] for r in nodes) - start
        detail = (
            f"units {'/'.join(str(r['units']) for r in nodes)}, "
            f"batches {'/'.join(str(r['batches']) for r in nodes)}, "
            f"merges {'/'.join(str(r['merges']) for r in nodes)}, "
            f"fragment exchanges {'/'.join(str(r['exchanges']) for r in nodes)} of {nodes[0]['fragments']} "
            f"fragment(s), outer {nodes[0]['outer']}"
            + (", stopped at the target" if any(r["stopped"] for r in nodes) else "")
        )
        if target is None:
            run = Run(label, self.consensus_loss(run_dir), makespan, detail=detail)
        else:
            watched = results[-1]
            curve = [(0.0, self.initial_loss)] + [(at - start, loss) for at, loss in watched["points"]]
            reached = watched["reached_at"]
            run = Run(label, curve[-1][1], makespan, curve, None if reached is None else reached - start, detail)
        run.fragments = nodes[0]["fragments"]
        run.read_per_exchange, run.written_per_exchange = per_exchange(nodes)
        sent = sum(r.get("state_bytes_sent") or 0 for r in nodes)
        if sent:
            run.int8_over_sent = sum(r.get("state_bytes_int8") or 0 for r in nodes) / sent
        shutil.rmtree(run_dir)
        return run

    def groups(self, outer: str) -> Run:
        """``GROUP_SIZE`` processes per learner, DDP inside each group, ``group=`` across."""
        run_dir = self.run_dir(f"groups:{outer}")
        configs = [
            self.node("groups", rank, run_dir, outer=outer, group_size=GROUP_SIZE) for rank in range(self.plan.nodes)
        ]
        results = self.start([(node_main, config) for config in configs], run_dir)
        start = min(r["start"] for r in results)
        makespan = max(r["end"] for r in results) - start
        leaders = results[::GROUP_SIZE]  # each group's rank 0: the only one that talks to the store
        detail = (
            f"batches {'/'.join(str(r['batches']) for r in results)}, "
            f"merges {'/'.join(str(r['merges']) for r in leaders)}, "
            f"fragment exchanges {'/'.join(str(r['exchanges']) for r in leaders)} of {leaders[0]['fragments']}"
        )
        run = Run(f"groups:{outer}", self.consensus_loss(run_dir), makespan, detail=detail)
        run.fragments = leaders[0]["fragments"]
        run.read_per_exchange, run.written_per_exchange = per_exchange(leaders)
        shutil.rmtree(run_dir)
        return run


def per_exchange(results: Sequence[dict]) -> tuple[float | None, float | None]:
    """Model sizes read and written per whole exchange, the mean over the learners that exchanged."""
    exchanged = [r for r in results if r.get("whole_exchanges")]
    if not exchanged:
        return None, None
    read = statistics.mean(r["bytes_read"] / r["model_bytes"] / r["whole_exchanges"] for r in exchanged)
    written = statistics.mean(r["bytes_written"] / r["model_bytes"] / r["whole_exchanges"] for r in exchanged)
    return read, written


# -- the exchange cadence ------------------------------------------------------------------------


@dataclass(frozen=True)
class Cadence:
    """How often the Session exchanges, and what that is in the fastest node's local steps."""

    every_s: float  # Session(every=...)
    steps: float  # H: local steps of the fastest node per exchange
    batch_s: float  # the fastest node's seconds per batch
    step_s: float  # one unpadded training step, measured in the parent
    chosen: bool  # --every gave every_s

    def text(self, pad_s: float) -> str:
        chosen = " (--every)" if self.chosen else f" = {EXCHANGE_STEPS} x {self.batch_s * 1000:.1f} ms"
        return (
            f"Session every {self.every_s:.3g}s{chosen}: H = {self.steps:.1f} local steps of the fastest node "
            f"per exchange (its batch: max(pad {pad_s * 1000:g} ms, unpadded step {self.step_s * 1000:.1f} ms "
            "measured here))"
        )


def cadence(plan: Plan, step_s: float, every_s: float | None = None) -> Cadence:
    """``every_s`` (``None``: ``EXCHANGE_STEPS`` batches of the fastest node) and its H.

    A node's batch takes ``max(pad, step)``: ``pad()`` sleeps what is left of the pad after the
    step, so the step hides inside the pad unless it is longer.
    """
    batch_s = max(min(plan.sleeps), step_s)
    chosen = every_s is not None
    every = every_s if every_s is not None else EXCHANGE_STEPS * batch_s
    return Cadence(every, every / batch_s, batch_s, step_s, chosen)


# -- figures -------------------------------------------------------------------------------------


def fluid_bounds(plan: Plan) -> tuple[float, float]:
    """Seconds of padding a pass needs: shared by speed (no schedule beats it), fixed quarters."""
    batches = plan.units * plan.unit_batches
    return batches / sum(1 / s for s in plan.sleeps), batches / plan.nodes * max(plan.sleeps)


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None:
        return None
    return numerator / denominator


def repeat_figures(runs: dict[str, Run], single: Run) -> dict[str, float | None]:
    """The ratios of one repeat, per outer (``_{outer}``), the default outer's also unsuffixed."""
    ddp = runs["ddp"]
    figures: dict[str, float | None] = {}
    for outer in VARIANTS:
        one_pass = runs.get(f"gradientmail:{outer}")
        to_target = runs.get(f"gradientmail:{outer}:to-target")
        outer = suffix(outer)
        seconds = None
        if to_target is not None:
            seconds = math.inf if to_target.seconds_to_target is None else to_target.seconds_to_target
        loss = None if one_pass is None else one_pass.loss
        figures[f"loss_over_ddp_{outer}"] = ratio(loss, ddp.loss)
        figures[f"loss_over_single_{outer}"] = ratio(loss, single.loss)
        figures[f"makespan_over_ddp_{outer}"] = ratio(None if one_pass is None else one_pass.makespan, ddp.makespan)
        figures[f"time_to_ddp_loss_{outer}"] = ratio(seconds, ddp.makespan)
    for name in RATIOS:
        figures[name] = figures[f"{name}_{DEFAULT_OUTER}"]
    int8, float32 = runs.get(f"gradientmail:{INT8_VARIANT}"), runs.get(f"gradientmail:{DEFAULT_OUTER}")
    figures["int8_loss_over_float32"] = ratio(
        None if int8 is None else int8.loss, None if float32 is None else float32.loss
    )
    figures["int8_bytes_over_float32"] = None if int8 is None else int8.int8_over_sent
    fixed = runs.get("fixed_split")
    figures["fixed_split_loss_over_ddp"] = ratio(None if fixed is None else fixed.loss, ddp.loss)
    figures["fixed_split_makespan_over_ddp"] = ratio(None if fixed is None else fixed.makespan, ddp.makespan)
    return figures


def spread(values: Sequence[float | None]) -> tuple[float | None, float | None, float | None]:
    """(min, median, max) of the repeats that measured it; None if none did."""
    present = [v for v in values if v is not None]
    if not present:
        return None, None, None
    return min(present), statistics.median(present), max(present)


def session_figures(quick: bool) -> dict[str, float]:
    """``drag`` and ``read_per_exchange``, measured by ``benchmarks.session_figures``."""
    from benchmarks.session_figures import measure_drag, measure_read_per_exchange

    return {"drag": measure_drag(quick), "read_per_exchange": measure_read_per_exchange(quick)}


def draw(
    path: Path, curves: dict[str, Curve], finals: dict[str, tuple[float, float]], ddp_loss: float, title: str
) -> None:
    """Validation loss against wall-clock seconds, DDP's final loss dashed."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    figure = Figure(figsize=(9, 5.5))
    axes = figure.subplots()
    for label, curve in curves.items():
        if curve:
            axes.plot([s for s, _ in curve], [loss for _, loss in curve], marker=".", label=label)
    for label, (seconds, loss) in finals.items():
        axes.plot([seconds], [loss], marker="*", markersize=12, linestyle="none", label=label)
    axes.axhline(ddp_loss, color="black", linestyle="--", linewidth=1, label=f"DDP final loss {ddp_loss:.3f}")
    lows = [loss for curve in curves.values() for _, loss in curve]
    axes.set_ylim(min(lows + [ddp_loss]) - 0.05, ddp_loss + 1.0)
    axes.set_xlabel("wall-clock seconds since the start")
    axes.set_ylabel("validation loss (nats per byte)")
    axes.set_title(title, fontsize=10)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110, bbox_inches="tight")


def fmt(value: float | None, digits: int = 3) -> str:
    if value is None:
        return "-"
    if math.isinf(value):
        return "never"
    return f"{value:.{digits}f}"


# -- main ----------------------------------------------------------------------------------------


def suffix(variant: str) -> str:
    """A variant's figure-name suffix: ``delayed_nesterov+bf16`` -> ``delayed_nesterov_bf16``."""
    return variant.replace("+", "_")


def run_repeats(bench: Bench, outers: Sequence[str], repeats: int, curves: bool) -> list[dict[str, Run]]:
    """Every method once per repeat (the curves in the first only); DDP first: its loss is the target."""
    repeat_runs: list[dict[str, Run]] = []
    for repeat in range(repeats):
        checkpoints = curves and repeat == 0
        runs = {
            "ddp": bench.fixed("ddp", checkpoints=checkpoints),
            "fixed_split": bench.fixed("fixed_split", checkpoints=checkpoints),
        }
        for outer in (*outers, *WIRE_VARIANTS):
            runs[f"gradientmail:{outer}"] = bench.gradientmail(outer)
        for outer in outers:
            runs[f"gradientmail:{outer}:to-target"] = bench.gradientmail(outer, target=runs["ddp"].loss)
        repeat_runs.append(runs)
        shown = ", ".join(f"{name} {run.loss:.4f}/{run.makespan:.1f}s" for name, run in runs.items())
        print(f"repeat {repeat + 1}/{repeats} (val loss/makespan): {shown}", flush=True)
        for name, run in runs.items():
            if run.detail:
                print(f"  {name}: {run.detail}", flush=True)
    return repeat_runs


def fragments_of(repeat_runs: list[dict[str, Run]]) -> int | None:
    """The fragment count the Sessions chose (the same in every run: one model)."""
    counts = {run.fragments for runs in repeat_runs for run in runs.values() if run.fragments is not None}
    return counts.pop() if len(counts) == 1 else None


Spread = tuple[float | None, float | None, float | None]


def collect(single: Run, repeat_runs: list[dict[str, Run]], initial: float) -> tuple[dict[str, Any], dict[str, Spread]]:
    """The JSON figures: ratios (median, min, max over the repeats), then raw medians."""
    per_repeat = [repeat_figures(runs, single) for runs in repeat_runs]
    figures: dict[str, Any] = {}
    spreads: dict[str, Spread] = {}
    for name in per_repeat[0]:
        spreads[name] = spread([f[name] for f in per_repeat])
        low, middle, high = spreads[name]
        figures[name], figures[f"{name}_min"], figures[f"{name}_max"] = middle, low, high

    def raw(method: str, attribute: str) -> float | None:
        values = [getattr(r[method], attribute) for r in repeat_runs if method in r]
        return statistics.median(values) if values else None

    figures["val_loss_initial"] = initial
    figures["val_loss_single"] = single.loss
    figures["seconds_single"] = single.makespan
    for method in ("ddp", "fixed_split"):
        figures[f"val_loss_{method}"] = raw(method, "loss")
        figures[f"makespan_s_{method}"] = raw(method, "makespan")
    for variant in VARIANTS:
        outer = suffix(variant)
        figures[f"val_loss_gradientmail_{outer}"] = raw(f"gradientmail:{variant}", "loss")
        figures[f"makespan_s_gradientmail_{outer}"] = raw(f"gradientmail:{variant}", "makespan")
        times = [
            r[f"gradientmail:{outer}:to-target"].seconds_to_target
            for r in repeat_runs
            if f"gradientmail:{outer}:to-target" in r
        ]
        figures[f"seconds_to_ddp_loss_{outer}"] = (
            None if not times else statistics.median([math.inf if t is None else t for t in times])
        )
        figures[f"val_loss_to_target_{outer}"] = raw(f"gradientmail:{outer}:to-target", "loss")
    figures["repeats"] = len(repeat_runs)
    return figures, spreads


def print_tables(figures: dict[str, Any], spreads: dict[str, Spread], outers: Sequence[str]) -> None:
    """Per method: loss, time and both against DDP (medians); then each ratio's spread."""
    rows = [
        [
            "single (1 process, no padding)",
            fmt(figures["val_loss_single"], 4),
            fmt(figures["seconds_single"], 1),
            fmt(ratio(figures["val_loss_single"], figures["val_loss_ddp"])),
            "-",
        ],
        [
            "ddp (gloo, fixed quarters)",
            fmt(figures["val_loss_ddp"], 4),
            fmt(figures["makespan_s_ddp"], 1),
            "1.000",
            "1.000",
        ],
        [
            "fixed_split (4 models averaged)",
            fmt(figures["val_loss_fixed_split"], 4),
            fmt(figures["makespan_s_fixed_split"], 1),
            fmt(figures["fixed_split_loss_over_ddp"]),
            fmt(figures["fixed_split_makespan_over_ddp"]),
        ],
    ]
    for variant in (*outers, *WIRE_VARIANTS):
        outer = suffix(variant)
        rows.append(
            [
                f"gradientmail:{variant} (1 pass)",
                fmt(figures[f"val_loss_gradientmail_{outer}"], 4),
                fmt(figures[f"makespan_s_gradientmail_{outer}"], 1),
                fmt(figures[f"loss_over_ddp_{outer}"]),
                fmt(figures[f"makespan_over_ddp_{outer}"]),
            ]
        )
    for outer in outers:  # val loss: the consensus when the run ended (at the stop, or pass 2 done)
        rows.append(
            [
                f"gradientmail:{outer} to DDP's loss (<= 2 passes)",
                fmt(figures[f"val_loss_to_target_{outer}"], 4),
                fmt(figures[f"seconds_to_ddp_loss_{outer}"], 1),
                "-",
                fmt(figures[f"time_to_ddp_loss_{outer}"]),
            ]
        )
    print()
    print(
        f"validation loss (initial {figures['val_loss_initial']:.4f}) and wall time, "
        f"median of {figures['repeats']} repeat(s)"
    )
    print(table(["method", "val loss", "time s", "loss/DDP", "time/DDP"], rows))
    print()
    spread_rows = []
    for variant in (*outers, *WIRE_VARIANTS):
        outer = suffix(variant)
        label = f"gradientmail:{variant}" + (" (default)" if variant == DEFAULT_OUTER else "")
        spread_rows.append([label, *(spread_text(spreads[f"{name}_{outer}"]) for name in SPREAD_RATIOS)])
    spread_rows.append(
        [
            "fixed_split",
            spread_text(spreads["fixed_split_loss_over_ddp"]),
            spread_text(spreads["fixed_split_makespan_over_ddp"]),
            "-",
            "-",
        ]
    )
    print(f"ratios: median (min-max) over {figures['repeats']} repeat(s)")
    print(table(["variant", "loss_over_ddp", "makespan_over_ddp", "time_to_ddp_loss", "loss_over_single"], spread_rows))
    print(
        f"8-bit wire (simulated): loss / float32 {spread_text(spreads['int8_loss_over_float32'])}, "
        f"bytes / float32 {spread_text(spreads['int8_bytes_over_float32'])}"
    )
    print(
        f"drag {fmt(figures['drag'])}, read_per_exchange {fmt(figures['read_per_exchange'])}"
        " (benchmarks.session_figures)"
    )


SPREAD_RATIOS = ("loss_over_ddp", "makespan_over_ddp", "time_to_ddp_loss", "loss_over_single")
"""The ratio table's columns."""


def spread_text(values: Spread) -> str:
    """``median (min-max)``, or ``-`` when no repeat measured it."""
    low, middle, high = values
    if middle is None:
        return "-"
    return f"{fmt(middle)} ({fmt(low)}-{fmt(high)})"


def judge(figures: dict[str, Any], mode: str, steps: float) -> list[str]:
    """The verdict lines of ``mode``'s targets (and the Session figures'); none for quick."""
    if mode not in VERDICTS:
        return ["verdicts: none (--quick runs every code path and judges nothing)"]
    judged: dict[str, float] = {}
    lines = []
    for target, figure in (*VERDICTS[mode].items(), ("drag", "drag"), ("read_per_exchange", "read_per_exchange")):
        value = figures.get(figure)
        if value is None:
            lines.append(f"target {target} {TARGETS[target].text()}: not measured")
        else:
            judged[target] = value
    lines = verdicts(judged) + lines
    if abs(steps - EXCHANGE_STEPS) > 0.1 * EXCHANGE_STEPS:
        lines.append(f"note: the {mode} targets are set for H ~ {EXCHANGE_STEPS}; this run's H is {steps:.1f}")
    return lines


def chart(path: Path, single: Run, first: dict[str, Run], title: str) -> None:
    """The first repeat's curves, the one-pass consensus losses as stars, DDP's loss dashed."""
    curves = {"single (1 process, no padding)": single.curve}
    for name, run in first.items():
        if run.curve:
            label = (
                f"{name.removesuffix(':to-target')} (consensus; 2 passes, stops at DDP's loss)"
                if name.endswith(":to-target")
                else name
            )
            curves[label] = run.curve
    finals = {
        f"{name} (1 pass, final consensus)": (run.makespan, run.loss)
        for name, run in first.items()
        if name.startswith("gradientmail:") and not run.curve
    }
    draw(path, curves, finals, first["ddp"].loss, title)


def run_groups(bench: Bench, repeats: int, quick: bool) -> dict[str, Any]:
    """``--groups``: 2 groups of 2 against 4 one-process learners and DDP over all 4, same speeds.

    Per machine (2 processes) and whole exchange: a group exchanges once, its rank 0 alone; 4
    learners put 2 learners on each machine, each exchanging. Then the cost of ``step()`` in a
    group (``benchmarks.group_step``)."""
    from benchmarks import group_step

    rows: dict[str, list[Run]] = {"ddp": [], "learners": [], "groups": []}
    for repeat in range(repeats):
        rows["ddp"].append(bench.fixed("ddp", checkpoints=False))
        rows["learners"].append(bench.gradientmail(DEFAULT_OUTER))
        rows["groups"].append(bench.groups(DEFAULT_OUTER))
        shown = ", ".join(f"{name} {runs[-1].loss:.4f}/{runs[-1].makespan:.1f}s" for name, runs in rows.items())
        print(f"repeat {repeat + 1}/{repeats} (val loss/makespan): {shown}", flush=True)
        for name in ("learners", "groups"):
            print(f"  {name}: {rows[name][-1].detail}", flush=True)
    figures: dict[str, Any] = {"repeats": repeats}
    per_machine = {"learners": GROUP_SIZE, "groups": 1}  # learners exchanging on one machine
    table_rows = []
    for name, runs in rows.items():
        loss = statistics.median(r.loss for r in runs)
        makespan = statistics.median(r.makespan for r in runs)
        figures[f"val_loss_{name}"], figures[f"makespan_s_{name}"] = loss, makespan
        row = [name, fmt(loss, 4), fmt(makespan, 1)]
        if name == "ddp":
            table_rows.append([*row, "1.000", "1.000", "-", "-"])
            continue
        for ratio_name, values in (
            ("loss_over_ddp", [r.loss / d.loss for r, d in zip(runs, rows["ddp"])]),
            ("makespan_over_ddp", [r.makespan / d.makespan for r, d in zip(runs, rows["ddp"])]),
        ):
            low, middle, high = spread(values)
            figures[f"{name}_{ratio_name}"] = middle
            figures[f"{name}_{ratio_name}_min"], figures[f"{name}_{ratio_name}_max"] = low, high
        for way in ("read", "written"):
            values = [getattr(r, f"{way}_per_exchange") for r in runs]
            known = [v * per_machine[name] for v in values if v is not None]
            figures[f"{name}_{way}_per_machine"] = statistics.median(known) if known else None
        table_rows.append(
            [
                *row,
                fmt(figures[f"{name}_loss_over_ddp"]),
                fmt(figures[f"{name}_makespan_over_ddp"]),
                fmt(figures[f"{name}_read_per_machine"], 2),
                fmt(figures[f"{name}_written_per_machine"], 2),
            ]
        )
    figures["groups_loss_over_learners"] = figures["val_loss_groups"] / figures["val_loss_learners"]
    step = group_step.main(["--steps", "60" if quick else "200"])
    figures["group_step_ratio"] = step["group_step_ratio"]
    figures["group_step_s"] = step["group_step_s"]
    print()
    print(f"validation loss (initial {bench.initial_loss:.4f}) and wall time, median of {repeats} repeat(s)")
    print(
        table(
            [
                "method (4 processes, 1:1:2:2)",
                "val loss",
                "time s",
                "loss/DDP",
                "time/DDP",
                "read/machine",
                "written/machine",
            ],
            [[LABELS[row[0]], *row[1:]] for row in table_rows],
        )
    )
    print("read/machine, written/machine: model sizes per machine (2 processes) per exchange interval")
    print(
        f"step() in a group: {figures['group_step_s'] * 1000:.2f} ms, {figures['group_step_ratio']:.4f} of a "
        "training step (benchmarks.group_step)"
    )
    return figures


LABELS = {
    "ddp": "DDP over all 4 (gloo, fixed quarters)",
    "learners": "4 learners of 1 process",
    "groups": "2 groups of 2 (DDP inside, group=)",
}
"""``--groups``'s table rows."""


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument(
        "--quick", action="store_true", help="a few units and 1-4 ms per batch, every method (CI: runs, not judged)"
    )
    size.add_argument(
        "--long",
        action="store_true",
        help=f"{LONG.units} units a pass instead of {PASS.units} (4x, every method): the README's figures",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="repeat sets (default 3; --quick: 1); ratios are given as min/median/max",
    )
    parser.add_argument(
        "--every",
        type=float,
        default=None,
        help=f"seconds between a node's exchanges (default: {EXCHANGE_STEPS} batches of the fastest node)",
    )
    parser.add_argument(
        "--png",
        type=Path,
        default=None,
        help="draw the loss curves here (default: docs/training-loss.png with --long, else none)",
    )
    parser.add_argument(
        "--groups",
        action="store_true",
        help="2 groups of 2 processes (DDP inside, group=) against 4 learners and DDP, speeds 1:1:2:2",
    )
    args = parser.parse_args(argv)
    began = time.perf_counter()
    mode = "quick" if args.quick else "long" if args.long else "pass"
    plan = PLANS[mode]
    if args.groups:
        plan = replace(plan, sleeps=GROUP_SLEEPS["quick" if args.quick else "pass"])
    if args.every is not None and not args.every > 0:
        parser.error(f"--every must be a positive number of seconds, not {args.every}")
    repeats = max(1, args.repeats if args.repeats is not None else (1 if args.quick else 3))
    png = args.png if args.png is not None else (DEFAULT_PNG if mode == "long" else None)
    torch.set_num_threads(1)  # evaluations are small; one thread keeps them reproducible (nodes: one each)

    outers = list(OUTERS)
    base = Path(tempfile.mkdtemp(prefix="gm-training-", dir=pick_temp_root()))
    try:
        data_dir = base / "data"
        data_dir.mkdir()
        corpus = write_corpus(data_dir)
        pace = cadence(plan, measure_step_s(data_dir, plan), args.every)
        plan = replace(plan, every_s=pace.every_s)
        bench = Bench(plan, base, data_dir)
        params = sum(p.numel() for p in bench.model.parameters())
        speeds = "/".join(f"{s * 1000:g}" for s in plan.sleeps)
        shared, quarters = fluid_bounds(plan)
        print(
            f"byte-level MLP ({params:,} parameters), Adam lr 2e-3; stdlib corpus: {corpus.files} files, "
            f"{corpus.train_bytes / 1e6:.1f} MB train, {corpus.validation_bytes / 1e6:.1f} MB held out"
        )
        print(
            f"{mode}: {plan.units} units x {plan.unit_batches} batches x {BATCH} contexts per pass; "
            f"{plan.nodes} nodes at {speeds} ms per batch; H = {pace.steps:.1f}; {repeats} repeat(s)"
        )
        print(pace.text(min(plan.sleeps)))
        print(f"padding alone: {shared:.2f}s for a shared queue (fluid bound), {quarters:.2f}s for fixed quarters")
        sys.stdout.flush()

        if args.groups:
            figures = run_groups(bench, repeats, args.quick)
            figures.update(mode=f"groups-{mode}", every_s=pace.every_s, exchange_steps=pace.steps)
            figures["wall_s"] = time.perf_counter() - began
            print(f"wall time {figures['wall_s']:.0f}s")
            emit(figures)
            return figures
        single = bench.fixed("single", checkpoints=png is not None)  # deterministic: once
        print(f"single: val loss {single.loss:.4f}, {single.makespan:.1f}s", flush=True)
        repeat_runs = run_repeats(bench, outers, repeats, curves=png is not None)
        figures, spreads = collect(single, repeat_runs, bench.initial_loss)
        figures.update(session_figures(args.quick))
        print_tables(figures, spreads, outers)
        for target, figure in VERDICTS.get(mode, {}).items():  # the medians again, under the targets' names
            figures[target] = figures[figure]
        print("\n".join(judge(figures, mode, pace.steps)))
        if png is not None:
            chart(
                png,
                single,
                repeat_runs[0],
                f"{params:,}-parameter byte MLP, 4 nodes at {speeds} ms/batch, {plan.units} units a pass, "
                f"exchanges every {pace.every_s:.3g}s (H = {pace.steps:.0f}); first repeat",
            )
            print(f"chart: {png}")
        figures.update(
            mode=mode,
            units=plan.units,
            every_s=pace.every_s,
            exchange_steps=pace.steps,
            step_s=pace.step_s,
            fragments=fragments_of(repeat_runs),
        )
        figures["wall_s"] = time.perf_counter() - began
        print(f"wall time {figures['wall_s']:.0f}s")
        emit(figures)
        return figures
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
