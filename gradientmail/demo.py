"""``gradientmail demo``: nodes of unequal speed share one run through one mailbox.

The demo starts one process per node (``gradientmail.demo_node.node_process``, forked from a
server that imported torch once), each running the documented loop (``shared_queue`` +
``Session``) on a small model and a synthetic dataset, with its speed simulated by a per-batch
delay: relative times 1:2:2:4 by default, so node A is the fastest and D takes four times as
long per batch. All nodes start together (each reports ``ready`` and waits for one ``go``) and
report their progress on a queue. While they train, the demo shows a progress bar per node
(plain lines when the output is not a terminal); afterwards a summary: units, samples, busy time
and validation loss per node, the measured makespan beside the ideal shared-queue makespan and
the fixed split computed for the same speeds, and the loss of the ``consensus`` model. It writes
a Gantt chart (fixed split above, the measured shared queue below) and the summary as JSON.

The Gantt bars of the shared queue are the exact training spans the nodes report (first batch
of a unit to its last), not claim times (``gradientmail plot`` draws the same spans from
the nodes' progress records, and claim times only for units those do not cover).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import queue
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gradientmail.errors import GradientMailError
from gradientmail.plot import Span

DEFAULT_SPEEDS = (1.0, 2.0, 2.0, 4.0)
"""Relative time per batch of the default nodes A, B, C, D (the seed's example)."""

READY_TIMEOUT = 180.0
"""Seconds the nodes may take to import torch and build their model."""

START_DELAY = 0.3
"""Seconds between ``go`` and the common start time, so every node starts at the same time."""


class DemoError(GradientMailError, RuntimeError):
    """The demo could not run: a node failed, or the options do not describe a run."""


# -- the plan and its simulation ------------------------------------------------------------
@dataclass(frozen=True)
class Plan:
    """What the demo runs: node names and speeds, the unit grid and the optional slowdown."""

    names: tuple[str, ...]
    speeds: tuple[float, ...]
    units: int
    unit_steps: int
    batch_time: float
    slowdown: tuple[int, float, float] | None = None
    """(node index, factor, seconds into the run) or None."""

    @property
    def lanes(self) -> int:
        return len(self.names)

    def learner_id(self, node: int) -> str:
        return f"node-{self.names[node]}"

    def base_seconds_per_batch(self, node: int) -> float:
        return self.batch_time * self.speeds[node]

    def seconds_per_batch(self, node: int, at: float) -> float:
        slow = self.slowdown
        factor = slow[1] if slow is not None and slow[0] == node and at >= slow[2] else 1.0
        return self.base_seconds_per_batch(node) * factor

    def identifier(self, index: int) -> str:
        """The ``unit_grid`` identifier of the ``index``-th unit (group-major order)."""
        return f"{index // self.lanes:06d}-{index % self.lanes}.json"

    def unit_end(self, node: int, start: float) -> float:
        end = start
        for _ in range(self.unit_steps):
            end += self.seconds_per_batch(node, end)
        return end


def simulate(plan: Plan, *, shared: bool) -> list[Span]:
    """The schedule of ``plan`` on a virtual clock, without any overhead.

    ``shared=False`` is the fixed split: node ``i`` owns lane ``i`` of every group of steps and
    processes its units back to back. ``shared=True`` is the shared queue: whenever a node is
    ready it takes the next unit nobody has taken, preferring its own lane in the earliest
    group (``rotated_order``); ties go to the lower node index.
    """
    spans: list[Span] = []
    ready = [0.0] * plan.lanes
    if not shared:
        for node in range(plan.lanes):
            for index in range(node, plan.units, plan.lanes):
                end = plan.unit_end(node, ready[node])
                spans.append(Span(plan.learner_id(node), plan.identifier(index), ready[node], end))
                ready[node] = end
        return spans
    taken = [False] * plan.units
    for _ in range(plan.units):
        # Rounded: 40 x 0.1 s and 20 x 0.2 s are one tie, whatever the float error.
        node = min(range(plan.lanes), key=lambda n: (round(ready[n], 9), n))
        group = next(g for g in range(0, plan.units, plan.lanes) if not all(taken[g : g + plan.lanes]))
        lanes = range(group, min(group + plan.lanes, plan.units))
        index = next(i for i in [*lanes[node % len(lanes) :], *lanes[: node % len(lanes)]] if not taken[i])
        taken[index] = True
        end = plan.unit_end(node, ready[node])
        spans.append(Span(plan.learner_id(node), plan.identifier(index), ready[node], end))
        ready[node] = end
    return spans


def makespan(spans: list[Span]) -> float:
    return max((span.end for span in spans), default=0.0)


def node_names(count: int) -> tuple[str, ...]:
    if count <= 26:
        return tuple(chr(ord("A") + index) for index in range(count))
    return tuple(str(index) for index in range(count))


def make_plan(args: argparse.Namespace) -> Plan:
    """A ``Plan`` from the ``demo`` options; ``DemoError`` when they do not describe a run."""
    names = node_names(args.nodes)
    if args.speeds is None:
        speeds = tuple(DEFAULT_SPEEDS[index % len(DEFAULT_SPEEDS)] for index in range(args.nodes))
    elif len(args.speeds) != args.nodes:
        raise DemoError(f"--speeds gives {len(args.speeds)} speeds for {args.nodes} nodes")
    else:
        speeds = args.speeds
    if args.units % args.nodes:
        raise DemoError(
            f"--units {args.units} is not a multiple of --nodes {args.nodes} (each group of "
            "dataset steps is split into one unit per node)"
        )
    plan = Plan(names, speeds, args.units, args.unit_steps, args.batch_time)
    if args.slowdown is None:
        if args.slowdown_at is not None:
            raise DemoError("--slowdown-at needs --slowdown NODE:FACTOR")
        return plan
    which, factor = args.slowdown
    candidates = {name: index for index, name in enumerate(names)}
    candidates.update({plan.learner_id(index): index for index in range(len(names))})
    candidates.update({str(index): index for index in range(len(names))})
    node = candidates.get(which, candidates.get(which.upper()))
    if node is None:
        raise DemoError(f"--slowdown names node {which!r}; the nodes are {', '.join(names)}")
    at = args.slowdown_at
    if at is None:
        at = makespan(simulate(plan, shared=True)) / 2
    return Plan(names, speeds, args.units, args.unit_steps, args.batch_time, (node, factor, at))


# -- the node processes ---------------------------------------------------------------------
@dataclass
class NodeState:
    """What the demo knows about one node, from its events."""

    index: int
    name: str
    learner: str
    seconds_per_batch: float
    log: str = ""
    process: Any = None
    ready: bool = False
    done: dict[str, Any] | None = None
    error: str | None = None
    units: int = 0
    batches: int = 0
    samples: int = 0
    loss: float = math.nan
    spans: list[Span] = field(default_factory=list)

    def failure(self) -> str:
        """One line: why this node failed, from its error event or the end of its log."""
        detail = self.error
        if not detail:
            try:
                lines = [line for line in Path(self.log).read_text().splitlines() if line.strip()]
            except OSError:
                lines = []
            detail = lines[-1].strip() if lines else ""
        code = self.process.exitcode if self.process is not None else None
        if not detail:
            detail = f"its process ended (exit code {code}) without a result"
        log = f" (log: {self.log})" if self.log else ""
        return f"{self.learner} failed: {detail}{log}"


def _context(url: str):
    """Node processes fork from a server that imported torch once (see ``demo_node``)."""
    import multiprocessing

    context = multiprocessing.get_context("forkserver")
    # torch._dynamo: the first optimizer a process builds imports it (seconds of CPU each).
    preload = [
        "torch",
        "torch._dynamo",
        "gradientmail.session",
        "gradientmail.patterns.shared_queue",
        "gradientmail.demo_node",
    ]
    if url.startswith(("s3://", "s3a://")):
        preload.append("gradientmail.mailbox.s3")
    context.set_forkserver_preload(preload)
    return context


def _stop(processes: list[Any]) -> None:
    for process in processes:
        if process is not None and process.is_alive():
            process.terminate()
    for process in processes:
        if process is not None:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join()


# -- live views -----------------------------------------------------------------------------
class _LineView:
    """Plain lines, one per finished unit: readable in CI logs and when piped."""

    def __init__(self, console, plan: Plan, nodes: list[NodeState]) -> None:
        self.console = console
        self.plan = plan
        self.start = 0.0

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass

    def started(self, start: float) -> None:
        self.start = start
        self.console.print(f"all nodes ready; training {self.plan.units} units")

    def update(self, node: NodeState, event: dict[str, Any]) -> None:
        if event.get("event") == "unit":
            units = f"{node.units} unit{'' if node.units == 1 else 's'}"
            self.console.print(
                f"{event['end'] - self.start:7.2f}s  {node.learner}  trained unit "
                f"{str(event['unit']).removesuffix('.json')}  ({units}, "
                f"{node.samples:,} samples, loss {node.loss:.3f})",
                highlight=False,
            )
        elif event.get("event") == "done":
            self.console.print(
                f"{time.time() - self.start:7.2f}s  {node.learner}  finished: no unclaimed unit left", highlight=False
            )


def _units_text(units: int) -> str:
    """``1 unit``, ``11 units``: a count that reads right (right-aligned, for the bars)."""
    return f"{units:>3} unit{'' if units == 1 else 's'}"


class _BarView:
    """A rich progress bar per node; a bar's length is the node's share of all units, which the
    header line says, so a finished node's bar is not expected to be full."""

    def __init__(self, console, plan: Plan, nodes: list[NodeState]) -> None:
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        self.plan = plan
        self.progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(bar_width=30),
            TextColumn("{task.fields[units_text]:<9}"),
            TextColumn("{task.fields[samples]:>7,} samples"),
            TextColumn("{task.fields[status]}"),
            TimeElapsedColumn(),
            console=console,
        )
        self.tasks = [
            self.progress.add_task(
                f"{node.learner} {node.seconds_per_batch:.2f}s/batch",
                total=plan.units,
                units_text=_units_text(0),
                samples=0,
                status="starting",
            )
            for node in nodes
        ]
        self.total = self.progress.add_task(
            "all nodes", total=plan.units, units_text=_units_text(0), samples=0, status=""
        )
        self.nodes = nodes
        self.console = console

    def __enter__(self):
        self.console.print(
            f"each bar: the units a node trained, out of all {self.plan.units} (a node stops at "
            "its share of the run); the last bar: all nodes together",
            highlight=False,
        )
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.stop()

    def started(self, start: float) -> None:
        for task in [*self.tasks, self.total]:  # elapsed time counts from the common start
            self.progress.update(task, status="")
            self.progress.reset(task)

    def update(self, node: NodeState, event: dict[str, Any]) -> None:
        kind = event.get("event")
        task = self.tasks[node.index]
        if kind == "ready":
            self.progress.update(task, status="ready")
        elif kind == "batch":
            self.progress.update(
                task,
                completed=node.batches / self.plan.unit_steps,
                units_text=_units_text(node.units),
                samples=node.samples,
                status=f"loss {node.loss:.3f}",
            )
            self.progress.update(
                self.total,
                completed=sum(n.batches for n in self.nodes) / self.plan.unit_steps,
                units_text=_units_text(sum(n.units for n in self.nodes)),
                samples=sum(n.samples for n in self.nodes),
            )
        elif kind == "done":
            share = node.units / self.plan.units if self.plan.units else 0.0
            self.progress.update(task, status=f"no unit left: trained {share:.0%} of the run, loss {node.loss:.3f}")
            self.progress.stop_task(task)


