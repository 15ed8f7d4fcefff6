"""A virtual-clock simulation of nodes of unequal speed draining one shared queue.

Real ``SharedQueueDataset`` iterators run against one ``MemoryMailbox``, each node behind its
own request-counting wrapper; no time passes for real. The node with the lowest virtual clock
(ties: lowest rank) asks its iterator for the next batch, which may claim a unit, and its clock
advances by that batch's share of the node's time per unit. This measures what the claim
protocol costs (requests and conflicts per claimed unit) and how the work splits, at scales
and speeds no test machine could run for real::

    >>> from gradientmail.queue.units import unit_grid
    >>> result = simulate(unit_grid(6, 1, 4), unit_times=[1, 2, 2, 4], rotate_lanes=4)
    >>> result.makespan, result.units_by_learner
    (12.0, {'node-0': 11, 'node-1': 5, 'node-2': 5, 'node-3': 3})

One caveat: each ``next()`` runs atomically, so two nodes never race between a listing and a
create; conflicts here come only from knowledge that went stale while a node was busy.

``SimulationResult.step_spread`` is the largest difference between the steps two nodes were
processing at the same moment: how far apart in the run the preference order lets nodes drift.

Run ``python -m gradientmail.sim.queue`` for the table of preference orders (add
``--policies adaptive always`` to compare listing policies).
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import uuid
from array import array
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from gradientmail.layout import CLAIMS_PREFIX
from gradientmail.queue.claim_index import ClaimIndex, PositionOrder
from gradientmail.queue.claimer import DEFAULT_LISTING, LISTING_POLICIES
from gradientmail.queue.dataset import SharedQueueDataset
from gradientmail.queue.units import DEFAULT_BLOCK, DEFAULT_LAG, Unit, rotated_order, unit_grid
from gradientmail.run_record import prepare_mailbox
from gradientmail.sim.paged_memory import PagedCountingMailbox, PagedMemoryMailbox

__all__ = [
    "fixed_split_makespan",
    "rotated_positions",
    "simulate",
    "SimulationResult",
]


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
    including each node's start-up (``prepare_mailbox``: 5 for the node that creates
    ``run.json``, 2 for the others)."""
    claim_stats: Counter[str] = field(default_factory=Counter)
    """Summed ``Claimer.stats``: claims, attempts, conflicts, listings, blind, stale."""
    step_spread: int = 0
    """Largest difference between the steps two nodes were processing at the same time."""

    @property
    def claims(self) -> int:
        return sum(self.units_by_learner.values())

    @property
    def requests_per_claim(self) -> float:
        return sum(self.requests.values()) / max(1, self.claims)

    @property
    def conflicts_per_claim(self) -> float:
        return self.claim_stats["conflicts"] / max(1, self.claims)


_SHARES: dict[int, torch.Tensor] = {}


def _unit_batches(value: object) -> int:
    return max(1, value.count) if isinstance(value, Unit) else 1


