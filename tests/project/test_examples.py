"""The examples as a user runs them, in quick mode: examples/train_lm.py under torchrun (two processes,
one local mailbox), examples/train_shards.py as two processes over a bucket on moto's S3 server."""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from gradientmail import LocalMailbox

pytestmark = pytest.mark.slow  # every test here starts processes

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_lm.py"
SHARDS_EXAMPLE = EXAMPLE.with_name("train_shards.py")


def torchrun() -> list[str]:
    """The ``torchrun`` beside this Python (torch installs it), else its module."""
    found = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    return [found] if found else [sys.executable, "-m", "torch.distributed.run"]


def test_train_lm_quick_under_torchrun(tmp_path):
    command = [
        *torchrun(),
        "--standalone",
        "--nproc_per_node=2",
        str(EXAMPLE),
        "--quick",
        "--mailbox",
        str(tmp_path / "mailbox"),
        "--data-dir",
        str(tmp_path / "data"),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    match = re.search(r"validation loss (\S+) \(consensus of (\d+) learners", done.stdout)
    assert match, output[-4000:]
    assert math.isfinite(float(match.group(1))) and float(match.group(1)) < math.log(256) + 1
    assert re.search(r"\[node-0\] done", done.stdout) and re.search(r"\[node-1\] done", done.stdout)
    # --quick: 16 steps in units of 4, two lanes → 8 units, every one claimed exactly once.
    assert len(list(LocalMailbox(tmp_path / "mailbox").list("units/"))) == 8


def test_train_lm_quick_one_learner_per_machine(tmp_path):
    """--group: two "machines" (a torchrun each) of two processes, DDP inside, one learner each."""
    commands = [
        [
            *torchrun(),
            "--standalone",
            "--nproc_per_node=2",
            str(EXAMPLE),
            "--quick",
            "--group",
            "--machine",
            str(machine),
            "--machines",
            "2",
            "--mailbox",
            str(tmp_path / "mailbox"),
            "--data-dir",
            str(tmp_path / f"data-{machine}"),
        ]
        for machine in range(2)
    ]
    machines = [
        subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
        for command in commands
    ]
    try:
        outputs = [machine.communicate(timeout=240)[0] for machine in machines]
    finally:
        for machine in machines:
            if machine.poll() is None:
                machine.kill()
                machine.wait()
    for machine, output in zip(machines, outputs):
        assert machine.returncode == 0, output[-4000:]
    match = re.search(r"validation loss (\S+) \(consensus of (\d+) learners, (\S+) sequences", outputs[0])
    assert match, outputs[0][-4000:]
    assert math.isfinite(float(match.group(1))) and float(match.group(1)) < math.log(256) + 1
    assert match.group(2) == "2" and match.group(3) == "128"  # one learner per machine; 16 steps x 8, once
    # Only each machine's rank 0 reports; 16 steps in units of 4, one lane per machine: 8 units.
    assert [len(re.findall(r"\[node-\d\] done", output)) for output in outputs] == [1, 1]
    assert len(list(LocalMailbox(tmp_path / "mailbox").list("units/"))) == 8


def test_train_shards_quick_two_processes_over_a_bucket(tmp_path, s3_endpoint):
    """Two learners, one mailbox, Parquet shards in a bucket: rank 0 writes them, both train two
    epochs of the 90/10 mixture, and every (epoch, unit) is trained by exactly one of them."""
    data = f"s3://gm-shards-{uuid.uuid4().hex[:12]}/stdlib"
    env = {**os.environ, "AWS_ENDPOINT_URL": s3_endpoint}
    commands = [
        [
            sys.executable,
            str(SHARDS_EXAMPLE),
            "--quick",
            "--data",
            data,
            "--mailbox",
            str(tmp_path / "mailbox"),
            "--cache-dir",
            str(tmp_path / "cache"),
            "--rank",
            str(rank),
            "--world",
            "2",
        ]
        for rank in range(2)
    ]
    nodes = [
        subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path, env=env)
        for command in commands
    ]
    try:
        outputs = [node.communicate(timeout=240)[0] for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
                node.wait()
    for node, output in zip(nodes, outputs):
        assert node.returncode == 0, output[-4000:]
    trained = [re.search(r"\[node-\d\] units trained: (.*)", output).group(1).split() for output in outputs]
    # 9 lib files and 1 tests file of 64 rows, split in 32: 18 + 2 units a pass, 2 passes, 90/10.
    assert len(trained[0]) + len(trained[1]) == 40 and not set(trained[0]) & set(trained[1])
    everything = trained[0] + trained[1]
    assert sum("-lib/" in key for key in everything) == 36 and sum("-tests/" in key for key in everything) == 4
    assert {key.split("/")[1] for key in everything} == {"e0000", "e0001"}
    assert "every (epoch, unit) trained once: 40 units claimed once each, 1,280 rows in the model" in outputs[0]
    match = re.search(r"validation loss (\S+) \(consensus of 2 learners, 1,280 rows", outputs[0])
    assert match, outputs[0][-4000:]
    assert math.isfinite(float(match.group(1))) and float(match.group(1)) < math.log(256)
    assert len(list(LocalMailbox(tmp_path / "mailbox").list("units/"))) == 40