# -- the run --------------------------------------------------------------------------------
def _check_fresh(mailbox, url: str) -> None:
    from gradientmail.layout import CLAIMS_PREFIX, RUN_KEY

    if mailbox.get(RUN_KEY) is not None or next(iter(mailbox.list(CLAIMS_PREFIX)), None):
        raise DemoError(
            f"{url} already holds a run (claims are permanent for a run): use a new directory "
            "or S3 prefix for --mailbox"
        )


def _node_configs(plan: Plan, args: argparse.Namespace, url: str, logs: Path) -> list[Any]:
    from gradientmail.demo_node import NodeConfig

    configs = []
    for index, name in enumerate(plan.names):
        slow = plan.slowdown if plan.slowdown is not None and plan.slowdown[0] == index else None
        configs.append(
            NodeConfig(
                name=name,
                learner_id=plan.learner_id(index),
                rank=index,
                mailbox=url,
                endpoint_url=args.endpoint_url,
                units=plan.units,
                unit_steps=plan.unit_steps,
                lanes=plan.lanes,
                batch_time=plan.base_seconds_per_batch(index),
                slowdown_factor=slow[1] if slow else 1.0,
                slowdown_at=slow[2] if slow else 0.0,
                prefetch=args.prefetch,
                seed=args.seed,
                log=str(logs / f"{plan.learner_id(index)}.log"),
            )
        )
    return configs


