"""The elastic shared queue with real node processes: a SIGKILLed node, a stop-and-resume with a
different number of nodes, and the design note's behaviour when the options are off.

Duplicates are counted exactly from what each training loop appended to its file before
anything else happened, and bounded by what the killed node had consumed beyond its last
progress record known to have been written (``elastic_nodes.ProgressLog``).
"""

from __future__ import annotations

from collections import Counter
from datetime import timedelta

import pytest
import torch
from elastic_nodes import ElasticSpec, consumed_pairs, run_elastic_nodes, written_steps
from queue_nodes import RecordingLoad, named_units

from gradientmail import LocalMailbox, SharedQueueDataset, UnsafeStoreError, consensus
from gradientmail.layout import CLAIMS_PREFIX, DONE_PREFIX, LEASES_PREFIX, WORK_PREFIX
from gradientmail.mailbox.wrappers import CountingMailbox
from gradientmail.patterns.shared_queue import shared_queue
from gradientmail.queue.claimer import Claimer
from gradientmail.status import read_run

pytestmark = [pytest.mark.timeout(90), pytest.mark.slow]  # every test here starts processes


def _expected(units) -> set[tuple[str, int]]:
    return {(ident, step) for ident, item in units.items() for step in range(item.steps)}


def _seen(out) -> tuple[Counter, dict]:
    pairs = consumed_pairs(out)
    seen: Counter[tuple[str, int]] = Counter()
    for consumed in pairs.values():
        seen.update(consumed)
    return seen, pairs


@pytest.mark.parametrize("workers", [1, 2])
def test_survivors_finish_a_killed_nodes_units(tmp_path, workers):
    """SIGKILL one of three nodes early (lease 1.5 s): every step is consumed, duplicates only
    among the batches the dead node consumed after its last recorded progress.

    The survivors are slower and train for 6 s or more after the kill (some 60 batches each,
    100 ms apiece), so the dead node's lease expires before they run out of units: a node that
    dies less than a lease before its peers run out leaves its units for its restart instead."""
    box = LocalMailbox(tmp_path / "box")
    units = named_units(24, steps=6)
    specs = [
        ElasticSpec(
            box,
            f"node-{rank}",
            units,
            str(tmp_path),
            delay=0.004,
            train=0.008 if rank == 0 else 0.1,
            prefetch=3,
            workers=workers,
            lease_s=1.5,
            kill_after=15 if rank == 0 else None,
        )
        for rank in range(3)
    ]
    run_elastic_nodes(specs, killed={"node-0"})

    seen, pairs = _seen(tmp_path)
    assert set(seen) == _expected(units), "a step was never consumed"
    duplicates = {pair: n for pair, n in seen.items() if n > 1}
    dead = pairs["node-0-1"]
    assert len(dead) == 15
    assert set(duplicates) <= set(dead), "a duplicate that the dead node did not consume"
    assert all(n == 2 for n in duplicates.values())
    written = written_steps(tmp_path, "node-0")
    in_flight = sum(1 for ident, step in dead if step > written.get(ident, -1))
    print(
        f"\nkill test (workers={workers}): {len(duplicates)} duplicate batches of {len(seen)} "
        f"(the dead node consumed {len(dead)}, {in_flight} of them after its last "
        "completed progress write)"
    )
    assert len(duplicates) <= in_flight

    run = read_run(box)
    assert run.elastic and len(run.done) == len(units) and not run.orphaned
    taken = [claim for claim in run.claims if claim.learner != "node-0"]
    assert len(taken) == len(units) - sum(1 for c in run.claims if c.learner == "node-0")
    assert not list(box.list(WORK_PREFIX)), "every work record is gone once its unit is done"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("session_every", [None, 0.3], ids=["queue", "session"])
