"""One live process per learner id: the presence record ``learners/{learner_id}.json``.

A ``Session`` and a ``shared_queue`` (or a ``SharedQueueDataset`` iterated in the training
process) register their learner before they write anything, and refuse to start, with
``DuplicateLearnerError``, while another process runs it: two processes under one id would take
each other's units and fold their progress as one learner's. The record is one per learner and
process: the Session and the queue of one process share it (``PresenceShare``). The first to
start registers (``Presence``), the other joins that registration, the last to close marks the
record stopped; a second Session, or a second queue, of the same learner in one process is
refused. A share finds its process's registration through the record itself (it names the
incarnation and the pid that wrote it), never by a name of the store. One read and one write at
start, one write every ``renew_s``, one of each at exit; a restart after a crash is allowed.
Details: docs/queue.md ("One process per learner").
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import threading
import time
import uuid
import warnings
from collections.abc import Callable
from typing import Any

from gradientmail.errors import DuplicateLearnerError, RecordError
from gradientmail.layout import learner_key
from gradientmail.learner_id import ENV_LEARNER_ID, RANK_VARIABLES, default_learner_id
from gradientmail.mailbox.base import Mailbox, supports_replace_if
from gradientmail.mailbox.confirmed import create_confirmed, replace_confirmed
from gradientmail.records import RUNNING, STOPPED, PresenceRecord, get_record, get_record_versioned
from gradientmail.verdict import LIVE, Sightings, judge_lease

__all__ = [
    "HOLDERS",
    "QUEUE",
    "RENEW_S",
    "SESSION",
    "WINDOW_RENEWALS",
    "Presence",
    "PresenceShare",
    "machine",
    "presence_renew_s",
    "presence_window_s",
    "process_gone",
]

RENEW_S = 10.0
"""Seconds between renewals of a presence record (a quarter of the lease if that is shorter)."""

WINDOW_RENEWALS = 3
"""A record from another machine that did not change for this many of its writer's renewal
intervals (on the reader's clock) belongs to a dead process."""

ATTEMPTS = 5
"""Registration attempts when the record keeps changing under a compare-and-swap."""

SESSION, QUEUE = "Session", "queue"
"""The two kinds of holder that share a learner's presence record in one process."""

HOLDERS = {
    SESSION: "a Session",
    QUEUE: "a shared_queue (or a SharedQueueDataset iterated in this process)",
}
"""How an error message names an open holder of each kind."""


_log = logging.getLogger(__name__)
_OPEN: dict[str, Presence] = {}  # this process's registrations not closed, by incarnation
_OPEN_LOCK = threading.Lock()


def presence_renew_s(lease_s: float | None) -> float:
    """The renewal interval: ``RENEW_S``, or a quarter of the lease when that is shorter."""
    return RENEW_S if lease_s is None else min(RENEW_S, lease_s / 4)


def presence_window_s(record: PresenceRecord) -> float:
    """How long ``record`` may stand unchanged while its writer lives: ``WINDOW_RENEWALS`` of the
    renewal interval it names (bounded, so that a forged interval cannot keep a ghost alive)."""
    renew = record.renew_s
    renew = min(max(renew, 0.01), RENEW_S) if renew is not None else RENEW_S
    return WINDOW_RENEWALS * renew


# -- who this process is -----------------------------------------------------------------------
def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as handle:
            return handle.read().strip()
    except OSError:
        return None


@functools.cache
def machine() -> dict[str, Any]:
    """Host name, boot id and PID namespace: equal for two processes that can see each other."""
    try:
        namespace: str | None = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = None
    return {"host": socket.gethostname(), "boot": _read("/proc/sys/kernel/random/boot_id"), "pidns": namespace}


def _process_state(pid: int) -> tuple[str, int] | None:
    """``(state, start time in clock ticks since boot)`` of ``pid`` from ``/proc``; None: no such
    process or no ``/proc``."""
    stat = _read(f"/proc/{pid}/stat")
    if not stat or ")" not in stat:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    try:
        return fields[0], int(fields[19])  # fields 3 and 22 of proc(5)
    except (IndexError, ValueError):
        return None


def _process_start(pid: int) -> int | None:
    state = _process_state(pid)
    return None if state is None else state[1]


def _alive(pid: int, start: int | None) -> bool:
    """Whether process ``pid`` (started at ``start``, when known) still runs on this machine."""
    if os.path.isdir("/proc/self"):
        state = _process_state(pid)
        if state is None or state[0] in ("Z", "X"):  # gone, or killed and not yet reaped
            return False
        return start is None or state[1] == start  # another start time: the PID was reused
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    except OSError:
        return False
    return True


# -- records -----------------------------------------------------------------------------------
def _body(learner_id: str, incarnation: str, state: str, beat: int, renew_s: float) -> bytes:
    pid = os.getpid()
    record = PresenceRecord.new(
        learner_id, incarnation, state, beat, renew_s, machine(), pid=pid, pid_start=_process_start(pid)
    )
    return record.to_bytes()


def _parse(key: str, data: bytes | RecordError | None) -> PresenceRecord | None:
    """A presence record, or None (with a warning when the record is unreadable: ``data`` is
    then its bytes, or the ``RecordError`` it was refused unread with)."""
    if data is None:
        return None
    if isinstance(data, RecordError):
        error, size = data, ""
    else:
        try:
            return PresenceRecord.from_bytes(data, key)
        except RecordError as exc:
            error, size = exc, f" ({len(data)} bytes)"
    warnings.warn(
        f"gradientmail: the presence record {key!r}{size} is not one this "
        f"library wrote ({error}); ignoring it (it is overwritten)",
        stacklevel=4,
    )
    return None


def _same_machine(record: PresenceRecord) -> bool:
    return all(record.get(name) == value for name, value in machine().items())


# -- the record's owner ------------------------------------------------------------------------
def process_gone(record: PresenceRecord) -> bool:
    """Whether ``record`` names a process of this machine that no longer runs (a peer's own
    verdict at once; another machine's record is judged by its age instead)."""
    return _same_machine(record) and not _alive(record.pid, record.pid_start)


class Presence:
    """Registers one incarnation of ``learner_id`` in ``mailbox`` and keeps it renewed.

    ``start`` raises ``DuplicateLearnerError`` when another incarnation is alive (see the
    module docstring), else writes the record and renews it every ``renew_s`` on a daemon
    thread; ``close`` marks it stopped. The holders that share it (``PresenceShare``) ``join``
    and ``leave`` it; the last to leave closes it. ``clock``/``sleep`` (monotonic) and ``wall``
    (Unix time) are injectable for tests.
    """

    def __init__(
        self,
        mailbox: Mailbox,
        learner_id: str,
        incarnation: str,
        *,
        renew_s: float = RENEW_S,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.mailbox = mailbox
        self.learner_id = learner_id
        self.incarnation = incarnation
        self.renew_s = renew_s
        self.key = learner_key(learner_id)
        self._clock, self._sleep, self._wall = clock, sleep, wall
        self._versioned = supports_replace_if(mailbox)
        self._beat = 0
        self._stop = threading.Event()
        self._wake = threading.Event()  # set to renew now (``hasten``, ``close``)
        self._thread: threading.Thread | None = None
        self._holders: list[str] = []  # the kinds sharing it (``PresenceShare``)
        self._closed = False
        self._warned = False
        self._lock = threading.Lock()  # one renewal at a time (the thread, or ``check``)
        self._renewed_at = clock()
        self._checked_at = -float("inf")  # the training thread's last ownership check
        self._replaced: DuplicateLearnerError | None = None
        self.previous: PresenceRecord | None = None
        """The record of another incarnation ``register`` found and replaced (None: none):
        whether this learner's previous run left cleanly."""

    # -- public ------------------------------------------------------------------------------
    def start(self) -> None:
        """Register, or raise ``DuplicateLearnerError`` if another incarnation is alive."""
        self.register()

    def register(self, *, share: bool = False) -> Presence:
        """Register this incarnation and return it, or raise ``DuplicateLearnerError`` if another
        incarnation is alive.

        ``share``: when the record names a registration of this very process that is still open
        (its learner's Session or queue started first), return that one and write nothing.
        """
        for _ in range(ATTEMPTS):
            data, version = self._get()
            record = _parse(self.key, data)
            if record is not None and record.incarnation != self.incarnation:
                here = _open_here(record) if share else None
                if here is not None:
                    return here
                judged = self._judge(record, data)
                if judged is not None:
                    raise self._duplicate(judged)
                self.previous = record
            with _OPEN_LOCK:  # open before the write: a registrant here that reads it finds it
                _OPEN[self.incarnation] = self
            written = False
            try:
                written = self._write_running(data, version)
            finally:
                if not written:
                    with _OPEN_LOCK:
                        _OPEN.pop(self.incarnation, None)
            if written:
                break
        else:
            raise DuplicateLearnerError(
                f"learner {self.learner_id!r}: its presence record {self.key!r} kept changing "
                f"while this process registered ({ATTEMPTS} attempts): another process is "
                "starting under the same learner_id; use a unique learner_id"
            )
        self._renewed_at = self._clock()
        self._thread = threading.Thread(
            target=self._renew, name=f"gradientmail-presence-{self.learner_id}", daemon=True
        )
        self._thread.start()
        return self

    def join(self, holder: str) -> bool:
        """Count ``holder`` (``SESSION`` or ``QUEUE``) among the kinds sharing this registration;
        False if it closed meanwhile (register anew).

        Raises:
            DuplicateLearnerError: a holder of that kind already shares it (a second Session, a
                queue inside a queue, of the same learner in this process).
        """
        with _OPEN_LOCK:
            if _OPEN.get(self.incarnation) is not self:
                return False
            if holder in self._holders:
                raise self._held_by(holder)
            self._holders.append(holder)
            return True

    def leave(self, holder: str) -> None:
        """``holder`` is done with this registration; the last one to leave closes it."""
        with _OPEN_LOCK:
            if holder in self._holders:
                self._holders.remove(holder)
            last = not self._holders
        if last:
            self.close()

    def hasten(self, renew_s: float) -> None:
        """Renew at least every ``renew_s`` from now on (a queue with a short lease joined): the
        next renewal, which names the new interval, is written at once."""
        if renew_s < self.renew_s:
            self.renew_s = renew_s
            self._wake.set()

    def check(self) -> None:
        """Raise ``DuplicateLearnerError`` once another incarnation has taken this learner's record.

        That happens when this process stood still longer than its peers wait for a record to
        change (SIGSTOP, a frozen VM) or when the new process's clock ran far ahead: the two must
        not both train. Called by the consumer before each batch; after a pause longer than
        that window it confirms ownership with the store before going on.
        """
        now = self._clock()
        if (
            self._replaced is None
            and self._thread is not None
            and now - self._renewed_at > WINDOW_RENEWALS * self.renew_s
            and now - self._checked_at >= self.renew_s  # at most one check per renewal interval
        ):
            with self._lock:  # a renewal under way (woken by the same resume) ends first
                self._checked_at = now
                if self._clock() - self._renewed_at > WINDOW_RENEWALS * self.renew_s:
                    try:
                        self._renew_locked()
                    except Exception:  # a store fault must not stop training (the thread warns)
                        pass
        if self._replaced is not None:
            raise self._replaced

    @property
    def replaced(self) -> bool:
        """Whether another incarnation of this learner took the record over."""
        return self._replaced is not None

    def close(self) -> None:
        """Stop renewing and mark the record stopped (unless another incarnation has taken it)."""
        with _OPEN_LOCK:
            if self._closed:
                return
            self._closed = True
            if _OPEN.get(self.incarnation) is self:
                del _OPEN[self.incarnation]  # nobody joins it from now on
        self._stop.set()
        self._wake.set()
        thread, self._thread = self._thread, None
        if thread is None:
            return  # never registered
        thread.join()
        try:
            data, version = self._get()
            record = _parse(self.key, data)
            if record is None or record.incarnation != self.incarnation:
                return
            body = _body(self.learner_id, self.incarnation, STOPPED, self._beat + 1, self.renew_s)
            if version is not None:
                self.mailbox.replace_if(self.key, body, version)  # type: ignore[attr-defined]
            else:
                self.mailbox.put(self.key, body)
        except Exception as exc:  # only delays a restart elsewhere; never hides the real exit
            warnings.warn(
                f"gradientmail: marking the presence record {self.key!r} stopped failed: {exc!r}; "
                "a restart on another machine waits for it to expire",
                stacklevel=2,
            )

    # -- internals ---------------------------------------------------------------------------
    def _get(self) -> tuple[bytes | RecordError | None, str | None]:
        """The record's body and version; a body too large to read is its ``RecordError``, with
        no version (it is then overwritten with a plain ``put``)."""
        try:
            if self._versioned:
                got = get_record_versioned(self.mailbox, self.key, PresenceRecord.KIND)  # type: ignore[arg-type]
                return (None, None) if got is None else got
            return get_record(self.mailbox, self.key, PresenceRecord.KIND), None
        except RecordError as exc:
            return exc, None

    def _write_running(self, data: bytes | RecordError | None, version: str | None) -> bool:
        self._beat += 1
        body = _body(self.learner_id, self.incarnation, RUNNING, self._beat, self.renew_s)
        # Confirmed by a read-back (incarnation and beat make the body unique): on a store that
        # told two writers they both won, the one whose record is not stored did not register.
        if data is None:
            return create_confirmed(self.mailbox, self.key, body)
        if version is not None:
            return replace_confirmed(self.mailbox, self.key, body, version)
        self.mailbox.put(self.key, body)  # no compare-and-swap: best effort
        return True

    def _judge(self, record: PresenceRecord, data: bytes | None) -> PresenceRecord | None:
        """``record`` (or the newer one seen) when its process is alive, else None.

        On this machine the process itself answers (its PID and start time); from another,
        ``verdict.judge_lease`` does, as for a lease: stopped, or unchanged for three of its
        renewal intervals on this machine's clock. Never by the date its writer put in it: with
        the two clocks hours apart, a live process would read as long dead and be joined by a
        second one under its id.
        """
        if record.state != RUNNING:
            return None
        if _same_machine(record):
            if record.pid == os.getpid():
                with _OPEN_LOCK:
                    return record if record.incarnation in _OPEN else None
            return record if _alive(record.pid, record.pid_start) else None
        window = presence_window_s(record)
        renew = window / WINDOW_RENEWALS
        seen = Sightings(self._clock)

        def verdict() -> str:
            return judge_lease(record, window, unchanged_s=lambda: seen.unchanged_s(self.key, data))

        _log.warning(
            "learner %r is registered by another process (host %s pid %s): waiting up to %.0f s "
            "for its presence record to change; if it does, that process is alive and this one "
            "stops with DuplicateLearnerError (give each process its own learner_id: the default, "
            "default_learner_id(), is host name + launcher rank), else this one takes over",
            self.learner_id,
            record.host,
            record.pid,
            window,
        )
        while True:
            self._sleep(min(renew / 4, 1.0))
            now, _ = self._get()
            if now != data:
                newer = _parse(self.key, now)
                return newer if newer is not None and judge_lease(newer, window) == LIVE else None
            if verdict() != LIVE:
                return None  # unchanged for the window: that process is gone

    def _duplicate(self, record: PresenceRecord) -> DuplicateLearnerError:
        written = record.time
        age = f"{max(0.0, self._wall() - written):.0f} s ago" if written is not None else "recently"
        if record.pid == os.getpid() and _same_machine(record):
            return DuplicateLearnerError(
                f"learner {self.learner_id!r} is already running in this process: a shared_queue "
                "(or a Session) under the same learner_id is still open here, e.g. one block inside "
                "another, or an earlier block in a notebook not left yet; leave it first, or give this "
                "one its own learner_id",
                learner=self.learner_id,
                host=record.host,
                pid=record.pid,
            )
        return DuplicateLearnerError(
            f"learner {self.learner_id!r} is already running in this run (renewed {age} by "
            f"host {record.host} pid {record.pid}){_default_note(self.learner_id)}; give each process "
            "its own learner_id: pass learner_id=, or start each under a launcher that sets RANK "
            f"({ENV_LEARNER_ID} also sets one). If that process has stopped, start again: a dead "
            "process's record is recognised at once on its own machine, and from another machine once "
            f"it has not changed for {WINDOW_RENEWALS} renewal intervals",
            learner=self.learner_id,
            host=record.host,
            pid=record.pid,
        )

    def _held_by(self, holder: str) -> DuplicateLearnerError:
        return DuplicateLearnerError(
            f"learner {self.learner_id!r} is already running in this process: {HOLDERS[holder]} under "
            "the same learner_id is still open here, e.g. one block inside another, or an earlier block "
            "in a notebook not left yet; leave it first, or give this one its own learner_id (the "
            "Session and the queue of one learner share its registration: one of each per process)",
            learner=self.learner_id,
            host=machine()["host"],
            pid=os.getpid(),
        )

    def _renew(self) -> None:
        while self._replaced is None:
            self._wake.wait(self.renew_s)
            if self._stop.is_set():
                return
            self._wake.clear()
            try:
                self._renew_once()
            except Exception as exc:  # a store fault must not stop training; the next renewal retries
                if not self._warned:
                    self._warned = True
                    warnings.warn(
                        f"gradientmail: renewing the presence record {self.key!r} failed: {exc!r}",
                        stacklevel=1,
                    )

    def _renew_once(self) -> None:
        with self._lock:
            self._renew_locked()

    def _renew_locked(self) -> None:
        """Renew the record if it is still this incarnation's (compare-and-swap where the store
        has it), else note that another incarnation replaced this one."""
        for _ in range(ATTEMPTS):
            if self._replaced is not None:
                return
            # Stamped before reading: a freeze after the write must not make the record look fresh.
            began = self._clock()
            data, version = self._get()
            record = _parse(self.key, data)
            if record is not None and record.incarnation != self.incarnation:
                self._replaced = self._replaced_by(record)
                _log.warning("%s", self._replaced)
                return
            self._beat += 1
            body = _body(self.learner_id, self.incarnation, RUNNING, self._beat, self.renew_s)
            if data is None:  # confirmed by a read-back, as in ``_write_running``
                written = create_confirmed(self.mailbox, self.key, body)
            elif version is not None:
                written = replace_confirmed(self.mailbox, self.key, body, version)
            else:
                self.mailbox.put(self.key, body)  # no compare-and-swap: checked just before
                written = True
            if written:
                self._renewed_at = began
                return

    def _replaced_by(self, record: PresenceRecord) -> DuplicateLearnerError:
        return DuplicateLearnerError(
            f"learner {self.learner_id!r}: this process (pid {os.getpid()}) was replaced by another "
            f"process under the same learner_id (host {record.host} pid {record.pid}), which "
            "judged it dead: it stood still longer than its peers wait (SIGSTOP, a frozen VM) or "
            "that process's clock is far ahead; this one stops so that the two do not take each "
            "other's units",
            learner=self.learner_id,
            host=record.host,
            pid=record.pid,
        )


def _default_note(learner_id: str) -> str:
    """Why two processes share ``learner_id`` when it is this process's default id."""
    if learner_id != default_learner_id():
        return ""
    if any(os.environ.get(name, "").strip() for name in (ENV_LEARNER_ID, *RANK_VARIABLES)):
        return f" (this process's default learner id, from {ENV_LEARNER_ID} or its launcher rank)"
    return (
        f" (the default learner id, host name + rank 0: no launcher rank ({', '.join(RANK_VARIABLES)}) "
        "is set, so every process started by hand on this host gets it)"
    )


def _open_here(record: PresenceRecord) -> Presence | None:
    """This process's open registration that ``record`` names, if any."""
    if record.state != RUNNING or record.pid != os.getpid() or not _same_machine(record):
        return None
    with _OPEN_LOCK:
        return _OPEN.get(record.incarnation)


# -- a holder's share ----------------------------------------------------------------------------
class PresenceShare:
    """A Session's or a queue's share of its process's presence record for ``learner_id``.

    ``start`` registers the learner (a ``Presence`` of ``incarnation``, default a fresh one,
    renewed every ``renew_s``, default ``RENEW_S``) or, when this process already runs it (the learner's queue, or
    its Session, started first), joins that registration and renews it at least every
    ``renew_s``. It raises ``DuplicateLearnerError`` while another process runs the learner, or
    when a holder of the same kind (``holder``: ``SESSION`` or ``QUEUE``) already shares it here.
    ``close`` gives the share back; the last one marks the record stopped.
    """

    def __init__(
        self,
        mailbox: Mailbox,
        learner_id: str,
        holder: str,
        *,
        incarnation: str | None = None,
        renew_s: float | None = None,
    ) -> None:
        if holder not in HOLDERS:
            raise ValueError(f"holder must be one of {sorted(HOLDERS)}, not {holder!r}")
        self.mailbox = mailbox
        self.learner_id = learner_id
        self.holder = holder
        self.renew_s = RENEW_S if renew_s is None else renew_s
        self._incarnation = incarnation or uuid.uuid4().hex
        self._presence: Presence | None = None

    def start(self) -> None:
        """Register or join; ``DuplicateLearnerError`` before anything else is written."""
        for _ in range(ATTEMPTS):
            candidate = Presence(self.mailbox, self.learner_id, self._incarnation, renew_s=self.renew_s)
            presence = candidate.register(share=True)
            if presence.join(self.holder):
                break
        else:  # each registration found closed before this one joined it
            raise DuplicateLearnerError(
                f"learner {self.learner_id!r}: its registration in this process kept closing while "
                f"{HOLDERS[self.holder]} joined it ({ATTEMPTS} attempts)",
                learner=self.learner_id,
            )
        presence.hasten(self.renew_s)
        self._presence = presence

    @property
    def incarnation(self) -> str | None:
        """The incarnation the record names (another holder's when this one joined); None before
        ``start``."""
        return None if self._presence is None else self._presence.incarnation

    def check(self) -> None:
        """``Presence.check``: raise once another process has taken this learner's record over."""
        if self._presence is not None:
            self._presence.check()

    @property
    def replaced(self) -> bool:
        """Whether another incarnation of this learner took the record over."""
        return self._presence is not None and self._presence.replaced

    @property
    def previous(self) -> PresenceRecord | None:
        """The previous run's record the registration replaced (``Presence.previous``)."""
        return None if self._presence is None else self._presence.previous

    def close(self) -> None:
        """Give the share back (idempotent); the last holder marks the record stopped."""
        presence, self._presence = self._presence, None
        if presence is not None:
            presence.leave(self.holder)
