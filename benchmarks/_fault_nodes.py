"""The node processes of ``benchmarks.faults`` and what each fault kind installs in its victim.

Everything here runs in a node process (forked by the benchmark): the documented loop, and the
per-node fault set up before it starts: a wall clock off by minutes (``clock``), a store 100 ms
away (``slow``, ``DelayedMailbox``), one request that fails like a store past its retries
(``transient``, ``FlakyMailbox``). Nothing is installed in the parent or in the other nodes.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

UNITS, STEPS = 24, 6

LEASE_LOST_EXIT = 3
"""A node's exit code after ``LeaseLostError`` (it found its units taken over on resuming)."""
STOPPED_EXIT = 4
"""A node's exit code after the injected transient error surfaced (it stops; it is restarted)."""
DUPLICATE_EXIT = 5
"""The intruder's exit code when its Session was refused (``DuplicateLearnerError``)."""
INTRUDER_STEPS = 6
"""What the intruder trains if its Session is admitted: 6 samples the dataset does not have."""
HELD, RELEASED = "held-{learner}", "intruder-done"
"""Files in the trial's directory: the victim stands still inside its loop (its Session and
queue live) from ``HELD`` until the parent writes ``RELEASED``."""

TARGETS: dict[str, tuple[frozenset[str], str]] = {
    "list versions": (frozenset({"list"}), r"session/fragments/#/versions/"),
    "read version": (frozenset({"get"}), r"session/fragments/#/versions/.+"),
    "read pending": (frozenset({"get"}), r"session/fragments/#/pending/.+"),
    "create version": (frozenset({"put_if_absent"}), r"session/fragments/#/versions/.+"),
    "tombstone": (frozenset({"put"}), r"session/fragments/#/versions/.+"),
    "progress record": (frozenset({"put"}), r"progress/.+"),
    "work record": (frozenset({"put"}), r"work/.+"),
    "lease": (frozenset({"put", "put_if_absent", "replace_if"}), r"leases/.+"),
    "list pending": (frozenset({"list"}), r"session/fragments/#/pending/"),
    "create pending": (frozenset({"put_if_absent"}), r"session/fragments/#/pending/.+"),
    "delete (session)": (frozenset({"delete"}), r"session/.+"),
    "list members": (frozenset({"list"}), r"session/members/"),
    "claim": (frozenset({"put_if_absent"}), r"units/.+"),
    "claim read": (frozenset({"get", "get_versioned"}), r"units/.+"),
    "done record": (frozenset({"put_if_absent"}), r"done/.+"),
    "work delete": (frozenset({"delete"}), r"work/.+"),
    "any": (frozenset(), r".*"),
}
"""Which request a ``transient`` trial fails, by name: the first request after batch N whose
operation is one of these and whose key (digits as ``#``) matches; ``any``: the k-th request of
any kind. An odd count, so that alternating landed / not landed covers both for each target."""
READS = frozenset({"get", "get_versioned", "list"})
ANY_NTH = (1, 12)
"""``any``: the failing request is the k-th after batch N, k drawn from this range."""


@dataclass(frozen=True)
class Transient:
    """One injected transient error: on the ``nth`` request matching ``target`` after ``after``
    batches; ``landed``: the request reached the store (a write took effect) and its answer was
    lost, else it never reached the store."""

    after: int
    target: str
    nth: int
    landed: bool


@dataclass(frozen=True)
class NodeSpec:
    box: str  # a LocalMailbox directory, or s3://bucket/prefix
    endpoint: str | None  # the S3 endpoint of an s3:// box
    learner: str
    out: str
    run: int
    kill_after: int | None
    lease_s: float | None  # None: shared_queue's defaults (no resume=, no lease=)
    every_s: float
    fragments: int
    train_s: float
    clock_offset_s: float = 0.0
    latency_s: float = 0.0
    transient: Transient | None = None
    gate: int = 0  # wait, inside the loop's with block, until this many nodes stand there
    hold_after: int | None = None  # stand still after this many batches until RELEASED exists
    intruder: bool = False  # a second process under this learner id: a Session alone


def open_box(box: str, endpoint: str | None) -> Any:
    """The trial's store: a ``LocalMailbox`` or an ``S3Mailbox`` under ``s3://bucket/prefix``."""
    if box.startswith("s3://"):
        from gradientmail.mailbox.s3 import S3Mailbox

        bucket, _, prefix = box[len("s3://") :].partition("/")
        return S3Mailbox(bucket, prefix, endpoint_url=endpoint)
    from gradientmail import LocalMailbox

    return LocalMailbox(box)


def shape(key: str) -> str:
    """A key with its digits as ``#``: ``session/fragments/0001/versions/000000000003.safetensors``
    is ``session/fragments/#/versions/#.safetensors``."""
    return re.sub(r"\d+", "#", key)