def test_a_run_with_a_long_lease_ends_with_its_last_unit(tmp_path, session_every):
    """Four nodes at speeds 1:2:2:4, ``resume=True`` and a 10-minute lease: every node process
    exits once every unit is done (none waits for a rescan a lease/2 later), and every batch is
    trained exactly once (with a Session: every sample is in the run's state)."""
    box = LocalMailbox(tmp_path / "box")
    units = named_units(24, steps=2)
    specs = [
        ElasticSpec(
            box,
            f"node-{rank}",
            units,
            str(tmp_path),
            train=train,
            prefetch=2,
            resume=True,
            lease_s=600.0,
            session_every=session_every,
        )
        for rank, train in enumerate((0.08, 0.04, 0.04, 0.02))
    ]
    run_elastic_nodes(specs, timeout=180)  # a hang bound: a node that waits a lease/2 is killed

    seen, _ = _seen(tmp_path)
    assert set(seen) == _expected(units) and set(seen.values()) == {1}, "a batch missed or trained twice"
    run = read_run(box)
    assert len(run.done) == len(units) and not run.released and not run.orphaned
    if session_every is not None:
        assert sum(consensus(box, torch.nn.Linear(8, 8)).values()) == len(seen)


def test_stop_four_nodes_halfway_and_resume_with_three(tmp_path):
    """Every step is consumed exactly once across both runs (clean exits flush and release)."""
    box = LocalMailbox(tmp_path / "box")
    units = named_units(32, steps=4)
    first = [
        ElasticSpec(
            box, f"node-{rank}", units, str(tmp_path), run=1, delay=0.002, prefetch=3, resume=True, stop_after=16
        )
        for rank in range(4)
    ]
    run_elastic_nodes(first)
    halfway = read_run(box)
    assert halfway.released, "stopped nodes release their unfinished units"
    assert not list(box.list(WORK_PREFIX))
    second = [
        ElasticSpec(box, f"node-{rank}", units, str(tmp_path), run=2, delay=0.002, prefetch=3, resume=True)
        for rank in range(3)
    ]
    run_elastic_nodes(second)

    seen, pairs = _seen(tmp_path)
    assert sum(len(p) for name, p in pairs.items() if name.endswith("-1")) == 64
    assert set(seen) == _expected(units)
    duplicates = sum(n - 1 for n in seen.values())
    print(
        f"\nresume test: {len(halfway.released)} units released at the stop, "
        f"{duplicates} duplicate batches of {len(seen)} across both runs"
    )
    assert duplicates == 0
    done = read_run(box)
    assert len(done.done) == len(units) and not done.released and not done.orphaned


def _drain_claimer(mailbox, order, learner) -> None:
    claimer = Claimer(mailbox, order, learner)
    while claimer.claim_next() is not None:
        pass


def test_with_resume_false_the_queue_is_the_design_notes(memory_mailbox, mailbox_factory, monkeypatch):
    """Same requests as the design note's claim protocol plus start-up and one count of the nodes near
    the end, and claims stay permanent."""
    monkeypatch.setattr("gradientmail.presence.RENEW_S", 3600.0)  # no renewal mid-test
    monkeypatch.setattr("gradientmail.queue.pacing.ALONE_GRACE_S", 3600.0)  # one count of the nodes
    units = named_units(40, steps=2)
    counted = CountingMailbox(memory_mailbox)
    with shared_queue(
        units,
        mailbox=counted,
        learner_id="node-0",
        load=RecordingLoad(str(mailbox_factory("local").path), "node-0"),
        workers=0,
        resume=False,
    ) as batches:
        assert len(list(batches)) == 80
    reference = CountingMailbox(mailbox_factory("memory", "reference"))
    _drain_claimer(reference, list(units), "node-0")
    startup = Counter(put_if_absent=3, get=1, delete=1)  # verify_mailbox (4) and run.json (1)
    # learners/node-0.json: registered (and read back, ``mailbox.confirmed``), then marked stopped
    presence = Counter(get_versioned=2, put_if_absent=1, get=1, replace_if=1)
    nodes = Counter(list=1)  # learners/: the endgame is near from the start (pacing.Endgame)
    assert counted.counts == reference.counts + startup + presence + nodes
    assert not [key for prefix in (WORK_PREFIX, DONE_PREFIX, LEASES_PREFIX) for key in memory_mailbox.list(prefix)]

    # A node that stops early keeps its claims: nobody else gets them.
    box = mailbox_factory("memory", "early")
    load = RecordingLoad(str(mailbox_factory("local").path), "x")
    with shared_queue(
        units, mailbox=box, learner_id="node-0", load=load, workers=0, prefetch=1, resume=False
    ) as batches:
        next(batches)
    claimed = list(box.list(CLAIMS_PREFIX))
    assert all(b"released" not in box.get(key) for key in claimed)
    with shared_queue(units, mailbox=box, learner_id="node-1", load=load, workers=0, resume=False) as batches:
        seen = {int(batch[0]) for _, batch in batches}
    assert len(seen) == len(units) - len(claimed)


