"""Sharded groups: two "machines" of two processes each (gloo, FSDP2 on a CPU mesh inside).

Real processes on one ``LocalMailbox`` (node code: ``tests/helpers/fsdp_nodes.py``). Checked:
every step of every unit is trained by exactly one group; each rank reads and writes only the
fragments of its own shard; the run counts each group once, with the samples of all its ranks;
the run's model, loaded into a plain model or shard by shard, is its base plus every step that
any group trained (each step adds 1 to every parameter). A rank killed mid-run stops its group,
which restarts with ``resume=``: every shard holds every step exactly once.
"""

from __future__ import annotations

import json
import signal
import subprocess
import uuid
from pathlib import Path

import pytest
import torch
from process_harness import failures_of, free_port, kill_running, outputs_of, start_script

from gradientmail import LocalMailbox, consensus
from gradientmail.errors import MailRejectedError
from gradientmail.session.chain import run_cut

pytestmark = pytest.mark.slow  # every test here starts processes

NODE_SCRIPT = Path(__file__).resolve().parents[1] / "helpers" / "fsdp_nodes.py"
GROUPS, SIZE = 2, 2


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
                    "delay": 0.005 * (group + 1),  # unequal speeds
                    **options,
                }
            )
    processes = [start_script(NODE_SCRIPT, json.dumps(config)) for config in configs]
    outputs = outputs_of(processes, 120)
    failures = failures_of([f"group {c['group']} rank {c['rank']}" for c in configs], processes, outputs)
    assert not failures, "\n".join(failures)
    return [json.loads(Path(config["out"]).read_text()) for config in configs]


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("elastic", "store"),
    [(False, "local"), (True, "local"), (True, "seaweedfs")],
    ids=["design-note-queue", "elastic-queue", "elastic-seaweedfs"],
)
def test_two_sharded_groups_train_every_step_once_and_sum_exactly(tmp_path, elastic, store, request):
    import fsdp_nodes as nodes  # tests/helpers/ is on sys.path (tests/conftest.py)

    units = nodes.UNITS
    if store == "local":
        box, where = LocalMailbox(tmp_path / "mailbox"), {}
    else:
        from gradientmail.mailbox.s3 import S3Mailbox

        endpoint, bucket = request.getfixturevalue("seaweedfs_endpoint"), request.getfixturevalue("seaweedfs_bucket")
        prefix = f"t-{uuid.uuid4().hex[:12]}/run"
        box = S3Mailbox(bucket, prefix, endpoint_url=endpoint)
        where = {"s3": {"bucket": bucket, "prefix": prefix, "endpoint": endpoint}}
    results = run_groups(tmp_path, elastic=elastic, **where)
    assert all("group=" in result["refused"] for result in results)  # not without its group
    steps_of = {}
    for group in range(GROUPS):
        leader, follower = sorted((r for r in results if r["group"] == group), key=lambda r: r["rank"])
        assert follower["learner"] == leader["learner"] == f"machine-{group}"
        assert leader["trained"] == follower["trained"]  # lockstep
        assert leader["samples"] == follower["samples"] == nodes.BATCH * len(leader["trained"])
        steps_of[group] = leader["trained"]
        # Each rank reads and writes its own shard's fragments only (fragment r * F + j).
        per_shard = leader["fragments"]
        for result in (leader, follower):
            own = {f"{result['rank'] * per_shard + j:04d}" for j in range(per_shard)}
            assert result["touched"] and set(result["touched"]) <= own, (result["rank"], result["touched"])
    everything = sorted(steps_of[0] + steps_of[1])
    assert everything == list(range(units * nodes.UNIT_STEPS))  # every step once, by one group
    assert steps_of[0] and steps_of[1]
    assert any(result["merges"] for result in results)  # progress of the other group came in

    assert run_cut(box).shards == SIZE
    total = float(len(everything))
    # A plain model on one process: every shard's fragments, from the store.
    plain, base = nodes.build(), nodes.build()
    counted = consensus(box, plain)
    assert counted == {f"machine-{g}": nodes.BATCH * len(steps_of[g]) for g in range(GROUPS)}
    for name, tensor in plain.state_dict().items():
        torch.testing.assert_close(tensor, base.state_dict()[name] + total, rtol=0, atol=1e-4)
    # consensus into the sharded model, on each rank once every group left: its slice of the run's model.
    for result in results:
        assert result["loaded"] == counted  # the samples this rank's fragments hold: all of them
        for name, values in result["shard"].items():
            chunks = plain.state_dict()[name].chunk(SIZE)
            mine = chunks[result["rank"]] if result["rank"] < len(chunks) else plain.state_dict()[name][:0]
            torch.testing.assert_close(torch.tensor(values).reshape(mine.shape), mine, rtol=0, atol=0)


