"""Node processes of the multi-process tests: started alike, awaited under one deadline, none left behind."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
"""The repository root: where node scripts run, as the suite itself does."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (a process group's rendezvous)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_script(script: Path, *args: str) -> subprocess.Popen[str]:
    """``python script *args`` from the repository root, its stdout and stderr read together as text."""
    return subprocess.Popen(
        [sys.executable, str(script), *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def outputs_of(processes: Sequence[subprocess.Popen[str]], timeout: float) -> list[str]:
    """Each process's output once it has ended, all within ``timeout`` seconds in all (each given
    at least one); whatever still runs when the wait ends, or fails, is killed and reaped, so that
    a hung node fails its test instead of outliving it."""
    deadline = time.monotonic() + timeout
    outputs = []
    try:
        for process in processes:
            outputs.append(process.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
    finally:
        kill_running(processes)
    return outputs


def kill_running(processes: Sequence[subprocess.Popen[str]]) -> None:
    """SIGKILL and reap every process of ``processes`` still running."""
    for process in processes:
        if process.poll() is None:
            process.kill()
            process.wait()


def failures_of(names: Sequence[str], processes: Sequence[subprocess.Popen[str]], outputs: Sequence[str]) -> list[str]:
    """``NAME exited CODE:`` and the end of its output, for each ended process whose code is not 0."""
    return [
        f"{name} exited {process.returncode}:\n{output[-4000:]}"
        for name, process, output in zip(names, processes, outputs)
        if process.returncode != 0
    ]


def join_all(processes: Sequence[Any], timeout: float) -> list[int | None]:
    """Wait up to ``timeout`` seconds in all for ``multiprocessing`` processes; kill (and reap)
    whatever is still alive, so that a hung node fails its test instead of outliving it. Returns
    the exit codes, in order."""
    deadline = time.monotonic() + timeout
    try:
        for process in processes:
            process.join(max(0.0, deadline - time.monotonic()))
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join()
    return [process.exitcode for process in processes]


def stop_gently(process: Any, sig: int, timeout: float) -> None:
    """Send ``sig`` to a ``subprocess.Popen`` still running, wait up to ``timeout`` seconds for
    it to end, then SIGKILL it if it lingers (servers started by the test harnesses)."""
    if process is None or process.poll() is not None:
        return
    process.send_signal(sig)
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
