"""Helpers for the CLI tests: run ``python -m gradientmail`` as a user would, and write runs by
hand in the documented on-store formats (``gradientmail.layout``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

DESIGN_NOTE_SPEEDS = {"node-A": 1, "node-B": 2, "node-C": 2, "node-D": 4}
"""The design note's example: time units per unit of work; 24 units give A 11, B 5, C 5, D 3."""


def cli_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.pop("GRADIENTMAIL_DEBUG", None)
    env.update(extra)
    return env


def run_cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120, cwd: str | os.PathLike[str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``python -m gradientmail ARGS`` in a fresh process, output captured as text."""
    return subprocess.run(
        [sys.executable, "-m", "gradientmail", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env or cli_env(),
        cwd=cwd or REPO,
    )


_MEASURED = (
    "import resource, subprocess, sys; "
    "code = subprocess.call([sys.executable, '-m', 'gradientmail', *sys.argv[2:]]); "
    "open(sys.argv[1], 'w').write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)); "
    "sys.exit(code)"
)
"""Runs the command as its one child and writes down that child's max RSS (KiB on Linux)."""


def run_cli_measured(
    *args: str, env: dict[str, str] | None = None, cwd: str | os.PathLike[str] | None = None
) -> tuple[subprocess.CompletedProcess[str], int]:
    """``run_cli``, and the command's peak memory in bytes (its max RSS, as the kernel counted it).

    Measured from a small launcher process (``getrusage(RUSAGE_CHILDREN)`` after its one child):
    Linux counts into a process's max RSS the memory of the process that started it (``vfork``
    and ``exec``), so a child of this test process, hundreds of MB after many tests, would
    report at least that.
    """
    with tempfile.TemporaryDirectory() as folder:
        report = Path(folder, "maxrss")
        result = subprocess.run(
            [sys.executable, "-c", _MEASURED, str(report), *args],
            capture_output=True,
            text=True,
            timeout=120,
            env=env or cli_env(),
            cwd=cwd or REPO,
        )
        return result, int(report.read_text()) * 1024


def assert_user_error(result: subprocess.CompletedProcess[str], *fragments: str) -> None:
    """One line ``gradientmail: error: ...`` on stderr, exit 1, no traceback."""
    assert result.returncode == 1, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("gradientmail: error: "), result.stderr
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment.lower() in lines[0].lower(), (fragment, lines[0])


def write_documented_run(
    mailbox, *, t0: float = 1_700_000_000.0, units: int = 24, run_json: bool = True, progress: bool = True
) -> dict[str, int]:
    """The design note's schedule written as claims: each learner claims the next unit when ready.

    Returns the expected units per learner.
    """
    if run_json:
        mailbox.put_if_absent("run.json", json.dumps({"units": units, "created": t0}).encode())
    ready = dict.fromkeys(DESIGN_NOTE_SPEEDS, 0.0)
    counts = dict.fromkeys(DESIGN_NOTE_SPEEDS, 0)
    lanes = len(DESIGN_NOTE_SPEEDS)
    for index in range(units):
        identifier = f"{index // lanes:06d}-{index % lanes}.json"
        learner = min(ready, key=lambda name: (ready[name], name))
        body = {
            "learner": learner,
            "token": f"t{index}",
            "host": "host-1",
            "pid": 100,
            "worker": 0,
            "claimed_at": t0 + ready[learner],
        }
        assert mailbox.put_if_absent(f"units/{identifier}", json.dumps(body).encode())
        ready[learner] += DESIGN_NOTE_SPEEDS[learner]
        counts[learner] += 1
    if progress:
        for learner, seconds in ready.items():
            record = {
                "learner": learner,
                "steps": 20 * counts[learner],
                "samples": 640 * counts[learner],
                "samples_per_s": 640 / DESIGN_NOTE_SPEEDS[learner],
                "units": counts[learner],
                "started": t0,
                "last_seen": t0 + seconds,
                "finished": True,
            }
            mailbox.put(f"progress/{learner}.json", json.dumps(record).encode())
    return counts
