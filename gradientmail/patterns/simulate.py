"""A virtual-clock simulation of nodes of unequal speed draining one shared queue.

Real ``SharedQueueDataset`` iterators run against one ``MemoryMailbox``, each node behind its
own request-counting wrapper; no time passes for real. The node with the lowest virtual clock
(ties: lowest rank) asks its iterator for the next batch, which may claim a unit, and its clock
advances by that batch's share of the node's time per unit. This measures what the claim
protocol costs (requests and conflicts per claimed unit) and how the work splits, at scales
and speeds no test machine could run for real::

    >>> from gradientmail.patterns.units import unit_grid
    >>> result = simulate(unit_grid(6, 1, 4), unit_times=[1, 2, 2, 4], rotate_lanes=4)
    >>> result.makespan, result.units_by_learner
    (12.0, {'node-0': 11, 'node-1': 5, 'node-2': 5, 'node-3': 3})

One caveat: each ``next()`` runs atomically, so two nodes never race between a listing and a
create; conflicts here come only from knowledge that went stale while a node was busy.

Run ``python -m gradientmail.patterns.simulate`` for the table of listing policies.
"""

from __future__ import annotations

import argparse
import heapq
import random
import uuid
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from gradientmail.layout import CLAIMS_PREFIX
from gradientmail.mailbox.memory import MemoryMailbox
from gradientmail.mailbox.wrappers import CountingMailbox
from gradientmail.patterns.claims import DEFAULT_LISTING, LISTING_POLICIES
from gradientmail.patterns.shared_queue import SharedQueueDataset
from gradientmail.patterns.units import Unit, rotated_order, unit_grid

__all__ = ["SimulationResult", "fixed_split_makespan", "simulate"]


@dataclass
class SimulationResult:
    """What one simulated run did."""

    makespan: float
    """Virtual time at which the last node ran out of work."""
    finish: dict[str, float]
    """Per learner: when it found no unclaimed unit (after processing its last batch)."""
    units_by_learner: dict[str, int]
    """Per learner: units it claimed (and processed)."""
    requests: Counter[str] = field(default_factory=Counter)
    """Mailbox requests of all nodes by operation (a list page of 1,000 keys is one request),
    including each node's start-up (store check: 4, ``run.json``: 1)."""
    claim_stats: Counter[str] = field(default_factory=Counter)
    """Summed ``Claimer.stats``: claims, attempts, conflicts, listings."""

    @property
    def claims(self) -> int:
        return sum(self.units_by_learner.values())

    @property
    def requests_per_claim(self) -> float:
        return sum(self.requests.values()) / max(1, self.claims)

    @property
    def conflicts_per_claim(self) -> float:
        return self.claim_stats["conflicts"] / max(1, self.claims)


def _unit_batches(value: object) -> int:
    return max(1, value.count) if isinstance(value, Unit) else 1


def _share(value: object) -> Any:
    """A stand-in loader: one tiny batch per step, carrying its share of the unit's time."""
    batches = _unit_batches(value)
    first = value.first if isinstance(value, Unit) else 0
    share = torch.tensor(1.0 / batches)
    for step in range(first, first + batches):
        yield step, share


