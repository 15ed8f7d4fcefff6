"""examples/train_lm.py as a user runs it: torchrun, two processes, one local mailbox (quick mode)."""

from __future__ import annotations

import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gradientmail import LocalMailbox

pytestmark = pytest.mark.slow  # every test here starts processes

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_lm.py"


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