def _share(value: object) -> Any:
    """A stand-in loader: one tiny batch per step, carrying its share of the unit's time."""
    batches = _unit_batches(value)
    first = value.first if isinstance(value, Unit) else 0
    share = _SHARES.get(batches)
    if share is None:
        share = _SHARES.setdefault(batches, torch.tensor(1.0 / batches))
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
    block: int | None = None,
    lag: int | None = None,
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
        rotate_lanes: Node ``r`` prefers ``rotated_order(units, r, rotate_lanes, block=block,
            lag=lag)``; None keeps the mapping's order on every node.
        block, lag: ``rotated_order``'s (None: its defaults; 1 and 0: the design note's plain
            rotation).
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
    # One dataset is built (its identifiers checked) for real; the other nodes are copies with
    # their own mailbox, name and order, sharing the sorted claim index and the claim stats.
    index = ClaimIndex(units)
    store = PagedMemoryMailbox(f"simulate-{uuid.uuid4().hex}", index=index)
    mailboxes = [PagedCountingMailbox(store) for _ in range(nodes)]
    own_orders = rotate_lanes is not None or orders is not None
    template = SharedQueueDataset(
        units,
        mailbox=mailboxes[0],
        learner_id="node-0",
        load=load,
        order=list(units) if own_orders else None,  # as real nodes given orders would: order=...
        listing=listing,
        claim_index=index,
        prepared=True,
        resume=False,  # the design note's claim protocol, which these figures measure
    )
    # Each node's start-up bill as its first next() would pay it (5 requests for the node that
    # creates run.json, 2 for the others); the unit set's fingerprint is computed once, by the
    # first node, as every node computes the same one.
    for rank, mailbox in enumerate(mailboxes):
        prepare_mailbox(mailbox, len(template.units), template.units if rank == 0 else None)
    node_orders = _node_orders(index, list(template.units), nodes, rotate_lanes, block, lag, orders)
    datasets = [
        template.for_node(mailbox=mailboxes[rank], learner_id=f"node-{rank}", order=order)
        for rank, order in enumerate(node_orders)
    ]
    iterators = [iter(dataset) for dataset in datasets]
    rng = random.Random(seed)
    fractions: dict[int, float] = {}
    clock = [(0.0, rank) for rank in range(nodes)]
    heapq.heapify(clock)
    finish: dict[str, float] = {}
    current: dict[int, int] = {}  # rank -> step of the batch it is processing
    lowest: list[tuple[int, int]] = []  # (step, rank) heaps of current steps, stale entries
    highest: list[tuple[int, int]] = []  # dropped when they reach the top: O(log nodes) a batch
    spread = 0
    try:
        while clock:
            now, rank = heapq.heappop(clock)
            try:
                step, share = next(iterators[rank])
            except StopIteration:
                finish[f"node-{rank}"] = now
                current.pop(rank, None)
                continue
            current[rank] = step
            heapq.heappush(lowest, (step, rank))
            heapq.heappush(highest, (-step, rank))
            while current.get(lowest[0][1]) != lowest[0][0]:
                heapq.heappop(lowest)
            while current.get(highest[0][1]) != -highest[0][0]:
                heapq.heappop(highest)
            spread = max(spread, -highest[0][0] - lowest[0][0])
            fraction = fractions.get(id(share))
            if fraction is None:
                fraction = float(share)
                if load is _share:  # its tensors live on in _SHARES: a tensor call once per kind
                    fractions[id(share)] = fraction
            cost = unit_times[rank] * fraction
            if jitter:
                cost *= rng.uniform(1 - jitter, 1 + jitter)
            heapq.heappush(clock, (now + cost, rank))
        claimed = _learners(store, list(store.list(CLAIMS_PREFIX)))
    finally:
        store.clear()
    requests: Counter[str] = Counter()
    for mailbox in mailboxes:
        requests.update(mailbox.counts)
    stats = template.claim_stats  # every copy adds its claimer's stats to the template's
    return SimulationResult(
        makespan=max(finish.values()),
        finish=finish,
        units_by_learner={f"node-{rank}": claimed[f"node-{rank}"] for rank in range(nodes)},
        requests=requests,
        claim_stats=stats,
        step_spread=spread,
    )


def _node_orders(
    index: ClaimIndex,
    identifiers: list[str],
    nodes: int,
    rotate_lanes: int | None,
    block: int | None,
    lag: int | None,
    orders: Sequence[Sequence[str]] | None,
) -> list[PositionOrder]:
    """Each node's preference as sorted positions (4 bytes a unit; the mapping's order shared)."""
    if orders is not None:
        return [_positions(index, list(orders[rank]), rank) for rank in range(nodes)]
    if rotate_lanes is None:
        return [_positions(index, identifiers, 0)] * nodes
    return list(rotated_positions(index, identifiers, nodes, rotate_lanes, block=block, lag=lag))


