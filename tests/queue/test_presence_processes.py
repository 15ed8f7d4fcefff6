"""A paused learner that was replaced stops, and writes nothing more.

Real processes on one ``LocalMailbox``: process A (learner ``node-0``, ``resume=True``, a 2 s
lease, so presence renews every 0.5 s) consumes a few batches and is frozen with SIGSTOP;
process B, a replacement under the same learner id, is admitted once A's presence record has not
changed for three renewals, and takes A's units over. A is then resumed with SIGCONT: it must
stop with ``DuplicateLearnerError`` before taking another batch, and write nothing to the store
(no presence record, lease, progress record, claim or release); B finishes the run.

B registers as another host (``replaced_nodes._pretend_host``): on A's own machine a stopped
process is alive, and a replacement there is refused (``test_duplicate_learner``). Every wait
is on a condition the store or a node's files show, under one generous deadline; nothing is
timed.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import time
from collections import Counter
from pathlib import Path

import pytest
from handover_nodes import consumed, written_positions
from process_harness import join_all
from queue_nodes import named_units
from replaced_nodes import (
    REPLACED_EXIT,
    Replaceable,
    log_lines,
    outcome,
    start_replaceable,
    writes_begun_after,
    writes_in_flight,
)

from gradientmail import LocalMailbox
from gradientmail.layout import DONE_PREFIX, learner_key, lease_key
from gradientmail.mailbox.local import LOCK_DIR

pytestmark = pytest.mark.timeout(180)

UNITS, BATCHES = 5, 8  # batches per unit: A pauses inside its first unit, whose claim is all it holds
PAUSE_AFTER = 3
LEASE_S = 2.0
DEADLINE_S = 60.0
ALL = {(i, p) for i in range(UNITS) for p in range(BATCHES)}


def _wait(condition, what: str, processes=()) -> None:
    """Poll ``condition`` until it holds; fail after ``DEADLINE_S`` or when a node died."""
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        for process in processes:
            assert process.is_alive(), f"{process.name} exited ({process.exitcode}) before {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def _record(box: LocalMailbox, key: str) -> dict | None:
    data = box.get(key)
    return None if data is None else json.loads(data)


def _lease_counts(box: LocalMailbox, incarnation: str, batches: int) -> bool:
    """Whether the lease of ``incarnation`` says it consumed ``batches`` (its last heartbeat is
    written: none is due until it consumes another batch)."""
    lease = _record(box, lease_key("node-0"))
    return lease is not None and (lease["incarnation"], lease["consumed"]) == (incarnation, batches)


def _threads_stopped(pid: int) -> bool:
    """Whether every thread of ``pid`` is in the stopped state (SIGSTOP is delivered asynchronously)."""
    states = []
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        try:
            states.append(stat.read_text().rsplit(")", 1)[1].split()[0])
        except (OSError, IndexError):
            return False
    return bool(states) and all(state in ("T", "t") for state in states)


def _locks_held(box_dir: Path) -> list[str]:
    """The store's per-key lock files that some process holds (``replace_if`` in flight)."""
    held = []
    for path in (box_dir / LOCK_DIR).glob("*.lock"):
        fd = os.open(path, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            held.append(path.name)
        finally:
            os.close(fd)  # releases it
    return held


def _freeze(process, box_dir: Path, out: str, run: int) -> None:
    """SIGSTOP ``process`` at a moment none of its store calls is under way (its write log shows
    none begun and not answered) and it holds no lock of the store: a compare-and-swap frozen
    half-way would keep the replacement waiting on its lock, and a write frozen half-way would
    land after SIGCONT although it was decided before the pause."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        os.kill(process.pid, signal.SIGSTOP)
        _wait(lambda: _threads_stopped(process.pid), "the node to stop")
        if not writes_in_flight(out, run) and not _locks_held(box_dir):
            return
        os.kill(process.pid, signal.SIGCONT)
        assert time.monotonic() < deadline, "the node was always frozen inside a store call"


def _snapshot(box: LocalMailbox) -> dict[str, bytes]:
    return {key: box.get(key) for key in box.list("")}


def _with_incarnation(snapshot: dict[str, bytes | None], incarnation: str) -> dict[str, bytes]:
    return {key: data for key, data in snapshot.items() if data is not None and incarnation.encode() in data}


def test_a_paused_learner_replaced_meanwhile_stops_and_writes_nothing_more(tmp_path):
    box_dir = tmp_path / "box"
    box = LocalMailbox(box_dir)
    units = named_units(UNITS)
    labels = (0,) * BATCHES
    out = str(tmp_path)
    go_read, go_write = os.pipe()
    first = Replaceable(
        box, "node-0", units, out, run=1, lease_s=LEASE_S, labels=labels, pause_after=PAUSE_AFTER, go_fd=go_read
    )
    a = start_replaceable(first)
    b = None
    try:
        # A consumed PAUSE_AFTER batches, its records of the ones before are written and its
        # lease says so: nothing of A's is left to write but its presence renewals.
        _wait(lambda: (tmp_path / "paused-1.txt").exists(), "node A to pause", [a])
        presence = _record(box, learner_key("node-0"))
        incarnation_a = presence["incarnation"]
        _wait(lambda: _lease_counts(box, incarnation_a, PAUSE_AFTER - 1), "node A's lease to count its batches", [a])
        _freeze(a, box_dir, out, 1)
        frozen_log = log_lines(out, 1)
        frozen_store = _snapshot(box)
        consumed_by_a = consumed(tmp_path)[f"consumed-node-0-1-{a.pid}"]
        assert len(consumed_by_a) == PAUSE_AFTER

        # B, under the same learner id, is admitted once A's presence record stood still for
        # three renewals, takes A's unit over and trains.
        second = Replaceable(
            box, "node-0", units, out, run=2, lease_s=LEASE_S, labels=labels, train=0.02, host="replacement-host"
        )
        b = start_replaceable(second)
        _wait(lambda: len(consumed(tmp_path).get(f"consumed-node-0-2-{b.pid}", [])) >= 1, "node B to train", [b])
        presence = _record(box, learner_key("node-0"))
        assert presence["incarnation"] != incarnation_a and presence["host"] == "replacement-host"
        incarnation_b = presence["incarnation"]

        os.write(go_write, b"x")
        os.kill(a.pid, signal.SIGCONT)
        [code_a] = join_all([a], DEADLINE_S)
        [code_b] = join_all([b], DEADLINE_S)
    finally:
        for process in (a, b):
            if process is not None and process.is_alive():
                os.kill(process.pid, signal.SIGCONT)
                process.kill()
                process.join()
        os.close(go_read)
        os.close(go_write)

    # A stopped with DuplicateLearnerError before another batch, and wrote nothing after it
    # resumed: no presence record, lease, progress record, claim or release.
    said = outcome(out, 1)
    after = writes_begun_after(out, 1, frozen_log)
    a_did = f"node A exited with {code_a} ({said}) and wrote after it resumed: {after}"
    assert code_a == REPLACED_EXIT, a_did
    assert said[0] == "DuplicateLearnerError" and "was replaced by another process" in said[1], a_did
    assert consumed(tmp_path)[f"consumed-node-0-1-{a.pid}"] == consumed_by_a, "a batch reached A after it resumed"
    assert after == [], a_did
    final_store = _snapshot(box)
    for key, data in _with_incarnation(final_store, incarnation_a).items():
        assert frozen_store.get(key) == data, f"{key} of A's incarnation changed after A resumed"

    # B finished the run: its presence and lease records are its own, every unit is done once,
    # every batch was consumed, and B trained again only batches A consumed without a record.
    assert code_b == 0, f"node B exited with {code_b}: {outcome(out, 2)}"
    presence, lease = _record(box, learner_key("node-0")), _record(box, lease_key("node-0"))
    assert (presence["incarnation"], presence["state"]) == (incarnation_b, "stopped")
    assert (lease["incarnation"], lease["state"]) == (incarnation_b, "stopped")
    assert sorted(key[len(DONE_PREFIX) :] for key in box.list(DONE_PREFIX)) == sorted(units)
    by_b = consumed(tmp_path)[f"consumed-node-0-2-{b.pid}"]
    seen = Counter(consumed_by_a) + Counter(by_b)
    assert set(seen) == ALL, f"batches never consumed: {sorted(ALL - set(seen))}"
    assert max(Counter(by_b).values()) == 1, "B consumed a batch twice"
    recorded = written_positions(tmp_path, "node-0", run=1)
    again = {(index, position) for index, position in by_b if (index, position) in set(consumed_by_a)}
    assert all(position > recorded.get(index, -1) for index, position in again), (
        f"B trained again batches A had recorded: {sorted(again)} (A's records: {recorded})"
    )
