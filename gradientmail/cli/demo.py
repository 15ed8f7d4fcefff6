"""``gradientmail demo``: node processes of unequal speed share one run through one mailbox.

Each node runs the documented loop (``shared_queue`` + ``Session``) in its own process
(``gradientmail.cli.demo_node``); the demo starts them together, shows their progress, then
prints a summary beside the fixed split computed for the same speeds and draws a Gantt chart.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import queue
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from gradientmail.cli.demo_plan import Plan, make_plan, makespan, simulate
from gradientmail.cli.demo_views import BarView, LineView, NodeState, draw_chart, summary_table
from gradientmail.cli.mailbox_url import open_cli_mailbox
from gradientmail.cli.output import console
from gradientmail.errors import DemoError
from gradientmail.plot import Span

READY_TIMEOUT = 180.0
"""Seconds the nodes may take to import torch and build their model."""

START_DELAY = 0.3
"""Seconds between ``go`` and the common start time, so every node starts at the same time."""


def _forkserver_context(url: str):
    """Node processes fork from a server that imported torch once (see ``demo_node``)."""
    import multiprocessing

    context = multiprocessing.get_context("forkserver")
    # torch._dynamo: the first optimizer a process builds imports it (seconds of CPU each).
    preload = [
        "torch",
        "torch._dynamo",
        "gradientmail.session",
        "gradientmail.queue.context",
        "gradientmail.cli.demo_node",
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


# -- the run --------------------------------------------------------------------------------
def _check_fresh(mailbox, url: str) -> None:
    from gradientmail.layout import CLAIMS_PREFIX, RUN_KEY
    from gradientmail.mailbox.base import exists

    if exists(mailbox, RUN_KEY) or next(iter(mailbox.list(CLAIMS_PREFIX)), None):
        raise DemoError(
            f"{url} already holds a run (claims are permanent for a run): use a new directory "
            "or S3 prefix for --mailbox"
        )


def _node_configs(plan: Plan, args: argparse.Namespace, url: str, logs: Path) -> list[Any]:
    from gradientmail.cli.demo_node import NodeConfig

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
    plan: Plan, configs: list[Any], context: Any, screen, deadline_s: float
) -> tuple[list[NodeState], float]:
    """Start the nodes, wait until all are ready, start them together, follow them to the end."""
    from gradientmail.cli.demo_node import node_process

    nodes = [
        NodeState(index, name, plan.learner_id(index), plan.base_seconds_per_batch(index), log=configs[index].log)
        for index, name in enumerate(plan.names)
    ]
    events = context.Queue()
    go = context.Event()
    start_at = context.Value("d", 0.0)
    view_class = BarView if screen.is_terminal else LineView
    if not screen.is_terminal:
        speeds = ", ".join(f"{n.learner} {n.seconds_per_batch:.2f}s/batch" for n in nodes)
        screen.print(f"starting {len(nodes)} node processes ({speeds})", highlight=False)
    start = math.inf
    try:
        with view_class(screen, plan, nodes) as view:
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
    from gradientmail.cli.demo_node import consensus_process

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


def run_demo(args: argparse.Namespace) -> int:
    """Run the demo described by the parsed ``demo`` options.

    Args:
        args: The ``gradientmail demo`` namespace (``args.plan`` is used when ``check_demo`` set it).

    Returns:
        The exit code, 0. A node that fails raises ``DemoError`` with its reason and log path.
    """
    began = time.monotonic()
    plan = getattr(args, "plan", None) or make_plan(args)
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="gradientmail-demo-"))
    out.mkdir(parents=True, exist_ok=True)
    url = args.mailbox or str(out / "mailbox")
    mailbox = open_cli_mailbox(url, endpoint_url=args.endpoint_url, create=True)
    _check_fresh(mailbox, url)
    gantt = args.gantt or str(out / "gantt.png")
    summary_path = args.summary_json or str(out / "summary.json")
    screen = console()

    fixed = simulate(plan, shared=False)
    ideal = simulate(plan, shared=True)
    fixed_s, ideal_s = makespan(fixed), makespan(ideal)
    deadline = 10 * fixed_s + 120  # a hung node ends the demo instead of hanging it

    logs = out / "logs"
    logs.mkdir(exist_ok=True)
    context = _forkserver_context(url)
    nodes, start = _run_nodes(plan, _node_configs(plan, args, url, logs), context, screen, deadline)
    measured = [
        Span(span.learner, span.unit, span.start - start, span.end - start) for node in nodes for span in node.spans
    ]
    measured_s = makespan(measured)
    initial, final, averaged = _consensus_losses(context, url, args.endpoint_url, args.seed)
    draw_chart(plan, fixed, measured, gantt, fixed_s, measured_s)
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

    screen.print()
    screen.print(summary_table(plan, nodes, start, ideal))
    ratio = f": {fixed_s / measured_s:.1f}x as long" if measured_s else ""
    lines = [
        ("makespan", f"shared queue {measured_s:.2f}s measured (ideal {ideal_s:.2f}s)"),
        ("", f"fixed split {fixed_s:.2f}s computed for the same speeds{ratio}"),
        ("loss", f"{initial:.4f} → {final:.4f} (validation MSE, consensus of {averaged} learners)"),
        ("chart", gantt),
        ("summary", summary_path),
        ("mailbox", f"{url}  (try: {status_command(url, args.endpoint_url)})"),
        ("wall time", f"{wall:.1f}s"),
    ]
    for label, text in lines:
        screen.print(f"{label:<10} {text}", highlight=False, soft_wrap=True)
    return 0


def status_command(url: str, endpoint_url: str | None) -> str:
    """The ``gradientmail status`` command for this run, with the endpoint it was given.

    Example:
        >>> status_command("s3://b/demo", "http://127.0.0.1:8333")
        'gradientmail status s3://b/demo --endpoint-url http://127.0.0.1:8333'
    """
    return f"gradientmail status {url}" + (f" --endpoint-url {endpoint_url}" if endpoint_url else "")
