"""Restarting a learner: under the defaults it takes its own unfinished units back at the exact
batch; where it cannot (the design note's queue), it says so; a resume that cannot know what an
earlier run trained refuses; ``status`` shows units claimed and never finished, by learner."""

from __future__ import annotations

import subprocess
import sys
import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch
from elastic_nodes import ElasticSpec, consumed_pairs, run_elastic_nodes
from queue_nodes import RecordingLoad, named_units

from gradientmail import LocalMailbox, UnfinishedUnitsWarning, UntrackedClaimsError, consensus
from gradientmail.cli.commands import unfinished_notes
from gradientmail.layout import WORK_PREFIX
from gradientmail.patterns.shared_queue import shared_queue
from gradientmail.status import read_run

HELPERS = Path(__file__).resolve().parents[1] / "helpers"


def _expected(units) -> set[tuple[str, int]]:
    return {(ident, step) for ident, item in units.items() for step in range(item.steps)}


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_node_killed_under_the_defaults_takes_its_units_back_on_restart(tmp_path):
    """The documented loop with the defaults (no resume=, no lease=), two node processes and a
    Session: SIGKILL one mid-run, restart it under the same learner id after the other finished:
    every batch is in the run's model once, and nothing is left unfinished."""
    box = LocalMailbox(tmp_path / "box")
    units = named_units(16, steps=4)
    first = [
        ElasticSpec(
            box,
            f"node-{rank}",
            units,
            str(tmp_path),
            train=0.01,
            prefetch=2,
            resume=None,
            session_every=0.2,
            kill_after=9 if rank == 1 else None,
        )
        for rank in range(2)
    ]
    run_elastic_nodes(first, killed={"node-1"})
    left = read_run(box)
    assert left.unfinished.get("node-1"), "the killed node's units are shown as claimed and not finished"

    again = ElasticSpec(
        box, "node-1", units, str(tmp_path), run=2, train=0.01, prefetch=2, resume=None, session_every=0.2
    )
    run_elastic_nodes([again])

    seen: Counter[tuple[str, int]] = Counter()
    for pairs in consumed_pairs(tmp_path).values():
        seen.update(pairs)
    assert set(seen) == _expected(units), "a batch was never trained"
    assert sum(consensus(box, torch.nn.Linear(8, 8)).values()) == len(_expected(units))
    run = read_run(box)
    assert len(run.done) == len(units) and not run.unfinished and not list(box.list(WORK_PREFIX))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_bare_dataloader_restart_warns_about_the_units_it_cannot_take_back(tmp_path):
    """``DataLoader(SharedQueueDataset(...), num_workers=1)`` cannot see the loop, so it runs the
    design note's queue; a restart under the same id says which units its killed run left."""
    root, out = tmp_path / "box", tmp_path / "consumed.txt"
    script = [sys.executable, str(HELPERS / "restart_nodes.py"), str(root), "node-0", "8", "4", str(out)]
    killed = subprocess.run([*script, "5"], capture_output=True, text=True, timeout=60)
    assert killed.returncode == -9, killed.stderr
    left = read_run(LocalMailbox(root))
    assert left.unfinished.get("node-0")
    restarted = subprocess.run(script, capture_output=True, text=True, timeout=60)
    assert restarted.returncode == 0, restarted.stderr
    assert "UnfinishedUnitsWarning" in restarted.stderr
    assert f"{len(left.unfinished['node-0'])} unit(s) claimed by an earlier run" in restarted.stderr
    assert "learner 'node-0'" in restarted.stderr


