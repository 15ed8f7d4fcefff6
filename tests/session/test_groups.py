"""Groups: two "machines" of two processes each (gloo, DDP inside), one learner per machine.

Real processes on one ``LocalMailbox`` (node code: ``tests/helpers/group_nodes.py``). Checked:
every step of every unit is trained by exactly one group, each rank of it on its own rows of
that step's batch; every rank of a group holds the same parameters after every step (so after
every merge); the run counts each group once, with the samples of all its ranks; the
consensus advances as one learner per group would make it; an error rank 0 finds is raised on
every rank at the same call; a killed rank stops its group with an error, and the group
restarted with ``resume=True`` loses nothing and doubles nothing in the run's model.
"""

from __future__ import annotations

import json
import signal
import subprocess
from collections import Counter
from pathlib import Path

import pytest
import torch
from process_harness import free_port, outputs_of, start_script  # tests/helpers/ (tests/conftest.py)

from gradientmail import LocalMailbox, consensus

pytestmark = pytest.mark.slow  # every test here starts processes

NODE_SCRIPT = Path(__file__).resolve().parents[1] / "helpers" / "group_nodes.py"
GROUPS, SIZE = 2, 2


def configs_of(tmp_path: Path, group: int, **options) -> list[dict]:
    """The ranks of one group, on a port of its own."""
    port = free_port()
    return [
        {
            "group": group,
            "rank": rank,
            "size": SIZE,
            "ranks": GROUPS * SIZE,
            "port": port,
            "mailbox": str(tmp_path / "mailbox"),
            "out": str(tmp_path / f"out-{group}-{rank}-{options.get('restart', 0)}.json"),
            "delay": 0.01 * (group + 1),  # unequal speeds
            **options,
        }
        for rank in range(SIZE)
    ]


def start(configs: list[dict]) -> list[subprocess.Popen]:
    return [start_script(NODE_SCRIPT, json.dumps(config)) for config in configs]


def finish(configs: list[dict], processes: list[subprocess.Popen], timeout: float = 120) -> list[dict]:
    """Every rank's result (``{"error": ...}`` for a rank that stopped on one); a hang fails."""
    outputs = outputs_of(processes, timeout)
    results = []
    for config, process, output in zip(configs, processes, outputs):
        path = Path(config["out"])
        if process.returncode == -signal.SIGKILL:  # killed: nothing to say
            results.append({**config, "exit": process.returncode, "output": output})
            continue
        assert path.exists(), f"group {config['group']} rank {config['rank']} left no result:\n{output[-4000:]}"
        results.append({**config, **json.loads(path.read_text()), "exit": process.returncode, "output": output})
    return results


def assert_clean(results: list[dict]) -> None:
    failures = [
        f"{r.get('group')}/{r.get('rank')} exited {r['exit']}: {r['output'][-4000:]}" for r in results if r["exit"]
    ]
    assert not failures, "\n".join(failures)


def run_groups(tmp_path: Path, **options) -> list[dict]:
    configs = [config for group in range(GROUPS) for config in configs_of(tmp_path, group, **options)]
    results = finish(configs, start(configs))
    assert_clean(results)
    return results


@pytest.mark.timeout(180)
@pytest.mark.parametrize("elastic", [False, True], ids=["design-note-queue", "elastic-queue"])
def test_two_groups_of_two_train_every_row_once_in_lockstep(tmp_path, elastic):
    assert_every_row_once_in_lockstep(tmp_path, run_groups(tmp_path, elastic=elastic))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("elastic", [False, True], ids=["design-note-queue", "elastic-queue"])
def test_a_group_s_ranks_iterate_the_dataset_in_their_own_dataloader_every_row_once(tmp_path, elastic):
    assert_every_row_once_in_lockstep(tmp_path, run_groups(tmp_path, elastic=elastic, dataset=True))


def test_a_group_s_dataset_in_dataloader_workers_is_refused_with_the_way_out(tmp_path):
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    from gradientmail.patterns.shared_queue import SharedQueueDataset

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        dataset = SharedQueueDataset(
            {"a": 0},
            mailbox=LocalMailbox(tmp_path / "mailbox"),
            learner_id="machine",
            load=load_one,
            group=dist.group.WORLD,
        )
        with pytest.raises(ValueError, match="iterated in the training process.*shared_queue"):
            next(iter(DataLoader(dataset, batch_size=None, num_workers=1)))
        assert [step for step, _ in DataLoader(dataset, batch_size=None, num_workers=0)] == [0]
    finally:
        dist.destroy_process_group()


def load_one(unit: int):
    yield 0, torch.zeros(2, 1)


def assert_every_row_once_in_lockstep(tmp_path: Path, results: list[dict]) -> None:
    import group_nodes as nodes  # tests/helpers/ is on sys.path (tests/conftest.py)

    by_group = {group: [r for r in results if r["group"] == group] for group in range(GROUPS)}
    steps_of = {}
    for group, ranks in by_group.items():
        leader, follower = sorted(ranks, key=lambda r: r["rank"])
        assert follower["learner"] == leader["learner"] == f"machine-{group}"
        # Lockstep: the same steps in the same order, each rank its own rows of the step's batch.
        assert [t[0] for t in leader["trained"]] == [t[0] for t in follower["trained"]]
        for mine, theirs in zip(leader["trained"], follower["trained"]):
            step = mine[0]
            assert sorted(mine[1:] + theirs[1:]) == list(range(step * nodes.BATCH, (step + 1) * nodes.BATCH))
            assert mine[1:] and theirs[1:]
        # The same parameters after every step, merges included, and at the end.
        assert leader["prints"] == follower["prints"]
        assert leader["final"] == follower["final"]
        assert leader["merges"] > 0  # the other group's progress came in, and reached both ranks
        assert leader["samples"] == follower["samples"] == nodes.BATCH * len(leader["trained"])
        steps_of[group] = [t[0] for t in leader["trained"]]
    # Exactly once across groups: every step of every unit, by one group.
    everything = sorted(steps_of[0] + steps_of[1])
    assert everything == list(range(nodes.UNITS * nodes.UNIT_STEPS))
    assert steps_of[0] and steps_of[1]
    # One learner per group, its samples counted once (every rank's share summed).
    counted = consensus(LocalMailbox(tmp_path / "mailbox"), torch.nn.Linear(nodes.DIM, 1))
    assert counted == {f"machine-{g}": nodes.BATCH * len(steps_of[g]) for g in range(GROUPS)}


