"""Claiming ahead: a slow store's round trips overlap loading instead of standing between units.

``ClaimAhead`` keeps up to ``depth`` claims running on background threads while the current
unit loads and hands their units out in order. ``depth`` stays 0 (the seed's on-demand claims)
until the loader waits for a claim while the training loop starves, and never exceeds
``limit`` nor ``TIED_S`` of work: units claimed ahead are this node's. Details: docs/queue.md.
"""

from __future__ import annotations

import ctypes
import math
import multiprocessing
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait

from gradientmail.queue.claimer import Claimer, Pick

__all__ = ["BufferGauge", "ClaimAhead", "DEFAULT_CLAIM_AHEAD", "DepthGauge", "TIED_S"]

DEFAULT_CLAIM_AHEAD = 64
"""``shared_queue``'s default ``claim_ahead``, a cap on claims in flight (and threads): room
for 100 ms requests behind units of 20 small batches (about 45 in flight); ``TIED_S`` bounds
the depth before this does on most stores. A bare ``SharedQueueDataset`` defaults to 0."""

TIED_S = 1.0
"""Most seconds of this node's own loading that claims ahead may tie to it (depth x unit time).
Hiding a claim ties about its latency (``DepthGauge.target``): this covers three 100 ms requests
three times over, and a run's end waits at most this much longer for the node than on demand."""

SMOOTHING = 0.2
"""Weight of a new sample in ``DepthGauge``'s moving averages (about the last five)."""


class DepthGauge:
    """How many claims in flight hide a claim's latency behind loading, from measured times.

    A claim started ``depth`` units before it is needed has ``depth * unit_s`` to complete, so
    it takes ``ceil(claim_s / unit_s)`` in flight, plus one for the jitter of either. Both are
    exponential moving averages, so one slow request or one slow unit moves the depth little.
    """

    def __init__(self, smoothing: float = SMOOTHING) -> None:
        self._smoothing = smoothing
        self.claim_s: float | None = None
        """Smoothed seconds from starting a claim to winning a unit (conflicts and listings included)."""
        self.unit_s: float | None = None
        """Smoothed seconds the loader spends on a unit (waits for claims excluded)."""

    def claimed(self, seconds: float) -> None:
        self.claim_s = self._mix(self.claim_s, seconds)

    def loaded(self, seconds: float) -> None:
        self.unit_s = self._mix(self.unit_s, seconds)

    def target(self) -> int:
        """Claims in flight that hide a claim: 0 until both times are known."""
        if self.claim_s is None or not self.unit_s:
            return 0
        return math.ceil(self.claim_s / self.unit_s) + 1

    def bound(self, limit: int, tied_s: float = TIED_S) -> int:
        """The most claims in flight: ``limit``, and no more than ``tied_s`` of work (at least 1)."""
        if not self.unit_s:
            return limit
        return min(limit, max(1, int(tied_s / self.unit_s)))

    def _mix(self, old: float | None, new: float) -> float:
        return new if old is None else old + self._smoothing * (new - old)


