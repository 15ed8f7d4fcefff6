"""Claiming ahead: a slow store's round trips overlap loading instead of standing between units.

``ClaimAhead`` keeps up to ``depth`` claims running on background threads while the current
unit loads and hands their units out in order. ``depth`` stays 0 (the design note's on-demand claims)
until the loader waits for a claim while the training loop starves, and never exceeds
``limit`` nor ``TIED_S`` of work: units claimed ahead are this node's. Details: docs/queue.md.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import NamedTuple

from gradientmail.queue.claimer import Claimer, Pick
from gradientmail.queue.pacing import BufferGauge

__all__ = [
    "ClaimAhead",
    "CLIMB_GAIN",
    "CLIMB_S",
    "CLIMB_UNITS",
    "DEFAULT_CLAIM_AHEAD",
    "DepthClimb",
    "DepthGauge",
    "HOLD_S",
    "TIED_S",
]


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

    def deeper(self, depth: int, limit: int) -> int:
        """The depth to try when the loop starved at ``depth``: the target, or ``CLIMB_STEP`` more."""
        step = max(1, depth // CLIMB_STEP)
        return min(max(depth + step, self.target()), self.bound(limit))

    def _mix(self, old: float | None, new: float) -> float:
        return new if old is None else old + self._smoothing * (new - old)


CLIMB_GAIN = 0.05
"""A deeper claim-ahead is kept only when units are handed out at least this much faster with it."""

CLIMB_UNITS = 8
"""Fewest units handed out in a rate's measurement (a trial also waits for its depth's units first)."""

CLIMB_S = 0.1
"""Fewest seconds in a rate's measurement: a few time slices of a busy machine, so one slice
given to another process does not decide a trial."""

CLIMB_STEP = 4
"""Without a higher target, a starving loop tries ``depth // CLIMB_STEP`` more claims in flight (at
least one): where claims are what the loop waits for, units then come about 25 % faster, well
over ``CLIMB_GAIN``; one more at a time would gain less than ``CLIMB_GAIN`` beyond 20 in flight."""

HOLD_S = 5.0
"""Seconds a depth that did not pay stays the most claims in flight before a deeper one is tried
again (the store or the loader may have changed)."""


class _Trial(NamedTuple):
    before: int  # the depth before the trial, restored if the trial does not pay
    rate: float  # units per second handed out at that depth
    settle: int  # units handed out when the trial's measurement starts
    started: float | None  # the clock then (None until that unit is handed out)


class DepthClimb:
    """Keeps a deeper claim-ahead only when it hands units out faster (hill-climbing on the rate).

    ``DepthGauge`` says how deep claims must run to hide their latency, from the time a claim
    takes; but on a store with no latency a claim's time is CPU work, and more claims in flight
    only take turns at the interpreter with the loader (and with each other, which makes each
    claim slower and the gauge ask for more). So each deeper depth is a trial: the units handed
    out per second at the old depth are compared with those at the new one, measured once the
    new depth's extra claims had time to land; a depth that does not pay ``CLIMB_GAIN`` goes back
    and stays the most for ``HOLD_S``. On a slow store the first step (from on-demand claims to
    the gauge's target) pays many times over and is kept at once.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._since: tuple[int, float] | None = None  # (units handed, clock) when this depth's rate began
        self._trial: _Trial | None = None
        self._ceiling: tuple[int, float] | None = None  # (most depth, until the clock reads this)

    def handed(self, handed: int, depth: int) -> int:
        """``handed`` units are out now: the depth to keep (a trial that did not pay ends here)."""
        now = self._clock()
        if self._since is None:
            self._since = (handed, now)  # the first unit's wait is start-up, not a rate
        trial = self._trial
        if trial is None:
            return depth
        if trial.started is None:
            if handed >= trial.settle:
                self._trial = trial._replace(settle=handed, started=now)
            return depth
        units, seconds = handed - trial.settle, now - trial.started
        if units < max(CLIMB_UNITS, depth) or seconds < CLIMB_S:
            return depth
        self._trial = None
        if units / seconds >= trial.rate * (1 + CLIMB_GAIN):
            self._since = (trial.settle, trial.started)  # the new depth's rate so far
            return depth
        self._since = (handed, now)
        self._ceiling = (trial.before, now + HOLD_S)
        return trial.before

    def deeper(self, handed: int, depth: int, wanted: int) -> int:
        """The loop starved and ``wanted`` claims in flight would hide a claim: the depth to try."""
        now = self._clock()
        if self._ceiling is not None:
            if now < self._ceiling[1]:
                wanted = min(wanted, self._ceiling[0])
            else:
                self._ceiling = None
        if wanted <= depth or self._trial is not None or self._since is None:
            return depth
        units, seconds = handed - self._since[0], now - self._since[1]
        if units < 1 or seconds < CLIMB_S:
            return depth  # this depth's rate is not known yet
        self._trial = _Trial(before=depth, rate=units / seconds, settle=handed + wanted, started=None)
        return wanted

    @property
    def trying(self) -> bool:
        """Whether a deeper depth is being measured now."""
        return self._trial is not None


STARVED_S = 0.005
"""Seconds the loop must have waited for a batch during a claim for that claim to count as
starving it (a batch already buffered reaches the loop in microseconds)."""


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
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._claimer = claimer
        self._clock = clock
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
        self._handed_at = clock()
        self._dry = 0  # waits in a row during which the loop ran dry
        self.depth = 0
        self.times = DepthGauge()
        """Measured claim and unit times, which set ``depth`` once the loop starves."""
        self.climb = DepthClimb(clock)
        """Keeps a deeper ``depth`` only when units are handed out faster with it."""

    def next(self) -> str | None:
        """The next claimed unit (claiming it now if none is ready), or None when none is left.

        A claim's error is raised here, after the units picked before it.
        """
        if not self._limit:  # the design note's claims on demand: no depth to measure or adapt
            identifier = None if self._exhausted else self._claim()
            self._exhausted = identifier is None
            return identifier
        asked = self._clock()
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
            self._handed_at = self._clock()
            self._handed += 1
            self.depth = self.climb.handed(self._handed, self.depth)
            if waited:
                self._adapt(mark)
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
    def _mark(self) -> float | None:
        gauge = self._gauge
        return None if gauge is None else gauge.waited()

    def _adapt(self, mark: float | None) -> None:
        """After the loader waited for a claim: claim further ahead if the loop was starving.

        The loop was starving when it waited for a batch during the claim (``BufferGauge.
        waited``): that wait is lost for good. A loop that kept training on buffered batches
        lost nothing, however few were left (the loader claims just in time on purpose:
        ``queue.pacing``). It takes two such waits in a row (a start-up transient, such as a
        loop that takes its first batch and stops, is not a trend). Without a gauge every wait
        counts. The first unit's wait is start-up. The depth jumps to ``DepthGauge.target`` (at
        least a quarter more than before), within ``DepthGauge.bound``, so a slow store is
        hidden after a unit or two, not after ``limit``; and it stays there only if units are
        then handed out faster (``DepthClimb``).
        """
        if self._handed == 1 or self.depth >= self._limit:
            return
        if mark is not None:
            assert self._gauge is not None
            if self._gauge.waited() - mark <= STARVED_S:
                self._dry = 0
                return
            self._dry += 1
            if self._dry < 2:
                return
        self.depth = self.climb.deeper(self._handed, self.depth, self.times.deeper(self.depth, self._limit))

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
        started = self._clock()
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
        started = self._clock()
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
                    self.times.claimed(self._clock() - started)
                    return identifier
                pick = self._pick()
        return None