def fixed_split_makespan(units: int, unit_times: Sequence[float]) -> float:
    """Makespan when each node owns ``units / nodes`` units whatever its speed."""
    nodes = len(unit_times)
    per_node = -(-units // nodes)
    return per_node * max(unit_times)


def simulate(
    units: Mapping[str, Any],
    unit_times: Sequence[float],
    *,
    rotate_lanes: int | None = None,
    orders: Sequence[Sequence[str]] | None = None,
    listing: str = DEFAULT_LISTING,
    jitter: float = 0.0,
    seed: int = 0,
    load: Callable[[Any], Any] = _share,
) -> SimulationResult:
    """Simulate ``len(unit_times)`` nodes; node ``r`` needs ``unit_times[r]`` per unit.

    Args:
        units: The shared mapping (e.g. ``unit_grid(...)``).
        unit_times: Virtual time each node needs for one unit (its batches share it equally).
        rotate_lanes: Node ``r`` prefers ``rotated_order(units, r, rotate_lanes)``; None keeps
            the mapping's order on every node.
        orders: Explicit preference order per node (instead of ``rotate_lanes``).
        listing: The claimer's listing policy (``claims.LISTING_POLICIES``).
        jitter: Each batch takes its time times a uniform factor in ``[1 - jitter, 1 + jitter]``.
        seed: Seed of the jitter.
        load: The loader; its tensors' ``.item()`` is the fraction of a unit each batch costs.
    """
    if listing not in LISTING_POLICIES:
        raise ValueError(f"listing must be one of {LISTING_POLICIES}, not {listing!r}")
    nodes = len(unit_times)
    if nodes < 1:
        raise ValueError("simulate needs at least one node")
    store = MemoryMailbox(f"simulate-{uuid.uuid4().hex}")
    mailboxes = [CountingMailbox(store) for _ in range(nodes)]
    datasets = []
    for rank in range(nodes):
        if orders is not None:
            order = list(orders[rank])
        elif rotate_lanes is not None:
            order = rotated_order(units, rank, rotate_lanes)
        else:
            order = None
        dataset = SharedQueueDataset(
            units, mailbox=mailboxes[rank], learner_id=f"node-{rank}", load=load, order=order
        )
        dataset._listing = listing
        datasets.append(dataset)
    iterators = [iter(dataset) for dataset in datasets]
    rng = random.Random(seed)
    clock = [(0.0, rank) for rank in range(nodes)]
    heapq.heapify(clock)
    finish: dict[str, float] = {}
    try:
        while clock:
            now, rank = heapq.heappop(clock)
            try:
                _, share = next(iterators[rank])
            except StopIteration:
                finish[f"node-{rank}"] = now
                continue
            cost = unit_times[rank] * float(share)
            if jitter:
                cost *= rng.uniform(1 - jitter, 1 + jitter)
            heapq.heappush(clock, (now + cost, rank))
        claimed: Counter[str] = Counter()
        for key in store.list(CLAIMS_PREFIX):
            claimed[_learner(store.get(key))] += 1
    finally:
        store.clear()
    requests: Counter[str] = Counter()
    stats: Counter[str] = Counter()
    for mailbox, dataset in zip(mailboxes, datasets, strict=True):
        requests.update(mailbox.counts)
        stats.update(dataset._claim_stats)
    return SimulationResult(
        makespan=max(finish.values()),
        finish=finish,
        units_by_learner={f"node-{rank}": claimed[f"node-{rank}"] for rank in range(nodes)},
        requests=requests,
        claim_stats=stats,
    )


def _learner(data: bytes | None) -> str:
    import json

    return json.loads(data or b"{}").get("learner", "?")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m gradientmail.patterns.simulate",
        description="Requests and conflicts per claimed unit, by listing policy (virtual clock).",
    )
    parser.add_argument("--units", type=int, default=20_000)
    parser.add_argument("--learners", type=int, nargs="+", default=[4, 16, 64])
    parser.add_argument("--policies", nargs="+", default=list(LISTING_POLICIES[:3]))
    parser.add_argument("--jitter", type=float, default=0.2)
    args = parser.parse_args(argv)
    print("units   learners  rotation  policy    req/claim  conflicts/claim  listings/claim  makespan/ideal")
    for learners in args.learners:
        speeds = [(1, 2, 2, 4)[rank % 4] for rank in range(learners)]
        units = unit_grid(-(-args.units // learners), 1, learners)
        ideal = len(units) / sum(1 / s for s in speeds)
        for rotate in (True, False):
            for policy in args.policies:
                result = simulate(
                    units, speeds, rotate_lanes=learners if rotate else None,
                    listing=policy, jitter=args.jitter,
                )
                print(
                    f"{len(units):<7} {learners:<9} {'on' if rotate else 'off':<9} {policy:<9} "
                    f"{result.requests_per_claim:<10.3f} {result.conflicts_per_claim:<16.3f} "
                    f"{result.claim_stats['listings'] / result.claims:<15.3f} "
                    f"{result.makespan / ideal:.3f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