def _next_event(events: Any, timeout: float) -> tuple[int, dict] | None:
    """The next ``(rank, event)``, or None when none came within ``timeout`` seconds."""
    try:
        return events.get(timeout=timeout)
    except queue.Empty:
        return None


def _preload_charts() -> None:
    """Import matplotlib while the nodes train (they mostly sleep), not after."""
    with contextlib.suppress(ImportError):  # drawing reports it with an install hint
        import matplotlib.figure  # noqa: F401


def _run_nodes(
    plan: Plan, configs: list[Any], context: Any, console, deadline_s: float
) -> tuple[list[NodeState], float]:
    """Start the nodes, wait until all are ready, start them together, follow them to the end."""
    from gradientmail.demo_node import node_process

    nodes = [
        NodeState(index, name, plan.learner_id(index), plan.base_seconds_per_batch(index), log=configs[index].log)
        for index, name in enumerate(plan.names)
    ]
    events = context.Queue()
    go = context.Event()
    start_at = context.Value("d", 0.0)
    view_class = _BarView if console.is_terminal else _LineView
    if not console.is_terminal:
        speeds = ", ".join(f"{n.learner} {n.seconds_per_batch:.2f}s/batch" for n in nodes)
        console.print(f"starting {len(nodes)} node processes ({speeds})", highlight=False)
    start = math.inf
    try:
        with view_class(console, plan, nodes) as view:
            for node, config in zip(nodes, configs, strict=True):
                node.process = context.Process(
                    target=node_process, name=node.learner, args=(config, events, go, start_at), daemon=True
                )
                node.process.start()
            limit = time.monotonic() + READY_TIMEOUT
            while not all(node.done is not None for node in nodes):
                if time.monotonic() > limit:
                    waiting = [n.learner for n in nodes if (n.done is None if go.is_set() else not n.ready)]
                    raise DemoError(f"timed out waiting for {', '.join(waiting)}")
                item = _next_event(events, 0.5)
                if item is None:
                    # Quiet: has a node died without reporting? Drain what it sent first.
                    for node in nodes:
                        if node.done is None and node.process.exitcode is not None:
                            time.sleep(0.2)
                            if events.empty():
                                raise DemoError(node.failure())
                    continue
                index, event = item
                node = nodes[index]
                kind = event.get("event")
                if kind == "ready":
                    node.ready = True
                elif kind == "unit":
                    node.spans.append(
                        Span(node.learner, str(event["unit"]), float(event["start"]), float(event["end"]))
                    )
                    node.units = len(node.spans)
                elif kind in ("batch", "done"):
                    node.units = int(event.get("units", node.units))
                    node.batches = int(event.get("batches", node.batches))
                    node.samples = int(event.get("samples", node.samples))
                    node.loss = float(event.get("loss", node.loss))
                    if kind == "done":
                        node.done = event
                elif kind == "error":
                    node.error = str(event.get("message", ""))
                    raise DemoError(node.failure())
                view.update(node, event)
                if kind == "ready" and all(n.ready for n in nodes):
                    start = time.time() + START_DELAY
                    start_at.value = start
                    go.set()
                    view.started(start)
                    threading.Thread(target=_preload_charts, daemon=True).start()
                    limit = time.monotonic() + START_DELAY + deadline_s
        for node in nodes:
            node.process.join(timeout=60)
            if node.process.exitcode:
                raise DemoError(node.failure())
        return nodes, start
    finally:
        _stop([node.process for node in nodes])


