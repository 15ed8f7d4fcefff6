"""The shared queue with real node processes sharing one mailbox (DataLoader workers included)."""

from __future__ import annotations

import json

import pytest
from queue_nodes import (
    NodeSpec,
    check_exactly_once,
    claims,
    consumed_by_learner,
    loads_per_unit,
    named_units,
    node_report,
    run_nodes,
)

from gradientmail import LocalMailbox, rotated_order, unit_grid
from gradientmail.layout import learner_key

pytestmark = [pytest.mark.timeout(150), pytest.mark.slow]  # every test here starts processes


@pytest.mark.timeout(120)
def test_documented_schedule_four_processes(tmp_path):
    """24 units, speeds 1:2:2:4: the shared queue ends at about t = 12 (a fixed split: 24)."""
    tick = 0.25
    mailbox = LocalMailbox(tmp_path / "box")
    units = unit_grid(steps=6, unit_steps=1, lanes=4)
    names = {unit.first * 4 + unit.lane: ident for ident, unit in units.items()}
    specs = [
        NodeSpec(
            mailbox,
            f"node-{rank}",
            units,
            str(tmp_path),
            delay=tick * time_per_unit,
            workers=0,
            prefetch=1,
            order=rotated_order(units, rank, 4),
            names=names,
        )
        for rank, time_per_unit in enumerate((1, 2, 2, 4))
    ]
    run_nodes(specs)
    by_learner = check_exactly_once(mailbox, tmp_path, units, lambda unit: [unit.first])
    counts = {learner: len(by_learner.get(learner, [])) for learner in ("node-0", "node-1", "node-2", "node-3")}
    reports = {learner: node_report(tmp_path, learner) for learner in counts}
    makespan = max(r["end"] for r in reports.values()) - min(r["start"] for r in reports.values())
    print(f"design-note schedule: units {counts}, makespan {makespan / tick:.2f} time units (ideal 12, fixed split 24)")
    # The design note: A 11, B and C 5, D 3. Which of A, B, C wins the last unit at t = 10 is a race.
    assert (
        counts["node-0"]
        > max(counts["node-1"], counts["node-2"])
        >= min(counts["node-1"], counts["node-2"])
        > counts["node-3"]
    )
    assert counts["node-3"] <= 4 < 6, "the slow node did less than its fixed share of 6"
    # Each node started on its own lane (rotation): its first claim is lane = rank.
    for rank, learner in enumerate(counts):
        first = min(by_learner[learner], key=lambda ident: claims(mailbox)[ident]["claimed_at"])
        assert units[first].lane == rank


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "options",
    [{"prefetch": 8, "workers": 1}, {"prefetch": 2, "workers": 0}],
    ids=["shared_queue-defaults", "workers0"],
)
def test_documented_schedule_with_one_batch_units_and_default_options(tmp_path, options):
    """The documented case with the units many users pick, one batch each, and the defaults:
    the fast node takes the most units and the slow one the fewest (each node's buffer could
    hold 8 of the 24 units; a node that filled it would keep units a faster node starts sooner)."""
    tick = 0.25
    mailbox = LocalMailbox(tmp_path / "box")
    units = unit_grid(steps=6, unit_steps=1, lanes=4)
    names = {unit.first * 4 + unit.lane: ident for ident, unit in units.items()}
    specs = [
        NodeSpec(mailbox, f"node-{rank}", units, str(tmp_path), step_time=tick * time_per_unit, names=names, **options)
        for rank, time_per_unit in enumerate((1, 2, 2, 4))
    ]
    run_nodes(specs)
    by_learner = check_exactly_once(mailbox, tmp_path, units, lambda unit: [unit.first])
    counts = [len(by_learner.get(f"node-{rank}", [])) for rank in range(4)]
    print(f"one-batch units, {options}: units per node {counts} (ideal 11/5/5/3)")
    assert counts[0] > max(counts[1], counts[2]) >= min(counts[1], counts[2]) > counts[3] >= 1, counts
    assert counts[0] >= 9 and counts[3] <= 4, counts


@pytest.mark.timeout(150)
def test_exactly_once_six_processes_two_workers_each(tmp_path):
    mailbox = LocalMailbox(tmp_path / "box")
    units = named_units(600, steps=3)
    specs = [
        NodeSpec(mailbox, f"node-{rank}", units, str(tmp_path), delay=0.0005, workers=2, prefetch=4)
        for rank in range(6)
    ]
    run_nodes(specs)
    by_learner = check_exactly_once(mailbox, tmp_path, units, lambda item: range(item.steps))
    assert len(by_learner) >= 2, "the test should make nodes compete"
    # Within a node, each unit's steps arrive in order even though two workers interleave.
    for pairs in consumed_by_learner(tmp_path).values():
        last: dict[str, int] = {}
        for ident, step in pairs:
            assert step == last.get(ident, -1) + 1
            last[ident] = step


@pytest.mark.timeout(150)
def test_exactly_once_on_s3(tmp_path, s3_target):
    """On moto, SeaweedFS and radosgw (real S3 implementations whose conditional writes are atomic)."""
    mailbox = s3_target.mailbox("runs/queue")
    lanes = 3
    units = unit_grid(steps=12, unit_steps=1, lanes=lanes)
    names = {unit.first * lanes + unit.lane: ident for ident, unit in units.items()}
    specs = [
        NodeSpec(
            mailbox,
            f"node-{rank}",
            units,
            str(tmp_path),
            delay=0.02,
            workers=1,
            prefetch=2,
            order=rotated_order(units, rank, lanes),
            names=names,
        )
        for rank in range(lanes)
    ]
    # This process may run moto's server thread: fork the nodes from a clean launcher.
    run_nodes(specs, isolated=True, timeout=100)
    # Exactly once is the point here. Which node got which lane depends on who started first,
    # which a loaded machine decides (lane preference is tested on the virtual clock instead:
    # test_claimer.py, test_claim_conflicts.py).
    check_exactly_once(mailbox, tmp_path, units, lambda unit: [unit.first])
    # A clean exit leaves each node's presence record "stopped" (a plain overwrite over S3).
    for spec in specs:
        assert json.loads(mailbox.get(learner_key(spec.learner)))["state"] == "stopped"


@pytest.mark.timeout(120)
def test_restarted_node_does_not_load_units_claimed_before(tmp_path):
    mailbox = LocalMailbox(tmp_path / "box")
    units = named_units(40, steps=2)
    first = tmp_path / "first"
    second = tmp_path / "second"
    first.mkdir()
    second.mkdir()
    # The design note's queue (resume=False); the default takes them back (tests/queue/test_restart.py).
    run_nodes([NodeSpec(mailbox, "node-0", units, str(first), workers=2, prefetch=4, stop_after=5, resume=False)])
    before = set(claims(mailbox))
    assert 3 <= len(before) < len(units)
    run_nodes([NodeSpec(mailbox, "node-0", units, str(second), workers=2, prefetch=4, resume=False)])
    loaded_again = set(loads_per_unit(second))
    assert not loaded_again & before, "the restarted node loaded units its earlier run had claimed"
    assert loaded_again | before == set(units)
    assert all(claim["learner"] == "node-0" for claim in claims(mailbox).values())
    consumed = {ident for ident, _ in consumed_by_learner(second)["node-0"]}
    assert consumed == loaded_again