def test_resume_and_lease_refuse_a_store_without_compare_and_swap(tmp_path):
    pytest.importorskip("fsspec")
    from gradientmail.mailbox.filesystem import FsspecMailbox

    box = FsspecMailbox.from_url((tmp_path / "fs").as_uri())
    units = named_units(3)
    load = RecordingLoad(str(tmp_path), "n")
    with pytest.raises(UnsafeStoreError, match="lease=.*compare-and-swap"):
        with shared_queue(units, mailbox=box, learner_id="n", load=load, lease=timedelta(seconds=30)):
            pass
    with pytest.raises(UnsafeStoreError, match="resume=True"):
        SharedQueueDataset(units, mailbox=box, learner_id="n", load=load, resume=True)
    assert not list(box.list(CLAIMS_PREFIX)), "refused before anything was claimed"


def test_state_dict_resumes_after_the_last_batch_yielded(memory_mailbox, tmp_path):
    """The torchdata Stateful protocol on the dataset itself, called as StatefulDataLoader would."""
    units = named_units(3, steps=5)
    load = RecordingLoad(str(tmp_path), "n")
    dataset = SharedQueueDataset(units, mailbox=memory_mailbox, learner_id="node-0", load=load, resume=False)
    iterator = iter(dataset)
    got = [next(iterator) for _ in range(3)]
    assert [step for step, _ in got] == [0, 1, 2]
    state = dataset.state_dict()
    assert state["learner_id"] == "node-0" and state["units"]["00000"]["step"] == 2
    del iterator  # the node stops

    restarted = SharedQueueDataset(units, mailbox=memory_mailbox, learner_id="node-0", load=load)
    restarted.load_state_dict(state)
    pairs = [(int(batch[0]), step) for step, batch in restarted]
    assert pairs[:2] == [(0, 3), (0, 4)], "unit 00000 continues after step 2"
    assert sorted(pairs[2:]) == [(i, s) for i in (1, 2) for s in range(5)]


def test_stateful_dataloader_if_installed(memory_mailbox, tmp_path):
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    units = named_units(2, steps=4)
    load = RecordingLoad(str(tmp_path), "n")
    dataset = SharedQueueDataset(units, mailbox=memory_mailbox, learner_id="node-0", load=load, resume=False)
    loader = stateful.StatefulDataLoader(dataset, batch_size=None, num_workers=0)
    iterator = iter(loader)
    for _ in range(2):
        next(iterator)
    state = loader.state_dict()
    again = stateful.StatefulDataLoader(
        SharedQueueDataset(units, mailbox=memory_mailbox, learner_id="node-0", load=load, resume=False),
        batch_size=None,
        num_workers=0,
    )
    again.load_state_dict(state)
    steps = [int(step) for step, _ in again]
    assert steps[:2] == [2, 3]


def test_resume_on_s3_continues_where_the_first_node_stopped(mailbox_factory, tmp_path):
    """The S3 path (If-Match on moto's server), in-process: stop after 5 batches, resume."""
    box = mailbox_factory("s3")
    units = named_units(4, steps=3)
    load = RecordingLoad(str(tmp_path), "n")
    got = []
    with shared_queue(
        units,
        mailbox=box,
        learner_id="node-0",
        load=load,
        workers=0,
        prefetch=2,
        resume=True,
        lease=timedelta(seconds=30),
    ) as batches:
        for step, batch in batches:
            got.append((int(batch[0]), step))
            if len(got) == 5:
                break
    assert read_run(box).released
    with shared_queue(
        units, mailbox=box, learner_id="node-1", load=load, workers=0, resume=True, lease=timedelta(seconds=30)
    ) as batches:
        got.extend((int(batch[0]), step) for step, batch in batches)
    assert sorted(got) == [(i, s) for i in range(4) for s in range(3)]
    run = read_run(box)
    assert len(run.done) == 4 and not run.released and not run.orphaned
