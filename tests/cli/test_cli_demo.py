"""``gradientmail demo`` as a user runs it, with small settings: real node processes, the
documented loop (``shared_queue`` + ``Session``), on a directory and on S3 (moto's server).

No timing assertions: the makespans depend on the machine. What must hold whatever the speed:
every unit trained exactly once, the summary and the mailbox agree, the chart is a PNG.
"""

from __future__ import annotations

import json

import pytest
from cli_helpers import PNG_SIGNATURE, assert_user_error, cli_env, run_cli, write_documented_run

from gradientmail import LocalMailbox

pytestmark = pytest.mark.slow  # every test here starts processes

BATCH = 32  # samples per batch in the demo's nodes (gradientmail.cli.demo_node.BATCH)
SMALL = ["--nodes", "2", "--speeds", "1:3", "--units", "6", "--unit-steps", "2", "--batch-time", "0.03"]


def _assert_png(path) -> None:
    assert path.read_bytes().startswith(PNG_SIGNATURE)
    import matplotlib.image

    assert matplotlib.image.imread(path).ndim == 3


def _status(url: str, env=None) -> dict:
    result = run_cli("status", "--json", url, env=env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_demo_on_a_local_mailbox(tmp_path):
    out = tmp_path / "out"
    result = run_cli("demo", *SMALL, "--out", str(out), timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    for text in ("node-A", "node-B", "makespan", "fixed split", "loss", "gantt.png"):
        assert text in result.stdout, text

    summary = json.loads((out / "summary.json").read_text())
    nodes = {node["learner"]: node for node in summary["nodes"]}
    assert set(nodes) == {"node-A", "node-B"}
    assert sum(node["units"] for node in nodes.values()) == 6
    assert sum(node["samples"] for node in nodes.values()) == 6 * 2 * BATCH
    assert all(node["units_fixed_split"] == 3 for node in nodes.values())
    # The fixed split is computed from the speeds: B needs 3 units x 2 batches x 0.09 s.
    assert summary["fixed_split_s"] == pytest.approx(3 * 2 * 0.09)
    assert summary["ideal_shared_queue_s"] < summary["fixed_split_s"]
    assert summary["learners_averaged"] == 2
    assert summary["loss_consensus"] < summary["loss_initial"]
    _assert_png(out / "gantt.png")

    # The mailbox tells the same story to `status`, and `plot` can draw it.
    doc = _status(str(out / "mailbox"))
    assert doc["units_total"] == 6 and doc["units_claimed"] == 6
    rows = {row["learner"]: row for row in doc["learners"]}
    for learner, node in nodes.items():
        assert rows[learner]["units"] == node["units"]
        assert rows[learner]["samples"] == node["samples"]
        assert rows[learner]["finished"] is True
    plotted = run_cli("plot", str(out / "mailbox"), "-o", str(tmp_path / "claims.png"))
    assert plotted.returncode == 0, plotted.stderr
    _assert_png(tmp_path / "claims.png")


def test_demo_on_s3_with_a_slowdown(s3_endpoint, s3_bucket, tmp_path):
    url = f"s3://{s3_bucket}/demo"
    env = cli_env(AWS_ENDPOINT_URL=s3_endpoint)
    gantt = tmp_path / "charts" / "demo.png"
    result = run_cli(
        "demo",
        *SMALL,
        "--slowdown",
        "A:3",
        "--slowdown-at",
        "0.1",
        "--mailbox",
        url,
        "--out",
        str(tmp_path / "out"),
        "--gantt",
        str(gantt),
        "--summary",
        str(tmp_path / "summary.json"),
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["slowdown"] == {"learner": "node-A", "factor": 3.0, "at_s": 0.1}
    assert summary["mailbox"] == url
    assert sum(node["units"] for node in summary["nodes"]) == 6
    _assert_png(gantt)
    assert not (tmp_path / "out" / "mailbox").exists()  # the run lives in S3
    doc = _status(url, env=env)
    assert doc["units_claimed"] == doc["units_total"] == 6


def test_demo_refuses_a_mailbox_that_holds_a_run(tmp_path):
    write_documented_run(LocalMailbox(tmp_path / "used"))
    result = run_cli("demo", *SMALL, "--mailbox", str(tmp_path / "used"), "--out", str(tmp_path / "out"))
    assert_user_error(result, "already holds a run")


def test_demo_on_a_missing_bucket_is_an_error(s3_endpoint, tmp_path):
    result = run_cli(
        "demo",
        *SMALL,
        "--mailbox",
        "s3://gm-no-such-bucket-4711/demo",
        "--out",
        str(tmp_path / "out"),
        env=cli_env(AWS_ENDPOINT_URL=s3_endpoint),
    )
    assert_user_error(result, "bucket")


def test_a_failing_node_is_one_line(tmp_path):
    """A node that cannot start its Session (a bad setting) ends the demo with its reason."""
    env = cli_env(GRADIENTMAIL_SESSION_EVERY_S="soon")
    result = run_cli("demo", *SMALL, "--out", str(tmp_path / "out"), env=env, timeout=300)
    assert_user_error(result, "node-", "GRADIENTMAIL_SESSION_EVERY_S")
    assert (tmp_path / "out" / "logs").is_dir()


def test_simulated_schedules_are_the_design_notes():
    """The demo's ideal and fixed-split numbers: the design note's 11/5/5/3 at t=12 vs t=24."""
    from collections import Counter

    from gradientmail.cli.demo_plan import Plan, makespan, simulate

    plan = Plan(("A", "B", "C", "D"), (1.0, 2.0, 2.0, 4.0), units=24, unit_steps=4, batch_time=0.1)
    shared, fixed = simulate(plan, shared=True), simulate(plan, shared=False)
    assert Counter(span.learner for span in shared) == {"node-A": 11, "node-B": 5, "node-C": 5, "node-D": 3}
    assert Counter(span.learner for span in fixed) == dict.fromkeys(["node-A", "node-B", "node-C", "node-D"], 6)
    assert makespan(shared) == pytest.approx(12 * 0.4)
    assert makespan(fixed) == pytest.approx(24 * 0.4)
    assert sorted(span.unit for span in shared) == sorted(span.unit for span in fixed)
    # A slowed down 4x from t = 2.4 s: the others take over its share, the fixed split cannot.
    slowed = Plan(plan.names, plan.speeds, 24, 4, 0.1, slowdown=(0, 4.0, 2.4))
    assert makespan(simulate(slowed, shared=True)) < makespan(simulate(slowed, shared=False))
    assert Counter(s.learner for s in simulate(slowed, shared=True))["node-A"] < 11
