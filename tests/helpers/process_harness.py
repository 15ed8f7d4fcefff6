"""Joining node processes in the multi-process tests: one deadline for all, nothing left behind."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Sequence
from typing import Any


def join_all(processes: Sequence[Any], timeout: float) -> list[int | None]:
    """Wait up to ``timeout`` seconds in all; kill (and reap) whatever is still alive, so that a
    hung node fails its test instead of outliving it. Returns the exit codes, in order."""
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