def _positions(index: ClaimIndex, order: list[str], rank: int) -> PositionOrder:
    try:
        positions = array("i", index.order(order))
    except KeyError as exc:
        raise ValueError(f"orders[{rank}] names {exc.args[0]!r}, which is not a unit") from None
    if len(positions) != len(index) or len(set(positions)) != len(index):
        raise ValueError(f"orders[{rank}] must list every unit identifier exactly once")
    return PositionOrder(index, positions)


def rotated_positions(
    index: ClaimIndex,
    identifiers: Sequence[str],
    nodes: int,
    lanes: int,
    *,
    block: int | None = None,
    lag: int | None = None,
) -> Iterator[PositionOrder]:
    """``rotated_order(identifiers, rank, lanes, ...)`` for each rank, as positions in ``index``.

    ``rotated_order`` walks every unit in Python (about 0.2 s a node at 1M units). Its shape is
    the same for every rank: a sequence of (group, slot) pairs, slot 0 the node's own unit and
    slot ``s`` the ``s``-th unit after it in the group's key order. Only which unit is the
    node's own changes with the rank, so numpy derives each node's positions, and where its
    runs of consecutive positions start (``order_runs.OrderRuns``), in milliseconds
    (single-threaded: torch's thread pool only adds contention on a small machine).
    """
    import numpy

    shape = {name: value for name, value in (("block", block), ("lag", lag)) if value is not None}
    rotated_order([], 0, lanes, **shape)  # checks the arguments
    block, lag = shape.get("block", DEFAULT_BLOCK), shape.get("lag", DEFAULT_LAG)
    count = len(identifiers)
    base = numpy.array(index.order(identifiers), dtype=numpy.int64)  # mapping index -> position
    starts = numpy.arange(0, count, lanes, dtype=numpy.int64)  # each group's first mapping index
    sizes = numpy.minimum(count - starts, lanes)
    group_of = numpy.repeat(numpy.arange(len(starts)), sizes)
    # Each group's positions in key order, and each unit's place in that order.
    by_key = numpy.lexsort((base, group_of))  # mapping indices, group by group, by position
    sorted_positions = base[by_key]
    place = numpy.empty(count, dtype=numpy.int64)
    place[by_key] = numpy.arange(count) - starts[group_of[by_key]]
    # The shape: own units of a block, then the other units of the block `lag` earlier, from
    # its last group.
    pieces_group, pieces_slot = [], []
    blocks = -(-len(starts) // block) if count else 0
    for at in range(blocks + lag):
        if at < blocks:
            own = numpy.arange(at * block, min((at + 1) * block, len(starts)))
            pieces_group.append(own)
            pieces_slot.append(numpy.zeros(len(own), dtype=numpy.int64))
        if at >= lag:
            helped = numpy.arange(min((at - lag + 1) * block, len(starts)) - 1, (at - lag) * block - 1, -1)
            counts = sizes[helped] - 1
            pieces_group.append(numpy.repeat(helped, counts))
            offsets = numpy.arange(int(counts.sum())) - numpy.repeat(numpy.cumsum(counts) - counts, counts)
            pieces_slot.append(offsets + 1)
    shape_group = numpy.concatenate(pieces_group) if pieces_group else numpy.zeros(0, dtype=numpy.int64)
    shape_slot = numpy.concatenate(pieces_slot) if pieces_slot else numpy.zeros(0, dtype=numpy.int64)
    shape_start, shape_size = starts[shape_group], sizes[shape_group]
    # Per rank, in int32 and in place: slot = own place + shape slot, wrapped once (both are
    # below the group's size), then the position at that slot of the group's key order.
    unwrapped = (shape_slot + shape_start).astype(numpy.int32)
    limit = (shape_start + shape_size).astype(numpy.int32)
    wrap = shape_size.astype(numpy.int32)
    positions_by_slot = sorted_positions.astype(numpy.int32)
    for rank in range(nodes):
        own_place = place[starts + rank % sizes].astype(numpy.int32)  # per group: where the node's own unit sorts
        slots = own_place[shape_group]
        slots += unwrapped
        numpy.subtract(slots, wrap, out=slots, where=slots >= limit)
        positions = positions_by_slot[slots]
        steps = numpy.subtract(positions[1:], positions[:-1])
        numpy.abs(steps, out=steps)
        run_starts = numpy.flatnonzero(steps != 1).astype(numpy.int32) + 1
        orders = array("i")
        orders.frombytes(positions.tobytes())
        runs = array("i", [0] if count else [])
        runs.frombytes(run_starts.tobytes())
        yield PositionOrder(index, orders, runs)


def _learner(data: bytes | None) -> str:
    return json.loads(data or b"{}").get("learner", "?")


def _learners(store: PagedMemoryMailbox, keys: list[str]) -> Counter[str]:
    """Claims per learner: a million claim bodies are a million JSON parses, so bodies are
    grouped by what precedes their first comma (``{"learner":"node-7"`` for the bodies
    ``claims.claim_body`` writes) and each group is parsed once; a body whose head is not a
    complete ``learner`` field alone is parsed whole."""
    heads = Counter(data.partition(b",")[0] for data in map(store.get, keys) if data is not None)
    claimed: Counter[str] = Counter()
    whole = set()
    for head, count in heads.items():
        try:
            fields = json.loads(head + b"}")
        except ValueError:
            fields = None
        if isinstance(fields, dict) and list(fields) == ["learner"] and isinstance(fields["learner"], str):
            claimed[fields["learner"]] += count
        else:
            whole.add(head)
    if whole:
        for data in map(store.get, keys):
            if data is None or data.partition(b",")[0] in whole:
                claimed[_learner(data)] += 1
    elif len(keys) != sum(heads.values()):
        claimed["?"] += len(keys) - sum(heads.values())
    return claimed


ORDERS: dict[str, dict[str, int] | None] = {
    "mapping": None,
    "plain": {"block": 1, "lag": 0},
    "default": {},
    "block=8": {"block": 8, "lag": 1},
}
"""The preference orders ``main`` compares: every node in the mapping's order, the design note's plain
rotation, ``rotated_order``'s default, and longer own stretches."""


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m gradientmail.sim.queue",
        description="Requests and conflicts per claimed unit, by preference order and listing "
        "policy (virtual clock; speeds 1:2:2:4 repeated, each unit's time jittered).",
    )
    parser.add_argument("--units", type=int, default=20_000)
    parser.add_argument("--learners", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--orders", nargs="+", default=list(ORDERS), choices=list(ORDERS))
    parser.add_argument("--policies", nargs="+", default=[DEFAULT_LISTING], choices=LISTING_POLICIES)
    parser.add_argument("--jitter", type=float, default=0.2)
    args = parser.parse_args(argv)
    print(
        "units   learners  order     policy    req/claim  conflicts/claim  listings/claim  step spread  makespan/ideal"
    )
    for learners in args.learners:
        speeds = [(1, 2, 2, 4)[rank % 4] for rank in range(learners)]
        units = unit_grid(-(-args.units // learners), 1, learners)
        ideal = len(units) / sum(1 / s for s in speeds)
        for name in args.orders:
            shape = ORDERS[name]
            for policy in args.policies:
                result = simulate(
                    units,
                    speeds,
                    rotate_lanes=None if shape is None else learners,
                    listing=policy,
                    jitter=args.jitter,
                    **(shape or {}),
                )
                print(
                    f"{len(units):<7} {learners:<9} {name:<9} {policy:<9} "
                    f"{result.requests_per_claim:<10.3f} {result.conflicts_per_claim:<16.3f} "
                    f"{result.claim_stats['listings'] / result.claims:<15.3f} "
                    f"{result.step_spread:<12} {result.makespan / ideal:.3f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