def make_flaky(inner: Any, plan: Transient, report: Path) -> Any:
    """``FlakyMailbox`` (defined here so that the library is imported after the clock patch)."""
    from gradientmail import MailboxError
    from gradientmail.mailbox.base import describe
    from gradientmail.mailbox.wrappers import MailboxWrapper

    class FlakyMailbox(MailboxWrapper):
        """Fails one request as a store past its retries would (``MailboxError``), once armed."""

        def __init__(self) -> None:
            super().__init__(inner)
            self.armed = False
            self.fired = ""
            self._seen = 0
            self._lock = threading.Lock()
            operations, pattern = TARGETS[plan.target]
            self._operations = operations
            self._pattern = re.compile(pattern)

        def arm(self) -> None:
            self.armed = True

        def _due(self, operation: str, key: str) -> bool:
            if not self.armed or self.fired:
                return False
            if self._operations and operation not in self._operations:
                return False
            if not self._pattern.fullmatch(shape(key)):
                return False
            with self._lock:
                if self.fired:
                    return False
                self._seen += 1
                if self._seen < plan.nth:
                    return False
                self.fired = f"{operation} {shape(key)}"
            where = threading.current_thread().name
            how = "read failed" if operation in READS else "landed" if plan.landed else "not sent"
            report.write_text(f"{how}\t{self.fired}\t{where}\n")
            return True

        def _error(self, operation: str, key: str) -> Exception:
            landed = plan.landed and operation not in READS
            what = "the request took effect, its answer was lost" if landed else "no answer"
            return MailboxError(
                f"{describe(inner)}: {operation}({key!r}) failed after 9 attempts over 120.0s: "
                f"injected transient fault ({what})",
                operation=operation,
                key=key,
                store=describe(inner),
            )

        def _call(self, operation: str, key: str, request: Callable[[], Any]) -> Any:
            due = self._due(operation, key)
            if due and not plan.landed:
                raise self._error(operation, key)
            result = request()
            if due:
                raise self._error(operation, key)
            return result

        def put_if_absent(self, key: str, data: bytes) -> bool:
            return self._call("put_if_absent", key, lambda: inner.put_if_absent(key, data))

        def get(self, key: str, *, max_bytes: int | None = None) -> bytes | None:
            return self._call("get", key, lambda: inner.get(key, max_bytes=max_bytes))

        def put(self, key: str, data: bytes) -> None:
            self._call("put", key, lambda: inner.put(key, data))

        def delete(self, key: str) -> None:
            self._call("delete", key, lambda: inner.delete(key))

        def get_versioned(self, key: str, *, max_bytes: int | None = None) -> tuple[bytes, str] | None:
            versioned = self._versioned()
            return self._call("get_versioned", key, lambda: versioned.get_versioned(key, max_bytes=max_bytes))

        def replace_if(self, key: str, data: bytes, version: str) -> bool:
            versioned = self._versioned()
            return self._call("replace_if", key, lambda: versioned.replace_if(key, data, version))

        def list(self, prefix: str = "", start_after: str | None = None) -> Iterator[str]:
            if self._due("list", prefix):  # a listing changes nothing: landed or not, it fails
                raise self._error("list", prefix)
            return inner.list(prefix, start_after)

    return FlakyMailbox()


def skew_clock(offset_s: float, host_suffix: str) -> None:
    """This process's wall clock runs ``offset_s`` off (``time.time``, ``time.time_ns``), and it
    names its host differently, so that its presence record is judged as another machine's (by
    times on the store, not by its PID). The library reads ``time.time()`` through the module,
    so the patch reaches it; the monotonic clock, which leases are judged on, is left alone."""
    real_time, real_time_ns, real_host = time.time, time.time_ns, socket.gethostname
    time.time = lambda: real_time() + offset_s  # type: ignore[assignment]
    time.time_ns = lambda: real_time_ns() + int(offset_s * 1e9)  # type: ignore[assignment]
    socket.gethostname = lambda: real_host() + host_suffix  # type: ignore[assignment]
    # Caches a forked parent may have filled, and a default bound at import (``Presence(wall=)``).
    from gradientmail import presence
    from gradientmail.mailbox import local_temp

    presence.machine.cache_clear()
    local_temp.host_token.cache_clear()
    defaults = presence.Presence.__init__.__kwdefaults__
    if defaults is not None and "wall" in defaults:
        defaults["wall"] = time.time