@pytest.mark.timeout(120)
def test_the_consensus_advances_as_one_learner_per_group(tmp_path):
    """Every rank of a group adds 1 per step: the group is one learner of that many steps, so
    the consensus is the mean of the groups' steps (as with one process per group), exactly."""
    steps = {0: 12, 1: 20}  # unequal speeds
    configs = [c for g in range(GROUPS) for c in configs_of(tmp_path, g, mode="drag", steps=steps[g])]
    results = finish(configs, start(configs))
    assert_clean(results)
    for group in range(GROUPS):
        finals = {r["final"] for r in results if r["group"] == group}
        assert len(finals) == 1  # the ranks of a group hold one model
    model = torch.nn.Linear(1, 1, bias=False)
    counted = consensus(LocalMailbox(tmp_path / "mailbox"), model)
    assert counted == {f"machine-{g}": SIZE * steps[g] for g in range(GROUPS)}
    assert model.weight.item() == sum(steps.values()) / GROUPS  # drag 1.000: nothing lost, N = groups


@pytest.mark.timeout(120)
def test_wait_past_its_timeout_raises_on_every_rank_of_the_group(tmp_path):
    configs = configs_of(tmp_path, 0, mode="wait", latency=0.2)
    results = finish(configs, start(configs))
    assert_clean(results)
    for result in results:
        assert result["raised"].startswith("SessionError"), result["raised"]
        assert "did not finish within" in result["raised"]
    assert len({r["final"] for r in results}) == 1  # the exchange then landed on every rank alike


@pytest.mark.timeout(240)
def test_a_killed_rank_stops_its_group_which_restarts_with_nothing_lost_or_doubled(tmp_path):
    import group_nodes as nodes

    log = str(tmp_path / "trained-{group}.log")
    options = {"elastic": True, "timeout_s": 30}
    first = [
        {
            **config,
            "log": log.format(group=config["group"]),
            "kill_after": 5 if config["group"] == 0 and config["rank"] == 1 else None,
        }
        for group in range(GROUPS)
        for config in configs_of(tmp_path, group, **options)
    ]
    processes = start(first)
    killed = finish(first[:SIZE], processes[:SIZE], timeout=60)  # group 0: stops, no hang
    assert killed[1]["exit"] == -signal.SIGKILL
    survivor = killed[0]
    assert survivor["exit"] == 1, survivor["output"][-3000:]
    # Its collective failed: GroupError (in the step's word) or the backend's own (in DDP's backward).
    assert "GroupError" in survivor["error"] or "Connection closed by peer" in survivor["error"], survivor
    # The group restarts whole, as the same learner, and continues its units.
    again = configs_of(tmp_path, 0, restart=1, **options, log=log.format(group=0))
    results = finish(again + first[SIZE:], start(again) + processes[SIZE:], timeout=150)
    assert_clean(results)
    trained = Counter()
    for group in range(GROUPS):
        for line in Path(log.format(group=group)).read_text().splitlines():
            trained[int(line)] += 1
    steps = nodes.UNITS * nodes.UNIT_STEPS
    # Some steps the killed group trained but never folded were trained again after its restart.
    assert sorted(trained) == list(range(steps))
    counted = consensus(LocalMailbox(tmp_path / "mailbox"), torch.nn.Linear(nodes.DIM, 1))
    assert sum(counted.values()) == steps * nodes.BATCH  # every step in the model exactly once
    assert set(counted) == {"machine-0", "machine-1"}


@pytest.mark.timeout(120)
def test_a_rank_left_alone_raises_group_error_and_leaves(tmp_path):
    configs = configs_of(tmp_path, 0, mode="orphan", timeout_s=30)
    survivor, killed = finish(configs, start(configs), timeout=90)
    assert killed["exit"] == -signal.SIGKILL
    assert survivor["exit"] == 1
    assert survivor["error"].startswith("GroupError: rank 0 of a group of 2: the step's word"), survivor["error"]
    # It left the run as after a failed body: no member key of it remains.
    assert not list(LocalMailbox(tmp_path / "mailbox").list("session/members/"))


@pytest.mark.timeout(120)
def test_a_queue_refused_on_rank_0_raises_on_every_rank(tmp_path):
    from gradientmail.patterns.shared_queue import shared_queue

    box = LocalMailbox(tmp_path / "mailbox")
    with shared_queue(
        {"another-run": 0}, mailbox=box, learner_id="someone", load=lambda unit: [(0, torch.zeros(1))], workers=0
    ) as batches:
        assert len(list(batches)) == 1  # the prefix now holds a run of other units
    configs = configs_of(tmp_path, 0, ranks=SIZE)
    leader, follower = finish(configs, start(configs), timeout=90)
    assert leader["error"].startswith("RunMismatchError"), leader
    assert follower["error"].startswith("LoaderError"), follower