def _consensus_losses(context: Any, url: str, endpoint_url: str | None, seed: int) -> tuple[float, float, int]:
    """Loss before training and of the consensus model, computed in a forked process."""
    from gradientmail.demo_node import consensus_process

    events = context.Queue()
    process = context.Process(target=consensus_process, args=(url, endpoint_url, seed, events), daemon=True)
    process.start()
    try:
        while True:
            try:
                _, event = events.get(timeout=1.0)
                break
            except queue.Empty:
                if process.exitcode is not None and events.empty():
                    raise DemoError(f"computing the consensus failed (exit code {process.exitcode})") from None
        return float(event["initial"]), float(event["final"]), int(event["learners"])
    finally:
        _stop([process])


def _draw(plan: Plan, fixed: list[Span], measured: list[Span], path: str, fixed_s: float, measured_s: float) -> str:
    from gradientmail.plot import draw_gantt, new_figure

    rows = [plan.learner_id(index) for index in range(plan.lanes)]
    figure = new_figure(8.0, 1.6 + 0.8 * plan.lanes)
    top, bottom = figure.subplots(2, 1, sharex=True)
    speeds = ":".join(f"{speed:g}" for speed in plan.speeds)
    draw_gantt(
        fixed,
        top,
        origin=0.0,
        rows=rows,
        markers={},
        title=f"fixed split (computed): {plan.units} units, time per batch {speeds}",
    )
    slow = ""
    if plan.slowdown is not None:
        slow = f", {plan.learner_id(plan.slowdown[0])} {plan.slowdown[1]:g}x slower from {plan.slowdown[2]:.1f}s"
    draw_gantt(
        measured,
        bottom,
        origin=0.0,
        rows=rows,
        markers={"fixed split": fixed_s},
        title=f"shared queue (measured, {len(plan.names)} processes{slow})",
    )
    top.set_xlabel("")
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    figure.savefig(path, format="png")
    return path


