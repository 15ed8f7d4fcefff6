"""Node processes for the test of a paused learner that was replaced.

A ``Replaceable`` node runs ``shared_queue`` (``resume=True``, a short lease) over
``handover_nodes.LabelledLoad`` units and leaves everything it did in files in ``out_dir``, one
``open``/``write`` per line, so that a process frozen by SIGSTOP or killed loses nothing done:

- ``consumed-{learner}-{run}-{pid}.txt``: ``index position step`` per batch its loop received
  (the format of ``handover_nodes.consumed``);
- ``written-{learner}-{run}.txt``: ``identifier position`` per progress record written
  (``elastic_nodes.ProgressLog``; read by ``handover_nodes.written_positions``);
- ``writes-{run}.txt``: per write to the store (``WriteLog``), ``begin n operation key`` before
  it and ``end n changed`` once the store answered (``changed`` 0: a compare-and-swap that lost,
  which writes nothing);
- ``paused-{run}.txt``: written once the node has consumed ``pause_after`` batches and waited for
  its records to be written; the node then waits for a byte on the pipe ``go_fd``;
- ``outcome-{run}.txt``: ``done``, or the error that ended the loop (class name, then message).

A node ended by ``DuplicateLearnerError`` exits with ``REPLACED_EXIT``.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import select
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from elastic_nodes import ProgressLog  # tests/helpers/ is on sys.path (tests/conftest.py)
from handover_nodes import LabelledLoad

from gradientmail import DuplicateLearnerError
from gradientmail.mailbox.wrappers import MailboxWrapper
from gradientmail.patterns.shared_queue import shared_queue

REPLACED_EXIT = 3
"""The exit code of a node stopped by ``DuplicateLearnerError``."""


def _append(path: Path, line: str) -> None:
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(line + "\n")


class WriteLog(MailboxWrapper):
    """Logs every write (``put``, ``put_if_absent``, ``replace_if``, ``delete``) to ``path``, one
    line before it (``begin n operation key``) and one after the store answered (``end n
    changed``), so that a test can tell a write started after some moment from one that was
    under way then."""

    def __init__(self, inner: Any, path: str) -> None:
        super().__init__(inner)
        self.path = path
        self._numbers = itertools.count()

    def __reduce__(self):
        return (WriteLog, (self.inner, self.path))

    def _logged(self, operation: str, key: str, write: Callable[[], Any]) -> Any:
        number = next(self._numbers)
        _append(Path(self.path), f"begin {number} {operation} {key}")
        result = write()
        _append(Path(self.path), f"end {number} {int(result is not False)}")
        return result

    def put(self, key: str, data: bytes) -> None:
        self._logged("put", key, lambda: super(WriteLog, self).put(key, data))

    def put_if_absent(self, key: str, data: bytes) -> bool:
        return self._logged("put_if_absent", key, lambda: super(WriteLog, self).put_if_absent(key, data))

    def replace_if(self, key: str, data: bytes, version: str) -> bool:
        return self._logged("replace_if", key, lambda: super(WriteLog, self).replace_if(key, data, version))

    def delete(self, key: str) -> None:
        self._logged("delete", key, lambda: super(WriteLog, self).delete(key))


@dataclass
class Replaceable:
    mailbox: Any
    learner: str
    units: dict[str, Any]
    out_dir: str
    run: int
    lease_s: float
    labels: tuple[int, ...] = (0,) * 6
    train: float = 0.0  # seconds per batch consumed
    prefetch: int = 2
    pause_after: int | None = None
    go_fd: int | None = None  # the read end of a pipe: a byte on it ends the pause
    host: str | None = None  # register the presence record as this host (another machine)


def run_replaceable(node: Replaceable) -> None:
    out = Path(node.out_dir)
    if node.host is not None:
        _pretend_host(node.host)
    pid = os.getpid()
    consumed = out / f"consumed-{node.learner}-{node.run}-{pid}.txt"
    progress = ProgressLog(node.mailbox, node.out_dir, node.learner, field="position", run=node.run)
    mailbox = WriteLog(progress, str(out / f"writes-{node.run}.txt"))
    received = 0
    try:
        with shared_queue(
            node.units,
            mailbox=mailbox,
            learner_id=node.learner,
            load=LabelledLoad(node.labels),
            prefetch=node.prefetch,
            workers=0,
            resume=True,
            lease=timedelta(seconds=node.lease_s),
        ) as batches:
            for step, batch in batches:
                index, position = (int(v) for v in batch)
                assert step == node.labels[position], "the label travels with its batch"
                _append(consumed, f"{index} {position} {step}")
                if node.train:
                    time.sleep(node.train)
                received += 1
                if received == node.pause_after:
                    batches.tracker.flush()  # every record of the batches before this one written
                    _append(out / f"paused-{node.run}.txt", str(pid))
                    assert node.go_fd is not None
                    ready, _, _ = select.select([node.go_fd], [], [], 120)
                    assert ready, "the test never let the node go on"
                    os.read(node.go_fd, 1)
    except DuplicateLearnerError as exc:
        _append(out / f"outcome-{node.run}.txt", f"{type(exc).__name__}\n{exc}")
        raise SystemExit(REPLACED_EXIT) from None
    except BaseException as exc:
        _append(out / f"outcome-{node.run}.txt", f"{type(exc).__name__}\n{exc}")
        raise
    _append(out / f"outcome-{node.run}.txt", "done")


def _pretend_host(host: str) -> None:
    """Make this process's presence records name another host: a replacement started on another
    machine, which cannot see whether the first process still runs and judges its record by
    whether it changes (the same machine would find a stopped process alive and refuse)."""
    from gradientmail import presence

    real = presence.machine()
    presence.machine = lambda: {**real, "host": host}


def start_replaceable(node: Replaceable) -> Any:
    """Fork one node process."""
    process = multiprocessing.get_context("fork").Process(
        target=run_replaceable, args=(node,), name=f"{node.learner}-{node.run}"
    )
    process.start()
    return process


def outcome(out_dir: str | Path, run: int) -> list[str]:
    """The lines of ``outcome-{run}.txt`` ([] when the node wrote none)."""
    path = Path(out_dir) / f"outcome-{run}.txt"
    return path.read_text().splitlines() if path.exists() else []


def writes_begun_after(out_dir: str | Path, run: int, lines: int) -> list[str]:
    """``operation key`` of each write of incarnation ``run`` that changed the store and began
    after the first ``lines`` lines of its log (see ``log_lines``)."""
    path = Path(out_dir) / f"writes-{run}.txt"
    entries = [line.split() for line in path.read_text().splitlines()] if path.exists() else []
    begun = {fields[1]: " ".join(fields[2:]) for fields in entries[lines:] if fields[0] == "begin"}
    changed = {fields[1] for fields in entries if fields[0] == "end" and fields[2] == "1"}
    return [write for number, write in begun.items() if number in changed]


def log_lines(out_dir: str | Path, run: int) -> int:
    """How many lines the write log of incarnation ``run`` has now."""
    path = Path(out_dir) / f"writes-{run}.txt"
    return len(path.read_text().splitlines()) if path.exists() else 0


def writes_in_flight(out_dir: str | Path, run: int) -> list[str]:
    """``operation key`` of each write of incarnation ``run`` begun and not yet answered."""
    path = Path(out_dir) / f"writes-{run}.txt"
    entries = [line.split() for line in path.read_text().splitlines()] if path.exists() else []
    ended = {fields[1] for fields in entries if fields[0] == "end"}
    return [" ".join(fields[2:]) for fields in entries if fields[0] == "begin" and fields[1] not in ended]