def node(spec: NodeSpec) -> None:
    """The documented loop; appends ``unit step`` per batch received to its own file."""
    if spec.clock_offset_s:
        skew_clock(spec.clock_offset_s, f"-skewed-{spec.run}")
    if spec.intruder:
        intrude(spec)
        return
    import torch

    from gradientmail import LeaseLostError, Session
    from gradientmail.mailbox.wrappers import DelayedMailbox

    warnings.filterwarnings("ignore", message="shared_queue: 0 batches")  # a restart with nothing left
    torch.set_num_threads(1)
    box = open_box(spec.box, spec.endpoint)
    if spec.latency_s:
        box = DelayedMailbox(box, spec.latency_s)
    flaky = None
    if spec.transient is not None:
        flaky = box = make_flaky(box, spec.transient, Path(spec.out) / f"fault-{spec.learner}-{spec.run}.txt")
    model = torch.nn.Linear(4, 4)
    session = Session(
        model, mailbox=box, learner_id=spec.learner, every=timedelta(seconds=spec.every_s), fragments=spec.fragments
    )
    units = {f"{i:04d}": f"{i:04d}" for i in range(UNITS)}
    try:
        train(spec, box, model, session, units, flaky)
    except LeaseLostError:  # frozen past its lease, its units taken over: it stops (and is restarted)
        sys.exit(LEASE_LOST_EXIT)
    except Exception as exc:
        if flaky is None or not flaky.fired:
            raise
        # The injected error surfaced: the node stops, as it would on a store past its retries.
        path = Path(spec.out) / f"stopped-{spec.learner}-{spec.run}.txt"
        path.write_text(f"{type(exc).__name__}: {exc}"[:400] + "\n")
        sys.exit(STOPPED_EXIT)


def train(spec: NodeSpec, box: Any, model: Any, session: Any, units: dict[str, str], flaky: Any) -> None:
    import torch

    from gradientmail.patterns.shared_queue import shared_queue

    received = 0
    with (
        open(Path(spec.out) / f"consumed-{spec.learner}-{spec.run}.txt", "a", encoding="ascii") as log,
        session,
        shared_queue(
            units,
            mailbox=box,
            learner_id=spec.learner,
            load=load_unit,
            workers=0,
            resume=None if spec.lease_s is None else True,
            lease=None if spec.lease_s is None else timedelta(seconds=spec.lease_s),
        ) as batches,
    ):
        if spec.gate:
            wait_at_gate(Path(spec.out), spec.learner, spec.gate)
        for step, batch in batches:
            log.write(f"{int(batch[0])} {step}\n")
            log.flush()  # a SIGKILL loses nothing this loop did
            time.sleep(spec.train_s)
            with torch.no_grad():
                model.weight.add_(1.0)
            session.step(samples=1)
            received += 1
            if received == spec.hold_after:
                hold(Path(spec.out), spec.learner)
            if spec.kill_after is not None and received >= spec.kill_after:
                os.kill(os.getpid(), signal.SIGKILL)
            if flaky is not None and received == spec.transient.after:
                flaky.arm()


def hold(out: Path, learner: str, timeout_s: float = 60.0) -> None:
    """Stand still inside the loop, alive (the Session and the queue renew their records), while
    the parent starts an intruder under this learner id and waits for it to end."""
    (out / HELD.format(learner=learner)).touch()
    deadline = time.monotonic() + timeout_s
    while not (out / RELEASED).exists() and time.monotonic() < deadline:
        time.sleep(0.005)


def intrude(spec: NodeSpec) -> None:
    """A second process starting a Session under a live learner's id (the same script started
    twice): it must be refused before it writes anything. Admitted, it would fold
    ``INTRUDER_STEPS`` samples the dataset does not have under the live learner's name."""
    import torch

    from gradientmail import DuplicateLearnerError, Session

    torch.set_num_threads(1)
    box = open_box(spec.box, spec.endpoint)
    model = torch.nn.Linear(4, 4)
    session = Session(
        model, mailbox=box, learner_id=spec.learner, every=timedelta(seconds=spec.every_s), fragments=spec.fragments
    )
    try:
        with session:
            for _ in range(INTRUDER_STEPS):
                with torch.no_grad():
                    model.weight.add_(1.0)
                session.step(samples=1)
    except DuplicateLearnerError as exc:
        (Path(spec.out) / f"refused-{spec.learner}.txt").write_text(f"{exc}"[:400] + "\n")
        sys.exit(DUPLICATE_EXIT)


def wait_at_gate(out: Path, learner: str, count: int, timeout_s: float = 60.0) -> None:
    """The nodes start training together: a node that joins slowly (a distant one) still gets its
    share, rather than finding the units gone before it has joined."""
    (out / f"ready-{learner}").touch()
    deadline = time.monotonic() + timeout_s
    while len(list(out.glob("ready-*"))) < count and time.monotonic() < deadline:
        time.sleep(0.005)


def load_unit(identifier: str):
    import torch

    index = int(identifier)
    for step in range(STEPS):
        yield step, torch.tensor([index, step])
