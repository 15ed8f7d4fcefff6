"""What the demo shows: each node's state, live progress (bars or lines), the summary and the chart."""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gradientmail.cli.demo_plan import Plan
from gradientmail.plot import Span


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


# -- live views -----------------------------------------------------------------------------
class LineView:
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


class BarView:
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


# -- after the run ---------------------------------------------------------------------------
def draw_chart(
    plan: Plan, fixed: list[Span], measured: list[Span], path: str, fixed_s: float, measured_s: float
) -> str:
    """Write the Gantt chart to ``path``: the fixed split (computed) above, the shared queue (measured) below."""
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


def summary_table(plan: Plan, nodes: list[NodeState], start: float, ideal: list[Span]):
    """A rich table, one row per node: speed, units (measured and ideal), samples, busy time, loss."""
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