@pytest.mark.timeout(240)
def test_a_killed_rank_stops_its_group_which_restarts_with_nothing_lost(tmp_path):
    import fsdp_nodes as nodes

    def config(group: int, rank: int, port: int, out: str, **extra) -> dict:
        return {
            "group": group,
            "rank": rank,
            "size": SIZE,
            "ranks": GROUPS * SIZE,
            "port": port,
            "mailbox": str(tmp_path / "mailbox"),
            "out": str(tmp_path / out),
            "delay": 0.01,
            "elastic": True,
            **extra,
        }

    first = [free_port(), free_port()]
    configs = [
        config(0, 0, first[0], "dead-0.json"),
        config(0, 1, first[0], "dead-1.json", die_after=4),
        config(1, 0, first[1], "out-1-0.json"),
        config(1, 1, first[1], "out-1-1.json"),
    ]
    processes = [start_script(NODE_SCRIPT, json.dumps(c)) for c in configs]
    restarted: list[subprocess.Popen] = []
    try:
        [output] = outputs_of(processes[1:2], 120)
        assert processes[1].returncode == -signal.SIGKILL, output[-3000:]
        processes[0].kill()  # as torchrun stops the group when one of its processes fails
        outputs_of(processes[:1], 60)
        port = free_port()
        again = [config(0, rank, port, f"out-0-{rank}.json") for rank in range(SIZE)]
        restarted = [start_script(NODE_SCRIPT, json.dumps(c)) for c in again]
        waited = [*processes[2:], *restarted]
        outputs = outputs_of(waited, 150)
        failures = failures_of([settings["out"] for settings in [*configs[2:], *again]], waited, outputs)
        assert not failures, "\n".join(failures)
    finally:
        kill_running(processes + restarted)
    results = [json.loads((tmp_path / name).read_text()) for name in ("out-0-0.json", "out-0-1.json", "out-1-0.json")]
    dead = json.loads((tmp_path / "dead-1.json.trained").read_text())
    assert len(dead) == 4
    assert results[0]["trained"]  # the restarted group took its units back and trained them
    finished = results[0]["trained"] + results[2]["trained"]
    assert len(finished) == len(set(finished))  # the live incarnations trained no step twice
    assert sorted(set(finished + dead)) == list(range(nodes.UNITS * nodes.UNIT_STEPS))  # and none was skipped
    plain, base = nodes.build(), nodes.build()
    consensus(LocalMailbox(tmp_path / "mailbox"), plain)
    total = nodes.UNITS * nodes.UNIT_STEPS
    for name, tensor in plain.state_dict().items():
        # Every shard holds every step exactly once: the restarted group continues where its
        # queue's marks say, and a shard that already held some of the steps it trains again
        # does not fold them a second time.
        gained = tensor - base.state_dict()[name]
        assert float((gained - total).abs().max()) <= 1e-4, (name, (gained - total).tolist())


def test_a_sharded_run_refuses_a_plain_learner(tmp_path):
    """A Session with the run's model unsharded is refused, not mixed with the shards' cut."""
    from gradientmail import Session
    from gradientmail.session.chain import FragmentChain

    box = LocalMailbox(tmp_path / "mailbox")
    # Linear(2, 2) sharded over 2 ranks, 1 fragment each: shard r holds weight row r and bias[r].
    for shard in range(2):
        spec = {"weight": ((2,), None), "bias": ((1,), None)}
        FragmentChain(box, shard, 2, spec, shards=2).create_base(
            {"weight": torch.zeros(2), "bias": torch.zeros(1)}, "x"
        )
    with pytest.raises(MailRejectedError, match="shard"):
        with Session(torch.nn.Linear(2, 2), mailbox=box, learner_id="plain", fragments=2):
            pass
    assert consensus(box, torch.nn.Linear(2, 2)) == {}  # a plain model loads it whole


@pytest.mark.timeout(180)
def test_the_shard_step_benchmark_reports_its_figures():
    from benchmark_runs import finite, quick_run

    _, figures = quick_run("shard_step")
    assert all(finite(figures[name]) for name in ("train_step_s", "shard_step_s", "written_models_per_interval"))
    assert 0 < figures["written_models_per_interval"] < 1  # a shard's share, never the whole model
