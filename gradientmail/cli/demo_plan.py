"""The demo's plan (nodes, speeds, units) and its schedule on a virtual clock, without overhead."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from gradientmail.errors import DemoError
from gradientmail.plot import Span

DEFAULT_SPEEDS = (1.0, 2.0, 2.0, 4.0)
"""Relative time per batch of the default nodes A, B, C, D (the design note's example)."""


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

    Args:
        plan: The nodes, their speeds and the units.
        shared: True for the shared queue (a ready node takes the next untaken unit, its own
            lane first; ties go to the lower node), False for the fixed split (node ``i`` owns lane ``i``).

    Returns:
        One ``Span`` per unit.

    Example:
        The design note's example: the shared queue ends at t = 12, the fixed split at t = 24.

        >>> plan = Plan(("A", "B", "C", "D"), (1.0, 2.0, 2.0, 4.0), units=24, unit_steps=1, batch_time=1.0)
        >>> makespan(simulate(plan, shared=True)), makespan(simulate(plan, shared=False))
        (12.0, 24.0)
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
    """When the last span ends (0.0 for none)."""
    return max((span.end for span in spans), default=0.0)


def node_names(count: int) -> tuple[str, ...]:
    """``A``, ``B``, ... for up to 26 nodes, else ``0``, ``1``, ..."""
    if count <= 26:
        return tuple(chr(ord("A") + index) for index in range(count))
    return tuple(str(index) for index in range(count))


def make_plan(args: argparse.Namespace) -> Plan:
    """A ``Plan`` from the parsed ``demo`` options.

    Raises:
        DemoError: The options parse but describe no run (speeds per node, units per node, slowdown).
    """
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
