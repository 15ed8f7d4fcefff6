"""Leaving a group's Session and queue leaves nothing that holds its process group: the
``dist.destroy_process_group()`` right after the ``with`` block destroys it then and there,
even while the loop's variables (the session, the batches, the dataset) are still alive.

(A process group that outlives ``destroy_process_group`` dies at interpreter exit, where gloo
can abort the process.) One process forms a gloo group of one: the collectives run for real.
"""

from __future__ import annotations

import gc
import subprocess
import weakref

import pytest
import torch
from torch.utils.data import DataLoader

from gradientmail import LocalMailbox, Session
from gradientmail.errors import GroupError
from gradientmail.patterns.shared_queue import SharedQueueDataset, shared_queue
from gradientmail.session.group import GroupSync


def load_unit(unit: int):
    for step in range(2):
        yield unit * 2 + step, torch.full((2, 1), float(step))


def test_nothing_of_a_group_s_session_or_queue_keeps_its_process_group_alive(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        group = dist.group.WORLD
        box = LocalMailbox(tmp_path / "mailbox")
        model = torch.nn.Linear(1, 1)
        units = {"a": 0, "b": 1}
        with (
            Session(model, mailbox=box, learner_id="machine", group=group) as session,
            shared_queue(units, mailbox=box, learner_id="machine", load=load_unit, workers=0, group=group) as batches,
        ):
            for _step, batch in batches:
                session.step(samples=len(batch))
        dataset = SharedQueueDataset(units, mailbox=LocalMailbox(tmp_path / "other"), load=load_unit, group=group)
        assert len(list(DataLoader(dataset, batch_size=None, num_workers=0))) == 4
        alive = weakref.ref(group)
        del group
    finally:
        dist.destroy_process_group()
    gc.collect()
    assert session.samples == 8 and batches is not None and dataset is not None  # all still held here
    assert alive() is None, [type(holder).__name__ for holder in gc.get_referrers(alive())]


def test_a_group_destroyed_under_a_session_is_named_as_such(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    sync = GroupSync(dist.group.WORLD)
    dist.destroy_process_group()
    gc.collect()
    with pytest.raises(GroupError, match="process group was destroyed while a Session or queue of it"):
        sync.announce([0])


@pytest.mark.slow  # two processes, many groups
def test_a_group_learner_exits_when_its_ddp_model_outlives_the_process_group(tmp_path):
    """Gloo's worker thread lets go of a finished collective just after the waiting rank moves
    on; a DDP model freed after ``destroy_process_group()`` joins that thread holding the GIL.
    Were the thread's reference the last one to a collective of the Session's, it would need the
    GIL to free its tensors and both would wait forever (without the fix, most runs of these
    rounds hang within the first few dozen)."""
    from process_harness import ROOT, failures_of, outputs_of, start_script

    rounds = 30
    script = ROOT / "tests" / "helpers" / "teardown_nodes.py"
    processes = [start_script(script, str(rank), str(tmp_path), str(rounds)) for rank in range(2)]
    try:
        outputs = outputs_of(processes, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail(f"a rank still ran after 120 s: a group learner hung at teardown ({rounds} rounds)")
    assert not failures_of(["rank 0", "rank 1"], processes, outputs)
    assert all(f"done {rounds}" in output for output in outputs), outputs
