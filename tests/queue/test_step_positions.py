"""A unit that changes hands continues by batch *position*, not by step label.

Steps are labels: they may repeat (six batches all labelled 0) or go backwards. Every hand-over
(``resume=``, a released unit, a reclaim after a lease expired, ``load_state_dict``) must deliver
exactly the batches not consumed yet, with their labels.
"""

from __future__ import annotations

import json
from collections import Counter
from datetime import timedelta

import pytest
from handover_nodes import LabelledLoad, Node, consumed, finish, start, written_positions
from queue_nodes import named_units

from gradientmail import LocalMailbox, SharedQueueDataset
from gradientmail.layout import claim_key
from gradientmail.patterns.shared_queue import shared_queue
from gradientmail.queue.elastic_options import ElasticOptions
from gradientmail.queue.progress import Consumption, ProgressTracker, tagged_items
from gradientmail.queue.reclaim import ElasticClaimer
from gradientmail.status import read_run

pytestmark = pytest.mark.timeout(90)


def _take(box, units, learner, load, stop_after=None, **options):
    """Run a queue in this process; the ``(index, position, step)`` of each batch consumed."""
    got = []
    with shared_queue(
        units, mailbox=box, learner_id=learner, load=load, workers=0, prefetch=2, resume=True, **options
    ) as batches:
        for step, batch in batches:
            got.append((int(batch[0]), int(batch[1]), step))
            if stop_after is not None and len(got) == stop_after:
                break
    return got


@pytest.mark.parametrize("labels", [(0,) * 6, (5, 3, 9, 1, 7, 2)], ids=["repeated", "unordered"])
def test_a_released_unit_continues_after_the_batches_consumed(memory_mailbox, labels):
    """Stopped after two (or three) batches, the next node gets exactly the other ones."""
    units = named_units(1)
    load = LabelledLoad(labels)
    stop = 2 if labels[0] == 0 else 3
    first = _take(memory_mailbox, units, "node-0", load, stop_after=stop)
    claim = json.loads(memory_mailbox.get(claim_key("00000")))
    second = _take(memory_mailbox, units, "node-1", load)
    assert [(p, s) for _, p, s in first] == [(p, labels[p]) for p in range(stop)]
    assert [(p, s) for _, p, s in second] == [(p, labels[p]) for p in range(stop, 6)], (
        "every batch not consumed yet, with its own label"
    )
    assert (claim["state"], claim["position"]) == ("released", stop - 1)
    assert len(read_run(memory_mailbox).done) == 1


def test_resume_takes_back_a_dead_incarnations_unit_by_position(memory_mailbox):
    """A crash leaves the progress record; the restarted learner continues after its position."""
    labels = (0,) * 6
    load = LabelledLoad(labels)
    items = named_units(2)
    options = ElasticOptions(resume=True, lease_s=None)
    first = ElasticClaimer(memory_mailbox, ["00000", "00001"], "node-0", options)
    tracker = ProgressTracker(memory_mailbox, "node-0", options)
    tracker.start()
    consumption = Consumption(tracker)
    stream = tagged_items(first, lambda identifier: load(items[identifier]))
    got = [consumption.next_from(stream) for _ in range(4)]  # the 4th is in the loop's hands
    tracker.flush()
    # The process dies here: nothing is released (its writer thread stops, as with the process).
    tracker.close(release=False)
    record = json.loads(memory_mailbox.get("work/node-0/00000"))

    again = ElasticClaimer(memory_mailbox, ["00000", "00001"], "node-0", ElasticOptions(resume=True, lease_s=None))
    rest = [
        (tag.unit, int(tensor[1]), step)
        for step, tensor, tag in tagged_items(again, lambda identifier: load(items[identifier]))
        if not tag.end
    ]
    assert [int(tensor[1]) for _, tensor in got] == [0, 1, 2, 3]
    assert rest == [("00000", p, 0) for p in range(3, 6)] + [("00001", p, 0) for p in range(6)]
    assert (record["step"], record["position"]) == (0, 2)


def test_state_dict_continues_by_position(memory_mailbox):
    units = named_units(2)
    load = LabelledLoad((7,) * 5)
    dataset = SharedQueueDataset(units, mailbox=memory_mailbox, learner_id="node-0", load=load, resume=False)
    iterator = iter(dataset)
    for _ in range(2):
        next(iterator)
    state = dataset.state_dict()
    restored = SharedQueueDataset(units, mailbox=memory_mailbox, learner_id="node-0", load=load, resume=False)
    restored.load_state_dict(state)
    rest = [(int(batch[0]), int(batch[1]), step) for step, batch in restored]
    assert rest == [(0, p, 7) for p in range(2, 5)] + [(1, p, 7) for p in range(5)]
    assert state["units"]["00000"]["position"] == 1


def test_a_record_without_a_position_is_continued_by_its_step(memory_mailbox):
    """Records of earlier versions hold only the step label: best effort, as before."""
    units = named_units(1)
    memory_mailbox.put_if_absent(
        claim_key("00000"),
        json.dumps(
            {
                "learner": "old",
                "token": "t",
                "incarnation": "i",
                "state": "released",
                "step": 2,
            }
        ).encode(),
    )
    got = _take(memory_mailbox, units, "node-1", LabelledLoad((0, 1, 2, 3, 4)))
    assert [(p, s) for _, p, s in got] == [(3, 3), (4, 4)]


@pytest.mark.slow
def test_a_killed_nodes_units_are_reclaimed_by_position(tmp_path):
    """Real processes, lease 1.5 s, every label 0: SIGKILL one of three nodes; every batch is
    consumed, duplicates only among the dead node's batches after its last progress write.

    The survivors load each batch in 150 ms, so they run out of units well after the dead
    node's lease expired (a node that dies less than a lease before they run out leaves its
    units for its restart)."""
    box = LocalMailbox(tmp_path / "box")
    units = named_units(12)
    nodes = [
        Node(
            box,
            f"node-{rank}",
            units,
            str(tmp_path),
            delay=0.004 if rank == 0 else 0.15,
            prefetch=3,
            lease_s=1.5,
            kill_after=8 if rank == 0 else None,
        )
        for rank in range(3)
    ]
    finish(start(nodes, together=True), killed=1)

    runs = consumed(tmp_path)
    seen = Counter(pair for pairs in runs.values() for pair in pairs)
    assert set(seen) == {(i, p) for i in range(12) for p in range(6)}, "a batch was never consumed"
    dead = next(pairs for name, pairs in runs.items() if name.startswith("consumed-node-0-"))
    assert len(dead) == 8
    duplicates = {pair for pair, n in seen.items() if n > 1}
    assert duplicates <= set(dead) and all(n <= 2 for n in seen.values())
    written = written_positions(tmp_path, "node-0")
    in_flight = sum(1 for index, position in dead if position > written.get(index, -1))
    assert len(duplicates) <= in_flight
    run = read_run(box)
    assert len(run.done) == len(units) and not run.orphaned


def test_lease_option_accepts_the_same_labels(memory_mailbox):
    """With a lease the same position records are written (and read back on release)."""
    units = named_units(1)
    load = LabelledLoad((4, 4, 4))
    first = _take(memory_mailbox, units, "node-0", load, stop_after=1, lease=timedelta(seconds=30))
    second = _take(memory_mailbox, units, "node-1", load, lease=timedelta(seconds=30))
    assert [p for _, p, _ in first + second] == [0, 1, 2]
