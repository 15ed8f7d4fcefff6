"""A default learner id: unique per process across machines, stable across
restarts of a process slot, used when ``learner_id`` is omitted.

``f"node-{rank}"`` repeats on every machine that runs its own launcher: the second machine's
processes would wait, then be refused, or get in after the first finished and overwrite its
progress record. The default is the host name plus the launcher's rank.
"""

from __future__ import annotations

import multiprocessing
import socket
import zlib

import pytest
import torch

from gradientmail import LocalMailbox, Session, SharedQueueDataset, consensus, default_learner_id
from gradientmail.learner_id import ENV_LEARNER_ID, RANK_VARIABLES
from gradientmail.patterns.shared_queue import shared_queue
from gradientmail.status import read_run


@pytest.fixture
def launcher(monkeypatch):
    """No launcher variables, host ``gpu-box``: each test sets what its launcher would."""
    for name in (ENV_LEARNER_ID, *RANK_VARIABLES):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(socket, "gethostname", lambda: "gpu-box")
    return monkeypatch


def test_host_name_plus_the_launcher_s_rank(launcher):
    assert default_learner_id() == "gpu-box-0"  # no launcher: one process per machine
    launcher.setenv("SLURM_PROCID", "5")
    assert default_learner_id() == "gpu-box-5"
    launcher.setenv("RANK", "3")  # torchrun's, read first
    assert default_learner_id() == "gpu-box-3"
    launcher.setenv(ENV_LEARNER_ID, "trainer-a")  # explicit wins
    assert default_learner_id() == "trainer-a"


def test_a_host_name_becomes_one_safe_key_segment(launcher):
    launcher.setattr(socket, "gethostname", lambda: "node 7/rack:2")
    assert default_learner_id() == f"node-7-rack-2.{zlib.crc32(b'node 7/rack:2'):08x}-0"
    launcher.setattr(socket, "gethostname", lambda: "")
    assert default_learner_id() == "host-0"


def test_host_names_that_differ_only_in_unsafe_characters_stay_two_learners(launcher):
    ids = set()
    for host in ("gpu+1", "gpu 1", "gpu-1"):
        launcher.setattr(socket, "gethostname", lambda host=host: host)
        ids.add(default_learner_id())
    assert len(ids) == 3 and "gpu-1-0" in ids, ids


def test_omitted_learner_ids_take_the_default(launcher, memory_mailbox):
    launcher.setenv("RANK", "2")
    units = {"u": 1}
    dataset = SharedQueueDataset(units, mailbox=memory_mailbox, load=lambda unit: iter(()))
    session = Session(torch.nn.Linear(2, 1), mailbox=memory_mailbox, every=None, every_steps=1)
    assert dataset.learner_id == session.learner_id == "gpu-box-2"


def _machine(box_path: str, host: str, units: dict, out: str) -> None:
    """A process on "another machine" (its own host name), rank 0 like every machine's first
    process under its own torchrun; the documented loop with learner ids omitted."""
    import os

    os.environ["RANK"] = "0"
    os.environ.pop(ENV_LEARNER_ID, None)
    socket.gethostname = lambda: host
    box = LocalMailbox(box_path)
    model = torch.nn.Linear(2, 1)
    with (
        Session(model, mailbox=box, every=None, every_steps=2) as session,
        shared_queue(units, mailbox=box, load=_load, workers=0, resume=True) as batches,
    ):
        with open(out, "w", encoding="ascii") as log:
            for step, _ in batches:
                log.write(f"{session.learner_id} {step}\n")
                session.step(samples=1)


def _load(count: int):
    for step in range(count):
        yield step, torch.zeros(2)


@pytest.mark.timeout(90)
def test_two_machines_with_the_same_rank_run_side_by_side(tmp_path):
    """Two processes, rank 0 each, on two host names: two learners, every batch once."""
    units = {f"u{i}": 3 for i in range(8)}
    context = multiprocessing.get_context("fork")
    box = str(tmp_path / "box")
    hosts = ["machine-a", "machine-b"]
    processes = [
        context.Process(target=_machine, args=(box, host, units, str(tmp_path / f"{host}.txt"))) for host in hosts
    ]
    for process in processes:
        process.start()
    for process in processes:
        process.join(60)
    assert [p.exitcode for p in processes] == [0, 0]
    run = read_run(LocalMailbox(box))
    assert len(run.done) == len(units)
    samples = consensus(LocalMailbox(box), torch.nn.Linear(2, 1))
    assert set(samples) <= {"machine-a-0", "machine-b-0"}
    assert sum(samples.values()) == sum(units.values())