def _summary_table(plan: Plan, nodes: list[NodeState], start: float, ideal: list[Span]):
    from rich.table import Table

    table = Table(title="per node", title_justify="left")
    table.add_column("node")
    for name in ("s/batch", "units", "ideal", "samples", "busy s", "done at s", "val loss"):
        table.add_column(name, justify="right")
    for node in nodes:
        busy = sum(span.end - span.start for span in node.spans)
        done_at = max((span.end for span in node.spans), default=start) - start
        speed = f"{node.seconds_per_batch:.2f}"
        if plan.slowdown is not None and plan.slowdown[0] == node.index:
            speed += f" → {node.seconds_per_batch * plan.slowdown[1]:.2f}"
        ideal_units = sum(1 for span in ideal if span.learner == node.learner)
        table.add_row(
            node.learner,
            speed,
            str(node.units),
            str(ideal_units),
            f"{node.samples:,}",
            f"{busy:.2f}",
            f"{done_at:.2f}",
            f"{node.loss:.4f}",
        )
    return table


def run_demo(args: argparse.Namespace) -> int:
    """The ``demo`` command (see the module docstring); returns the exit code."""
    from gradientmail.cli import _console, open_cli_mailbox

    began = time.monotonic()
    plan = getattr(args, "plan", None) or make_plan(args)
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="gradientmail-demo-"))
    out.mkdir(parents=True, exist_ok=True)
    url = args.mailbox or str(out / "mailbox")
    mailbox = open_cli_mailbox(url, endpoint_url=args.endpoint_url, create=True)
    _check_fresh(mailbox, url)
    gantt = args.gantt or str(out / "gantt.png")
    summary_path = args.summary_json or str(out / "summary.json")
    console = _console()

    fixed = simulate(plan, shared=False)
    ideal = simulate(plan, shared=True)
    fixed_s, ideal_s = makespan(fixed), makespan(ideal)
    deadline = 10 * fixed_s + 120  # a hung node ends the demo instead of hanging it

    logs = out / "logs"
    logs.mkdir(exist_ok=True)
    context = _context(url)
    nodes, start = _run_nodes(plan, _node_configs(plan, args, url, logs), context, console, deadline)
    measured = [
        Span(span.learner, span.unit, span.start - start, span.end - start) for node in nodes for span in node.spans
    ]
    measured_s = makespan(measured)
    initial, final, averaged = _consensus_losses(context, url, args.endpoint_url, args.seed)
    _draw(plan, fixed, measured, gantt, fixed_s, measured_s)
    wall = time.monotonic() - began

    summary = {
        "mailbox": url,
        "gantt": gantt,
        "units": plan.units,
        "unit_steps": plan.unit_steps,
        "makespan_s": measured_s,
        "ideal_shared_queue_s": ideal_s,
        "fixed_split_s": fixed_s,
        "speedup": fixed_s / measured_s if measured_s else None,
        "loss_initial": initial,
        "loss_consensus": final,
        "learners_averaged": averaged,
        "slowdown": None
        if plan.slowdown is None
        else {"learner": plan.learner_id(plan.slowdown[0]), "factor": plan.slowdown[1], "at_s": plan.slowdown[2]},
        "nodes": [
            {
                "learner": node.learner,
                "relative_time": plan.speeds[node.index],
                "seconds_per_batch": node.seconds_per_batch,
                "units": node.units,
                "batches": node.batches,
                "samples": node.samples,
                "busy_s": sum(span.end - span.start for span in node.spans),
                "done_at_s": max((span.end for span in node.spans), default=start) - start,
                "units_fixed_split": sum(1 for span in fixed if span.learner == node.learner),
                "units_ideal": sum(1 for span in ideal if span.learner == node.learner),
                "loss": node.loss,
            }
            for node in nodes
        ],
        "wall_s": wall,
    }
    Path(summary_path).parent.mkdir(parents=True, exist_ok=True)
    Path(summary_path).write_text(json.dumps(summary, indent=2) + "\n")

    console.print()
    console.print(_summary_table(plan, nodes, start, ideal))
    ratio = f": {fixed_s / measured_s:.1f}x as long" if measured_s else ""
    lines = [
        ("makespan", f"shared queue {measured_s:.2f}s measured (ideal {ideal_s:.2f}s)"),
        ("", f"fixed split {fixed_s:.2f}s computed for the same speeds{ratio}"),
        ("loss", f"{initial:.4f} → {final:.4f} (validation MSE, consensus of {averaged} learners)"),
        ("chart", gantt),
        ("summary", summary_path),
        ("mailbox", f"{url}  (try: gradientmail status {url})"),
        ("wall time", f"{wall:.1f}s"),
    ]
    for label, text in lines:
        console.print(f"{label:<10} {text}", highlight=False, soft_wrap=True)
    return 0
