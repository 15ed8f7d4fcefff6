"""Who is alive: lease records of the elastic queue and presence records of learner ids.

Section ``leases`` below: The elastic queue's lease expiry, judged on this process's own clock.

Both sides use it: ``queue.reclaim`` (which unit to load, takeovers) and ``queue.progress``
(what the training loop consumed, heartbeats). The records themselves (``LeaseRecord``,
``WorkRecord``, ``PresenceRecord``) are in ``gradientmail.records``, the verdict in
``gradientmail.verdict``.

Section ``presence`` below: One live incarnation per ``learner_id``: the presence record ``learners/{learner_id}.json``.

Every ``shared_queue`` registers before its first claim and refuses to start, with
``DuplicateLearnerError``, while another incarnation of its learner is alive: two processes
under one id would take each other's units. One read and one write at start, one write every
``renew_s``, one of each at exit; a restart after a crash is allowed. Details: docs/queue.md.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import threading
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from gradientmail.errors import DuplicateLearnerError, RecordError
from gradientmail.layout import learner_key
from gradientmail.mailbox.base import Mailbox, supports_replace_if
from gradientmail.records import RUNNING, STOPPED, LeaseRecord, PresenceRecord, get_record, get_record_versioned
from gradientmail.verdict import LIVE, Sightings, judge_lease

__all__ = [
    "LeaseWatch",
    "POLL_S",
    "Presence",
    "RENEW_S",
    "lease_seconds",
    "machine",
    "presence_renew_s",
    "process_gone",
]


# -- leases ------------------------------------------------------------------------------------------

POLL_S = 0.05
"""Granularity of waits that must notice a stop request."""


def lease_seconds(lease: timedelta | float | None) -> float | None:
    """``lease`` in seconds (None: no leases).

    Raises:
        TypeError: not a ``timedelta`` or a number.
        ValueError: not positive.

    Example:
        >>> lease_seconds(timedelta(minutes=1))
        60.0
    """
    if lease is None:
        return None
    if isinstance(lease, bool) or not isinstance(lease, (timedelta, int, float)):
        raise TypeError(f"lease must be a datetime.timedelta (or seconds), not {type(lease).__name__}")
    seconds = lease.total_seconds() if isinstance(lease, timedelta) else float(lease)
    if not seconds > 0:
        raise ValueError(f"lease must be positive, not {lease!r}")
    return seconds


class LeaseWatch:
    """Judges peers' leases on this process's own monotonic clock (``judge_lease``).

    A lease is expired when its record has not changed for ``lease_s`` since this watch first
    saw that exact content, whatever the writer's clock says; a missing record counts as a
    record that never changes. A record that says the node stopped, that a peer fenced
    (``queue.lease``), or that names another incarnation than the claim's (the node restarted),
    is expired at once. ``clock`` is monotonic; ``wall`` (Unix time) only serves ``vouches``.
    """

    def __init__(
        self, lease_s: float, clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time
    ) -> None:
        self.lease_s = lease_s
        self.clock = clock
        self.wall = wall
        self._sightings = Sightings(clock)
        self._first_read: dict[str, bytes | None] = {}  # each learner's record as this watch first read it

    def expired(self, learner: str, record: bytes | None, incarnation: str | None = None) -> bool:
        self._first_read.setdefault(learner, record)
        lease = LeaseRecord.read(record)  # unusable: judged like a record that never changes
        state = judge_lease(
            lease,
            self.lease_s,
            unchanged_s=lambda: self._sightings.unchanged_s(learner, record),
            incarnation=incarnation,
        )
        return state != LIVE

    def vouches(self, learner: str, record: bytes | None) -> bool:
        """Whether ``learner``'s lease, not ``expired``, shows its writer alive now.

        On this clock a lease stays live until it stood still a whole lease, so a record first
        read a moment ago reads live even if its writer died long before this process started.
        Until this watch has seen ``learner``'s record change, the record must therefore also
        be recent by its writer's own clock: written less than a lease (plus
        ``CLOCK_TOLERANCE_S`` of clock skew) ago. A missing or unusable record vouches for nobody.
        """
        if record is not None and learner in self._first_read and self._first_read[learner] != record:
            return True  # renewed while this watch looked: alive on this clock
        lease = LeaseRecord.read(record)
        stale_s = self.lease_s + CLOCK_TOLERANCE_S
        return lease is not None and judge_lease(lease, self.lease_s, now=self.wall(), stale_s=stale_s) == LIVE


# -- presence ----------------------------------------------------------------------------------------

RENEW_S = 10.0
"""Seconds between renewals of a presence record (a quarter of the lease if that is shorter)."""

WINDOW_RENEWALS = 3
"""A record from another machine that did not change for this many of its writer's renewal
intervals (on the reader's clock) belongs to a dead process."""

LONG_DEAD_S = 600.0
"""A record whose writer's own time is this much older than the reader's clock (and at least
``WINDOW_RENEWALS`` renewals plus ``CLOCK_TOLERANCE_S``) is dead without watching it: a reader
whose clock runs minutes ahead must watch, not take over a live learner."""

CLOCK_TOLERANCE_S = 30.0
"""Clock skew tolerated where a writer's own time is compared with this machine's: a presence
record long dead, a lease read for the first time (``LeaseWatch.vouches``)."""

ATTEMPTS = 5
"""Registration attempts when the record keeps changing under a compare-and-swap."""


_log = logging.getLogger(__name__)
_OPEN: set[str] = set()  # incarnations registered (and not closed) by this process
_OPEN_LOCK = threading.Lock()


def presence_renew_s(lease_s: float | None) -> float:
    """The renewal interval: ``RENEW_S``, or a quarter of the lease when that is shorter."""
    return RENEW_S if lease_s is None else min(RENEW_S, lease_s / 4)


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


def process_gone(record: PresenceRecord) -> bool:
    """Whether ``record`` names a process of this machine that no longer runs (a peer's own
    verdict at once; another machine's record is judged by its age instead)."""
    return _same_machine(record) and not _alive(record.pid, record.fields.get("pid_start"))


# -- the record's owner ------------------------------------------------------------------------
class Presence:
    """Registers one incarnation of ``learner_id`` in ``mailbox`` and keeps it renewed.

    ``start`` raises ``DuplicateLearnerError`` when another incarnation is alive (see the
    module docstring), else writes the record and renews it every ``renew_s`` on a daemon
    thread; ``close`` marks it stopped. ``clock``/``sleep`` (monotonic) and ``wall`` (Unix
    time) are injectable for tests.
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
        self._thread: threading.Thread | None = None
        self._warned = False
        self._lock = threading.Lock()  # one renewal at a time (the thread, or ``check``)
        self._renewed_at = clock()
        self._checked_at = -float("inf")  # the training thread's last ownership check
        self._replaced: DuplicateLearnerError | None = None
        self.previous: PresenceRecord | None = None
        """The record of another incarnation ``start`` found and replaced (None: none): whether
        this learner's previous run left cleanly."""

    # -- public ------------------------------------------------------------------------------
    def start(self) -> None:
        """Register, or raise ``DuplicateLearnerError`` if another incarnation is alive."""
        for _ in range(ATTEMPTS):
            data, version = self._get()
            record = _parse(self.key, data)
            if record is not None and record.incarnation != self.incarnation:
                self.previous = record
                judged = self._judge(record, data)
                if judged is not None:
                    raise self._duplicate(judged)
            if self._register(data, version):
                break
        else:
            raise DuplicateLearnerError(
                f"learner {self.learner_id!r}: its presence record {self.key!r} kept changing "
                f"while this process registered ({ATTEMPTS} attempts): another process is "
                "starting under the same learner_id; use a unique learner_id"
            )
        self._renewed_at = self._clock()
        with _OPEN_LOCK:
            _OPEN.add(self.incarnation)
        self._thread = threading.Thread(
            target=self._renew, name=f"gradientmail-presence-{self.learner_id}", daemon=True
        )
        self._thread.start()

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
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with _OPEN_LOCK:
            if self.incarnation not in _OPEN:
                return
            _OPEN.discard(self.incarnation)
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

    def _register(self, data: bytes | RecordError | None, version: str | None) -> bool:
        self._beat += 1
        body = _body(self.learner_id, self.incarnation, RUNNING, self._beat, self.renew_s)
        if data is None:
            return self.mailbox.put_if_absent(self.key, body)
        if version is not None:
            return bool(self.mailbox.replace_if(self.key, body, version))  # type: ignore[attr-defined]
        self.mailbox.put(self.key, body)  # no compare-and-swap: best effort
        return True

    def _judge(self, record: PresenceRecord, data: bytes | None) -> PresenceRecord | None:
        """``record`` (or the newer one seen) when its process is alive, else None.

        On this machine the process itself answers (its PID and start time); from another,
        ``verdict.judge_lease`` does, as for a lease: stopped, long dead by its writer's clock
        (allowing for skew), or unchanged for three of its renewal intervals on this one's.
        """
        if record.state != RUNNING:
            return None
        if _same_machine(record):
            if record.pid == os.getpid():
                with _OPEN_LOCK:
                    return record if record.incarnation in _OPEN else None
            return record if _alive(record.pid, record.pid_start) else None
        renew = record.renew_s
        renew = min(max(renew, 0.01), RENEW_S) if renew is not None else RENEW_S
        window = WINDOW_RENEWALS * renew
        seen = Sightings(self._clock)

        def verdict() -> str:
            return judge_lease(
                record,
                window,
                now=self._wall(),
                stale_s=max(LONG_DEAD_S, window + CLOCK_TOLERANCE_S),
                unchanged_s=lambda: seen.unchanged_s(self.key, data),
            )

        if verdict() != LIVE:
            return None  # long dead, even allowing for clock skew
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
            f"host {record.host} pid {record.pid}); give each process its own learner_id "
            "(omit it: the default is host name + launcher rank, or set GRADIENTMAIL_LEARNER_ID). If that "
            "process has stopped, start again: a dead process's record is recognised at once on "
            "its own machine, and from another machine once it has not changed for "
            f"{WINDOW_RENEWALS} renewal intervals",
            learner=self.learner_id,
            host=record.host,
            pid=record.pid,
        )

    def _renew(self) -> None:
        while self._replaced is None and not self._stop.wait(self.renew_s):
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
                self.previous = record
                self._replaced = self._replaced_by(record)
                _log.warning("%s", self._replaced)
                return
            self._beat += 1
            body = _body(self.learner_id, self.incarnation, RUNNING, self._beat, self.renew_s)
            if data is None:
                written = self.mailbox.put_if_absent(self.key, body)
            elif version is not None:
                written = bool(self.mailbox.replace_if(self.key, body, version))  # type: ignore[attr-defined]
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
