"""Running a benchmark script's quick mode the way CI does, and reading the JSON line it ends with."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def quick_run(script: str, *extra: str, timeout: float = 180) -> tuple[list[str], dict[str, object]]:
    """``python -m benchmarks.{script} --quick {extra}`` from the repository root: its stdout lines
    and the figures of its last line (a JSON object); fails the test on a non-zero exit."""
    completed = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{script}", "--quick", *extra],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    lines = completed.stdout.strip().splitlines()
    assert lines, completed.stderr[-3000:]
    figures = json.loads(lines[-1])
    assert isinstance(figures, dict), lines[-1]
    return lines, figures


def finite(value: object) -> bool:
    """A real number that is not a bool, NaN or infinite (a list: every item such a number)."""
    values = value if isinstance(value, list) else [value]
    return bool(values) and all(
        isinstance(item, (int, float)) and not isinstance(item, bool) and math.isfinite(item) for item in values
    )
