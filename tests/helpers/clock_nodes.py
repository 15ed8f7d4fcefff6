"""Node processes whose wall clocks disagree, for the tests of how progress is counted.

Each node is a forked process whose ``time.time`` (and ``time.time_ns``) runs ``offset_s`` off
before it enters its ``Session``, as on a machine whose clock is wrong; the monotonic clock is
left alone, as a wrong wall clock leaves it. The test drives every node's steps over a pipe, one
node at a time, so the order of the folds is the test's, not the scheduler's.

The toy: node ``i`` moves parameter ``i`` of a zero model by ``push`` per step and exchanges at
every step (``outer="average"``), so the run's parameter ``i`` is ``push / N`` per step of node
``i``, whatever the other nodes did.
"""

from __future__ import annotations

import multiprocessing
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import torch
from process_harness import join_all  # tests/helpers/ is on sys.path (tests/conftest.py)

REPLY_TIMEOUT_S = 60.0
"""How long the test waits for a node's answer before it fails (a node that hangs)."""


@dataclass(frozen=True)
class ClockNode:
    """One node: its learner id, how far its wall clock is off, and the parameter it moves."""

    learner: str
    offset_s: float
    parameter: int


def skew_wall_clock(offset_s: float) -> None:
    """This process's wall clock runs ``offset_s`` off; the library reads ``time.time()`` through
    the module, so the patch reaches it."""
    real_time, real_time_ns = time.time, time.time_ns
    time.time = lambda: real_time() + offset_s  # type: ignore[assignment]
    time.time_ns = lambda: real_time_ns() + int(offset_s * 1e9)  # type: ignore[assignment]


def run_node(box: str, node: ClockNode, width: int, push: float, conn: Connection) -> None:
    """Enter, then on each ``"step"`` move the node's parameter and exchange (awaited); leave on
    ``"leave"``. Answers ``"entered"``, ``"stepped"``, ``"left"``."""
    skew_wall_clock(node.offset_s)
    from gradientmail import LocalMailbox, Session

    torch.set_num_threads(1)
    model = torch.nn.Linear(width, 1, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    session = Session(
        model,
        mailbox=LocalMailbox(box),
        learner_id=node.learner,
        every=None,
        every_steps=1,
        outer="average",
        fragments=2,
    )
    with session:
        conn.send("entered")
        while conn.recv() == "step":
            with torch.no_grad():
                model.weight[0, node.parameter] += push
            session.step(samples=1)
            session.wait()
            conn.send("stepped")
    conn.send("left")


def _expect(conn: Connection, node: ClockNode, answer: str) -> None:
    if not conn.poll(REPLY_TIMEOUT_S):
        raise TimeoutError(f"node {node.learner!r} did not answer {answer!r} within {REPLY_TIMEOUT_S} s")
    got = conn.recv()
    if got != answer:
        raise AssertionError(f"node {node.learner!r} answered {got!r}, expected {answer!r}")


def run_lockstep(box: Path, nodes: list[ClockNode], rounds: int, push: float) -> None:
    """All nodes enter, then take ``rounds`` steps each, in turn (node 0, 1, ... then again), and
    leave once all are done: every node is in the run for every step of every other."""
    context = multiprocessing.get_context("fork")
    width = max(node.parameter for node in nodes) + 1
    pipes = [context.Pipe() for _ in nodes]
    processes = [
        context.Process(target=run_node, args=(str(box), node, width, push, child), daemon=True)
        for node, (_, child) in zip(nodes, pipes)
    ]
    for process in processes:
        process.start()
    try:
        for node, (conn, _) in zip(nodes, pipes):
            _expect(conn, node, "entered")
        for _ in range(rounds):
            for node, (conn, _) in zip(nodes, pipes):
                conn.send("step")
                _expect(conn, node, "stepped")
        for node, (conn, _) in zip(nodes, pipes):
            conn.send("leave")
            _expect(conn, node, "left")
    finally:
        codes = join_all(processes, REPLY_TIMEOUT_S)
    assert codes == [0] * len(nodes), f"node exit codes {codes}"