class BufferGauge:
    """How many batches are buffered between the loader(s) and the training loop.

    Loaders count the batches they produce (one slot each: a DataLoader worker process is the
    only writer of its slot), the loop counts the batches it takes; the difference is what is
    buffered. Lives in shared memory, so DataLoader worker processes of any start method read it.
    """

    def __init__(self, loaders: int = 1, prefetch: int | None = None) -> None:
        self.low = 1 if prefetch is None else max(1, prefetch // 2)
        """Fewer batches buffered than this: the loaders are not keeping up."""
        self._counts = multiprocessing.RawArray(ctypes.c_int64, loaders + 1)

    def produced(self, loader: int | None) -> None:
        self._counts[1 + (loader or 0)] += 1

    def consumed(self) -> None:
        self._counts[0] += 1

    def taken(self) -> int:
        return self._counts[0]

    def buffered(self) -> int:
        counts = self._counts
        return sum(counts[1:]) - counts[0]


class ClaimAhead:
    """Hands out claimed units in order, claiming up to ``limit`` ahead on background threads.

    Each claim started ahead adds a slot to the line the loader takes units from; a claim fills
    the earliest slot not yet taken, taking it with its first pick under the lock. So the line
    holds units (or a claim's error) in the order they were picked whatever order the pool runs
    the claims in: a later claim that runs first takes the earlier slot, not the later one.
    ``count`` is called (under the lock) for every unit won, the moment it is won.
    """

    def __init__(
        self,
        claimer: Claimer,
        *,
        limit: int,
        gauge: BufferGauge | None = None,
        count: Callable[[], None] = lambda: None,
        name: str = "gradientmail-claim",
    ) -> None:
        self._claimer = claimer
        self._limit = limit
        self._gauge = gauge
        self._count = count
        self._name = name
        self._lock = threading.Lock()
        self._pending: deque[Future[str | None]] = deque()  # the line of slots, in order
        self._untaken: deque[Future[str | None]] = deque()  # its slots no claim has taken yet
        self._pool: ThreadPoolExecutor | None = None
        self._exhausted = False  # a pick found no free unit: start no more claims
        self._closing = False
        self._handed = 0
        self._handed_at = time.perf_counter()
        self._dry = 0  # waits in a row during which the loop ran dry
        self.depth = 0
        self.times = DepthGauge()
        """Measured claim and unit times, which set ``depth`` once the loop starves."""

    def next(self) -> str | None:
        """The next claimed unit (claiming it now if none is ready), or None when none is left.

        A claim's error is raised here, after the units picked before it.
        """
        asked = time.perf_counter()
        unit_s = asked - self._handed_at  # how long the previous unit kept the loader busy
        if self._handed:
            self.times.loaded(unit_s)
        while True:
            mark = self._mark()
            if self._pending:
                future = self._pending.popleft()
                waited = not future.done()
                identifier = future.result()
            elif self._exhausted:
                return None
            else:
                waited = True
                identifier = self._claim()  # on demand, on this thread
            if identifier is None:
                self._exhausted = True
                continue  # claims started earlier may still have won a unit
            self._handed_at = time.perf_counter()
            if waited:
                self._adapt(mark)
            self._handed += 1
            self.depth = min(self.depth, self.times.bound(self._limit))  # the loader's pace changes
            self._top_up()
            return identifier

    def close(self) -> None:
        """Start no more claims and wait for the requests in flight (units won stay claimed)."""
        self._closing = True
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        self._pending.clear()
        self._untaken.clear()  # the slots of claims cancelled before they ran

    @property
    def threaded(self) -> bool:
        """Whether background claim threads are running (never while ``depth`` stayed 0)."""
        return self._pool is not None

    def wait_in_flight(self) -> int:
        """Wait until every claim started ahead has finished; how many are waiting to be handed out."""
        pending = list(self._pending)
        wait(pending)
        return len(pending)

    # -- internals ---------------------------------------------------------------------------
    def _mark(self) -> tuple[int, int] | None:
        gauge = self._gauge
        return None if gauge is None else (gauge.buffered(), gauge.taken())

    def _adapt(self, mark: tuple[int, int] | None) -> None:
        """After the loader waited for a claim: claim further ahead if the loop was starving.

        The loop was starving when it kept taking batches during the wait and the buffer could
        not absorb the wait: it took every batch buffered when the wait began, or that buffer
        was under half full (``BufferGauge.low``: a loader that cannot keep the buffer full is
        the bottleneck, and every wait of it is lost for good). A loop that took nothing (it
        is busy, or has stopped) lost nothing to the wait. It takes two such waits in a row (a
        start-up transient, such as a loop that takes its first batch and stops, is not a
        trend). Without a gauge every wait counts. The first unit's wait is start-up. The depth
        jumps to ``DepthGauge.target`` (at least one more than before), within
        ``DepthGauge.bound``, so a slow store is hidden after a unit or two, not after ``limit``.
        """
        if self._handed == 0 or self.depth >= self._limit:
            return
        if mark is not None:
            assert self._gauge is not None
            buffered, taken = mark
            taken = self._gauge.taken() - taken
            if taken == 0 or (taken < buffered and buffered >= self._gauge.low):
                self._dry = 0
                return
            self._dry += 1
            if self._dry < 2:
                return
        self.depth = min(max(self.depth + 1, self.times.target()), self.times.bound(self._limit))

    def _top_up(self) -> None:
        while not self._exhausted and not self._closing and len(self._pending) < self.depth:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=self._limit, thread_name_prefix=self._name)
            slot: Future[str | None] = Future()
            with self._lock:
                self._untaken.append(slot)
            self._pending.append(slot)
            self._pool.submit(self._claim_ahead)

    def _claim_ahead(self) -> None:
        """A claim on a pool thread: it fills the earliest untaken slot with its unit or error.

        The slot is taken in the same hold of the lock as the first pick, so the k-th slot gets
        the k-th unit picked even when the pool runs a later claim first.
        """
        started = time.perf_counter()
        with self._lock:
            slot = self._untaken.popleft()
            try:
                pick = self._pick()
            except BaseException as exc:
                slot.set_exception(exc)
                return
        try:
            slot.set_result(self._win(pick, started))
        except BaseException as exc:
            slot.set_exception(exc)

    def _claim(self) -> str | None:
        """A claim on demand, on the loader's thread."""
        started = time.perf_counter()
        with self._lock:
            pick = self._pick()
        return self._win(pick, started)

    def _pick(self) -> Pick | None:
        """The next candidate (under the lock): None when none is left or when closing."""
        return None if self._closing else self._claimer.pick()

    def _win(self, pick: Pick | None, started: float) -> str | None:
        """Attempt ``pick``, and the next pick after each lost attempt: the unit won, or None."""
        claimer = self._claimer
        while pick is not None:
            won = claimer.attempt(pick)  # the requests, outside the lock
            with self._lock:
                identifier = claimer.settle(pick, won)
                if identifier is not None:
                    self._count()
                    self.times.claimed(time.perf_counter() - started)
                    return identifier
                pick = self._pick()
        return None
