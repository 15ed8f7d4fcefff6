"""Two epochs as one run of real node processes: a node SIGKILLed in the second epoch and
restarted under its learner id, and every ``(epoch, unit, step)`` reaches the run's state once.

The nodes run the documented loop with the queue's defaults, under which a learner restarted
under its learner id takes its unfinished units back. A batch the dead node trained after its
last fold is trained again by its restart and counted once.
"""

from __future__ import annotations

from collections import Counter

import pytest
from elastic_nodes import consumed_pairs, written_steps
from epoch_nodes import STEPS_PER_UNIT, EpochNode, batch_counter, decode_step, run_epoch_nodes

from gradientmail import LocalMailbox, consensus
from gradientmail.data import epochs
from gradientmail.status import read_run

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]


def test_a_node_killed_in_the_second_epoch_and_restarted_trains_every_epoch_unit_step_once(tmp_path):
    root = tmp_path / "box"
    box = LocalMailbox(root)
    units = epochs({f"{i:05d}": i for i in range(24)}, 2, seed=5)
    common = dict(root=str(root), units=units, out_dir=str(tmp_path))
    specs = [
        # node-0 is the fastest, so it reaches the second epoch while the others are in it too.
        EpochNode(learner="node-0", train=0.02, kill_in_epoch=1, kill_after=5, **common),
        EpochNode(learner="node-1", train=0.05, **common),
        EpochNode(learner="node-2", train=0.05, **common),
    ]
    run_epoch_nodes(specs, killed=frozenset({"node-0"}))
    run_epoch_nodes([EpochNode(learner="node-0", run=2, **common)])

    pairs = consumed_pairs(tmp_path)
    seen = Counter(pair for consumed in pairs.values() for pair in consumed)
    trained = Counter(decode_step(step) for _, step in seen.elements())
    expected = {(e, u, p) for e in range(2) for u in range(24) for p in range(STEPS_PER_UNIT)}
    assert set(trained) == expected, "an (epoch, unit, step) was never trained"
    assert all(units[ident].epoch == decode_step(step)[0] for ident, step in seen), "a batch under another epoch's key"

    dead = pairs["node-0-1"]
    assert sum(1 for _, step in dead if decode_step(step)[0] == 1) == 5, "killed in the second epoch"
    assert pairs.get("node-0-2"), "the restart took back its unfinished units of the second epoch"
    written = written_steps(tmp_path, "node-0")
    in_flight = {(ident, step) for ident, step in dead if step > written.get(ident, -1)}
    twice = {pair for pair, n in seen.items() if n > 1}
    assert twice <= set(dead) and set(seen.values()) <= {1, 2}, "trained twice, and not by the dead node"

    # In the run's state each batch moved its own weight by 1 / N (N: the learners its fold
    # counted, 1 to 3): a batch missing reads 0, a batch counted twice 2/3, 5/6, 4/3 or more
    # (or 1, twice 1/2, which the samples' total below also bounds).
    counter = batch_counter()
    samples = sum(consensus(box, counter).values())
    counts = (counter.weight[0] * 6).round().tolist()  # 6 / N: 6, 3 or 2
    assert set(counts) <= {2.0, 3.0, 6.0}, f"a batch missing from the run's state or counted twice: {counts}"
    total = len(expected)
    print(
        f"\nepochs kill/restart: {samples} samples in the run of {total}, each batch once; {len(twice)} "
        f"trained again after the kill ({len(in_flight)} the dead node consumed after its last written record)"
    )
    assert total <= samples <= total + len(in_flight)
    run = read_run(box)
    assert len(run.done) == len(units) and not run.orphaned
