"""The simulator decides what real nodes decide: ``simulate`` against real datasets on a plain store.

``simulate`` takes shortcuts for speed (one shared claim index, orders as positions, a store
whose pages say which units they name, claims created without checking their keys again); none
may change a claim. The reference here runs one real ``SharedQueueDataset`` per node, each with
its own identifier order and claim index, behind a plain ``CountingMailbox`` over a
``MemoryMailbox``, on the same virtual clock, and must load the same units in the same order and
pay the same bill.
"""

from __future__ import annotations

import heapq
import random
from collections import Counter

import pytest
import torch

from gradientmail.mailbox.memory import MemoryMailbox
from gradientmail.mailbox.wrappers import CountingMailbox
from gradientmail.queue.dataset import SharedQueueDataset
from gradientmail.queue.units import Unit, rotated_order, unit_grid
from gradientmail.sim.queue import simulate


class Recorder:
    """A loader that records every unit it loads (one batch per step, its share of the unit)."""

    def __init__(self) -> None:
        self.loaded: list[Unit] = []

    def __call__(self, unit: Unit):
        self.loaded.append(unit)
        for step in range(unit.first, unit.first + unit.count):
            yield step, torch.tensor(1.0 / unit.count)


def reference(units, unit_times, *, rotate_lanes, shape, listing, jitter, seed, load):
    """``simulate``'s clock loop over real, separately built datasets on a plain store."""
    nodes = len(unit_times)
    store = MemoryMailbox(f"fidelity-{random.getrandbits(64):x}")
    mailboxes = [CountingMailbox(store) for _ in range(nodes)]
    datasets = [
        SharedQueueDataset(
            units,
            mailbox=mailboxes[rank],
            learner_id=f"node-{rank}",
            load=load,
            listing=listing,
            order=None if rotate_lanes is None else rotated_order(units, rank, rotate_lanes, **shape),
            resume=False,
        )
        for rank in range(nodes)
    ]
    iterators = [iter(dataset) for dataset in datasets]
    rng = random.Random(seed)
    clock = [(0.0, rank) for rank in range(nodes)]
    heapq.heapify(clock)
    finish = {}
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
    finally:
        store.clear()
    requests, stats = Counter(), Counter()
    for mailbox, dataset in zip(mailboxes, datasets):
        requests.update(mailbox.counts)
        stats.update(dataset.claim_stats)
    return finish, requests, stats


@pytest.mark.parametrize(
    ("groups", "lanes", "nodes", "rotate", "shape", "listing"),
    [
        (150, 16, 16, True, {}, "adaptive"),  # 2,400 units: listings of several pages
        (120, 12, 24, True, {"block": 1, "lag": 0}, "adaptive"),  # more nodes than lanes
        (100, 8, 8, False, {}, "adaptive"),  # the mapping's order: crowds, jumps, spreads
        (60, 8, 8, True, {}, "always"),
    ],
)
def test_simulated_nodes_claim_what_real_nodes_claim(groups, lanes, nodes, rotate, shape, listing):
    units = unit_grid(groups, 1, lanes)
    times = [(1.0, 2.0, 2.0, 4.0)[rank % 4] for rank in range(nodes)]
    simulated, real = Recorder(), Recorder()
    result = simulate(
        units,
        times,
        rotate_lanes=lanes if rotate else None,
        listing=listing,
        jitter=0.2,
        seed=3,
        load=simulated,
        **shape,
    )
    finish, requests, stats = reference(
        units,
        times,
        rotate_lanes=lanes if rotate else None,
        shape=shape,
        listing=listing,
        jitter=0.2,
        seed=3,
        load=real,
    )
    assert len(simulated.loaded) == len(units)
    assert simulated.loaded == real.loaded  # the same units, in the same order on the same clock
    assert result.finish == finish
    assert result.requests == requests
    assert result.claim_stats == stats
    assert result.claim_stats["listings"] > 0