def test_resume_on_a_run_begun_by_the_design_note_s_queue_refuses(tmp_path):
    """Its claims record no progress: resume=True (or the default) would train every unit again."""
    box = LocalMailbox(tmp_path / "box")
    units = named_units(6, steps=2)
    load = RecordingLoad(str(tmp_path), "node-0")
    with shared_queue(units, mailbox=box, learner_id="node-0", load=load, workers=0, resume=False) as batches:
        assert len(list(batches)) == 12
    for resume in (True, None):
        with pytest.raises(UntrackedClaimsError, match="resume=False") as caught:
            with shared_queue(units, mailbox=box, learner_id="node-0", load=load, workers=0, resume=resume) as batches:
                list(batches)
        assert "fresh prefix" in str(caught.value)
    # Stopped mid-run: its unfinished units' records lead to the same refusal.
    box = LocalMailbox(tmp_path / "half")
    with shared_queue(units, mailbox=box, learner_id="node-0", load=load, workers=0, resume=False) as batches:
        next(batches)
    with pytest.raises(UntrackedClaimsError):
        with shared_queue(units, mailbox=box, learner_id="node-0", load=load, workers=0, resume=True) as batches:
            list(batches)


def test_status_lists_units_claimed_and_not_finished_by_learner(tmp_path):
    """With the default, stopped early (the design note's queue under the default: the
    DataLoader test above)."""
    units = named_units(6, steps=3)
    load = RecordingLoad(str(tmp_path), "x")
    for name, resume in (("default", None),):
        box = LocalMailbox(tmp_path / name)
        with shared_queue(
            units, mailbox=box, learner_id="node-0", load=load, workers=0, prefetch=1, resume=resume
        ) as b:
            next(b)
        with shared_queue(units, mailbox=box, learner_id="node-1", load=load, workers=0, resume=resume) as b:
            list(b)
        run = read_run(box)
        assert run.unfinished == {"node-0": ["00000"]}, name
        assert run.learner("node-0").unfinished == 1 and run.learner("node-1").unfinished is None
        assert run.to_dict()["unfinished"] == {"node-0": ["00000"]}
        assert unfinished_notes(run) == ["claimed and not finished by node-0: 1 unit(s) (00000)"]


def test_a_node_with_nothing_left_warns_about_a_dead_learner_s_units(tmp_path):
    """A learner restarted under another id (another host), no lease: the node that runs out of
    units says who holds the rest and how to get them trained."""
    box = LocalMailbox(tmp_path / "box")
    units = named_units(8, steps=2)
    dead = ElasticSpec(box, "old-host-0", units, str(tmp_path), prefetch=1, resume=None, kill_after=3)
    run_elastic_nodes([dead], killed={"old-host-0"})
    before = read_run(box)
    mine = [claim.identifier for claim in before.claims if claim.learner == "old-host-0"]
    held = len(set(mine) - set(before.done))
    assert held
    load = RecordingLoad(str(tmp_path), "new-host-0")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with shared_queue(units, mailbox=box, learner_id="new-host-0", load=load, workers=0) as batches:
            trained = len(list(batches))
    assert trained == 2 * (len(units) - len(mine))
    messages = [str(w.message) for w in caught if issubclass(w.category, UnfinishedUnitsWarning)]
    assert len(messages) == 1, [str(w.message) for w in caught]
    assert f"learner 'old-host-0' holds {held} unfinished unit(s)" in messages[0]
    assert "lease=" in messages[0] and "restarts" in messages[0]


def test_resume_false_warns_when_the_previous_run_did_not_leave_cleanly(tmp_path):
    """The design note's queue records no unit, but the presence record tells a crash."""
    box = LocalMailbox(tmp_path / "box")
    units = named_units(8, steps=2)
    run_elastic_nodes(
        [ElasticSpec(box, "node-0", units, str(tmp_path), prefetch=1, resume=False, kill_after=3)], killed={"node-0"}
    )
    load = RecordingLoad(str(tmp_path), "node-0")
    with pytest.warns(UnfinishedUnitsWarning, match="did not leave cleanly"):
        with shared_queue(units, mailbox=box, learner_id="node-0", load=load, workers=0, resume=False) as batches:
            list(batches)
    with warnings.catch_warnings():  # a clean exit: nothing to say on the next start
        warnings.simplefilter("error", UnfinishedUnitsWarning)
        with shared_queue(units, mailbox=box, learner_id="node-0", load=load, workers=0, resume=False) as batches:
            list(batches)
