"""Groups: two "machines" of two processes each (gloo, DDP inside), one learner per machine.

Real processes on one ``LocalMailbox`` (node code: ``tests/helpers/group_nodes.py``). Checked:
every step of every unit is trained by exactly one group, each rank of it on its own rows of
that step's batch; every rank of a group holds the same parameters after every step (so after
every merge); the run counts each group once, with the samples of all its ranks.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gradientmail import LocalMailbox, consensus

pytestmark = pytest.mark.slow  # every test here starts processes

NODE_SCRIPT = Path(__file__).resolve().parents[1] / "helpers" / "group_nodes.py"
ROOT = NODE_SCRIPT.parents[2]
GROUPS, SIZE = 2, 2


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_groups(tmp_path: Path, **options) -> list[dict]:
    configs = []
    for group in range(GROUPS):
        port = free_port()
        for rank in range(SIZE):
            configs.append(
                {
                    "group": group,
                    "rank": rank,
                    "size": SIZE,
                    "ranks": GROUPS * SIZE,
                    "port": port,
                    "mailbox": str(tmp_path / "mailbox"),
                    "out": str(tmp_path / f"out-{group}-{rank}.json"),
                    "delay": 0.01 * (group + 1),  # unequal speeds
                    **options,
                }
            )
    processes = [
        subprocess.Popen(
            [sys.executable, str(NODE_SCRIPT), json.dumps(config)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for config in configs
    ]
    failures = []
    try:
        for config, process in zip(configs, processes):
            output, _ = process.communicate(timeout=120)
            if process.returncode != 0:
                failures.append(
                    f"group {config['group']} rank {config['rank']} exited {process.returncode}:\n{output[-4000:]}"
                )
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    assert not failures, "\n".join(failures)
    return [json.loads(Path(config["out"]).read_text()) for config in configs]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("elastic", [False, True], ids=["seed-queue", "elastic-queue"])
def test_two_groups_of_two_train_every_row_once_in_lockstep(tmp_path, elastic):
    import group_nodes as nodes  # tests/helpers/ is on sys.path (tests/conftest.py)

    results = run_groups(tmp_path, elastic=elastic)
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
