"""When a loader claims its next unit: just in time for the training loop, never a buffer ahead.

A claimed unit is this node's for good. A loader that claimed whenever its prefetch buffer had
room would, with small units, hold as many units as the buffer holds batches, none of them
started; at the end of a run the slowest node then trains them alone while faster nodes find
nothing left (one-batch units, ``prefetch=8``: makespan 33-47 time units where 12 is ideal).

Mid-run that costs nothing: every node is busy whoever holds what. It matters in the
*endgame*, once the units nobody has claimed are few compared with what the nodes could hold
ahead (``Endgame``: at most ``ENDGAME_MARGIN`` x nodes x the units one node may hold). From then
on a loader claims a new unit only when the loop will need that unit's first batch within the
time a claim and a first batch take (measured, ``LEAD_FACTOR`` times over): as late as still
keeps the loop fed, so each last unit goes to whichever node will start it first. ``prefetch``
still bounds the batches buffered and fills, mid-run across units and in the endgame with the
batches of units already claimed; a claim's latency stays hidden behind the batches buffered.
``BufferGauge`` carries what that takes across processes (the loop's step time, the batches
buffered); ``UnitPacer`` is the loader's side.
"""

from __future__ import annotations

import ctypes
import logging
import math
import multiprocessing
import threading
import time
from collections import deque
from collections.abc import Callable

from gradientmail.layout import LEARNERS_PREFIX
from gradientmail.mailbox.base import Mailbox

__all__ = [
    "ALONE_GRACE_S",
    "ENDGAME_MARGIN",
    "LATENCY_MEMORY",
    "LEAD_FACTOR",
    "LEAD_FLOOR_S",
    "NODES_LOOK",
    "NODES_RECOUNT_S",
    "POLL_S",
    "BufferGauge",
    "Endgame",
    "UnitPacer",
]

LEAD_FACTOR = 2.0
"""A claim starts this many times the measured claim-and-first-batch latency before the loop
needs the unit: room for a slow request or a busy core without the loop waiting."""

LEAD_FLOOR_S = 0.002
"""The shortest lead: the hand-off from a worker process to the loop takes about this long."""

LATENCY_MEMORY = 8
"""Claims whose latency the lead remembers (it follows the slowest of them)."""

POLL_S = 0.01
"""Longest sleep between two looks at the loop while waiting to claim: a loop that asks
sooner than its pace says waits at most about this long more than a claim."""

STEP_SMOOTHING = 0.2
"""Weight of a new sample in the loop's smoothed step time (about the last five)."""

ENDGAME_MARGIN = 4
"""The endgame starts this many times earlier than the nodes' full buffers could empty the queue.
A node still holds a full buffer when it begins, which the slowest node must drain before the
queue runs dry: with speeds 1:2:2:4 that takes 9 buffers' worth of units, where 4 nodes x 2
gave 8 (240 one-batch units: the slow node took 29-30 units instead of 27, makespan 1.11 of the
bound). 4 also covers the claims a node has not listed yet (its count of unclaimed units lags)."""

NODES_RECOUNT_S = 5.0
"""Seconds between two counts of the run's nodes (a listing of ``learners/``) near the endgame."""

ALONE_GRACE_S = 1.0
"""For this long after it starts, a node that has counted no peer paces its claims as in the
endgame: peers started together may not have written their presence records yet, and
believing itself alone it would fill its buffer with units they could start sooner."""

NODES_LOOK = 8
"""The nodes are counted only once the unclaimed units are within this many endgame thresholds:
a long run lists ``learners/`` only near its end."""

UNCLAIMED_RECOUNT_S = 0.01
"""Seconds between two counts of the unclaimed units (a scan of one byte per unit) while the
endgame is far."""

_ASKED, _RETURNED, _STEP, _WAITED, _CLOSED = range(5)

_log = logging.getLogger("gradientmail.queue")


class BufferGauge:
    """What the training loop and its loaders share: batches buffered, the loop's pace, the end.

    Loaders count the batches they produce and mark the unit they are claiming (one slot each:
    a DataLoader worker process is the only writer of its slots); the loop counts the batches it
    takes and stamps when it asks for one and when it gets it, which gives its step time (from
    getting a batch to asking for the next) and the time it spent waiting. Lives in shared
    memory, so DataLoader worker processes of any start method read it; times are
    ``time.monotonic()``, one clock for every process of the machine.

    Example:
        >>> gauge = BufferGauge(loaders=2)
        >>> gauge.produced(0); gauge.produced(1); gauge.consumed()
        >>> gauge.buffered(), gauge.taken(), gauge.step_s() is None
        (1, 1, True)
    """

    def __init__(self, loaders: int = 1, prefetch: int = 1, clock: Callable[[], float] = time.monotonic) -> None:
        self.loaders = loaders
        self._clock = clock
        self.holds = prefetch + loaders
        """The most units this node may hold unstarted: a buffer of one-batch units, and one
        unit being loaded per loader."""
        self._counts = multiprocessing.RawArray(ctypes.c_int64, 1 + 2 * loaders)  # taken, produced..., claiming...
        self._times = multiprocessing.RawArray(ctypes.c_double, 5)
        self._times[_ASKED] = self._times[_RETURNED] = self._times[_STEP] = -1.0

    # -- the loop's side -----------------------------------------------------------------------
    def asked(self) -> None:
        """The loop asks for its next batch (it has trained the previous one)."""
        self._times[_ASKED] = self._clock()

    def returned(self) -> None:
        """The loop got the batch it asked for: one more step-time sample and its wait."""
        now = self._clock()
        times = self._times
        asked, previous = times[_ASKED], times[_RETURNED]
        if asked >= 0:
            times[_WAITED] += now - asked
            if previous >= 0 and asked >= previous:
                sample = asked - previous
                old = times[_STEP]
                times[_STEP] = sample if old < 0 else old + STEP_SMOOTHING * (sample - old)
        times[_RETURNED] = now

    def consumed(self) -> None:
        """One item left the buffer for the loop."""
        self._counts[0] += 1

    def close(self) -> None:
        """The loop has left: loaders waiting for their turn to claim stop waiting."""
        self._times[_CLOSED] = 1.0

    # -- the loaders' side ---------------------------------------------------------------------
    def produced(self, loader: int | None) -> None:
        self._counts[1 + (loader or 0)] += 1

    def claiming(self, loader: int | None, active: bool) -> None:
        """``loader`` is claiming a unit whose first batch is not produced yet (or no longer)."""
        self._counts[1 + self.loaders + (loader or 0)] = int(active)

    def taken(self) -> int:
        return self._counts[0]

    def buffered(self) -> int:
        """Items produced and not yet taken by the loop."""
        counts = self._counts
        return sum(counts[1 : 1 + self.loaders]) - counts[0]

    def claims_by_others(self, loader: int | None) -> int:
        """Units other loaders are claiming now (each will add at least one batch)."""
        first = 1 + self.loaders
        return sum(self._counts[first : first + self.loaders]) - self._counts[first + (loader or 0)]

    def step_s(self) -> float | None:
        """The loop's smoothed time from getting a batch to asking for the next; None until known."""
        step = self._times[_STEP]
        return None if step < 0 else step

    def waiting(self) -> bool:
        """Whether the loop has asked for a batch and not got it yet."""
        return self._times[_ASKED] > self._times[_RETURNED]

    def waited(self) -> float:
        """Seconds the loop has spent waiting for batches so far (a wait under way included)."""
        times = self._times
        ongoing = self._clock() - times[_ASKED] if times[_ASKED] > times[_RETURNED] else 0.0
        return times[_WAITED] + ongoing

    def next_ask(self, now: float) -> float:
        """When the loop will ask for its next batch: now if it is waiting or overdue."""
        step = self.step_s()
        if self.waiting() or step is None:
            return now
        return max(now, self._times[_RETURNED] + step)

    @property
    def closed(self) -> bool:
        return self._times[_CLOSED] > 0


def _in_background(count: Callable[[], None]) -> None:
    threading.Thread(target=count, name="gradientmail-count-nodes", daemon=True).start()


class Endgame:
    """Whether the run is in its endgame: unclaimed units few compared with what nodes could hold.

    The endgame starts once the units not known to be claimed are at most ``ENDGAME_MARGIN`` x
    the run's nodes x ``holds`` (the units one node may hold unstarted), and lasts to the end
    once peers were counted.
    A node alone has none: whatever it holds, it starts before anybody else could. Nodes are
    counted by their presence records (``learners/``: every node of ``shared_queue`` writes one
    before claiming; a listing on a thread of its own, so the loader never waits for it), only
    once the end is near (``NODES_LOOK``), every ``NODES_RECOUNT_S``. In
    its first ``ALONE_GRACE_S`` a node that has counted only itself is paced as in the endgame
    (peers started together may not have registered yet), and counts again when it ends.

    Args:
        unclaimed: The claimer's count of units not known to be claimed.
        mailbox: Where the presence records are (None: no peer is ever counted).
        holds: Units one node may hold unstarted (``BufferGauge.holds``).

    Example:
        >>> now = [0.0]
        >>> endgame = Endgame(lambda: 30, None, holds=9, clock=lambda: now[0], run=lambda count: count())
        >>> endgame()  # its first second: peers may not have registered yet
        True
        >>> now[0] = 2.0; endgame()  # alone: nothing it holds could go to a faster node
        False
    """

    def __init__(
        self,
        unclaimed: Callable[[], int],
        mailbox: Mailbox | None,
        holds: int,
        *,
        clock: Callable[[], float] = time.monotonic,
        run: Callable[[Callable[[], None]], None] = _in_background,
    ) -> None:
        self._unclaimed = unclaimed
        self._mailbox = mailbox
        self._per_node = ENDGAME_MARGIN * max(1, holds)
        self._clock = clock
        self._run = run
        self._started = clock()
        self._reached = False
        self._left: int | None = None
        self._left_at = 0.0
        self._nodes = 1
        self._counted: float | None = None  # when the latest count started
        self._counting = False

    @property
    def nodes(self) -> int:
        """The nodes counted last (at least this one)."""
        return self._nodes

    def __call__(self) -> bool:
        if self._reached:
            return True
        now = self._clock()
        near = NODES_LOOK * self._per_node * max(self._nodes, 2)
        if self._left is None or self._left <= near or now - self._left_at >= UNCLAIMED_RECOUNT_S:
            self._left, self._left_at = self._unclaimed(), now
        if self._mailbox is not None and self._left <= near:
            # Alone at the count in its first ALONE_GRACE_S: peers were registering; count once more after.
            regrace = self._nodes <= 1 and self._counted is not None and self._counted - self._started < ALONE_GRACE_S
            due = self._counted is None or now - self._counted >= NODES_RECOUNT_S
            if (due or (regrace and now - self._started >= ALONE_GRACE_S)) and not self._counting:
                self._counting, self._counted = True, now
                self._run(self._count)
        if self._nodes > 1:
            self._reached = self._left <= self._per_node * self._nodes  # for good: units only get fewer
            return self._reached
        # Alone so far: peers started together may not have registered yet; pace until they would have.
        return now - self._started < ALONE_GRACE_S

    def _count(self) -> None:
        """Count the presence records (on a thread of its own: the loader does not wait for it)."""
        assert self._mailbox is not None
        try:
            self._nodes = max(1, sum(1 for _ in self._mailbox.list(LEARNERS_PREFIX)))
        except Exception as exc:  # an optimisation's listing must never stop the node
            _log.debug("counting the nodes under %r failed: %r", LEARNERS_PREFIX, exc)
        finally:
            self._counting = False


class UnitPacer:
    """A loader's turn to claim its next unit, from the loop's pace (``BufferGauge``).

    In the ``endgame``, ``wait()`` returns when the loop will need a new unit's first batch within ``lead_s()``:
    the batches buffered (and units other loaders are claiming, one batch each) times the
    loop's step time, counted from when it will next ask. Before the loop's step time is known
    (until it asks for its second batch), a unit is claimed only when nothing is buffered: one
    unit at a time. ``produced()`` after each batch measures a claim's latency (to its first batch).

    Example:
        >>> gauge = BufferGauge()
        >>> pacer = UnitPacer(gauge, None)
        >>> pacer.wait()  # nothing buffered: the first unit at once
        True
        >>> pacer.produced(); pacer.delay()  # a batch buffered, the loop's pace unknown: wait
        inf
        >>> gauge.close(); pacer.wait()
        False
    """

    def __init__(
        self,
        gauge: BufferGauge,
        loader: int | None,
        endgame: Callable[[], bool] = lambda: True,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._gauge = gauge
        self._loader = loader
        self._endgame = endgame
        self._clock = clock
        self._sleep = sleep
        self._latencies: deque[float] = deque(maxlen=LATENCY_MEMORY)
        self._since: float | None = None  # when the claim now under way passed the gate

    def lead_s(self) -> float:
        """How long before the loop needs a unit its claim starts."""
        slowest = max(self._latencies, default=0.0)
        return max(LEAD_FLOOR_S, LEAD_FACTOR * slowest)

    def delay(self) -> float:
        """Seconds until this loader should claim (<= 0: now; ``math.inf``: when the loop asks)."""
        gauge = self._gauge
        now = self._clock()
        ahead = gauge.buffered() + gauge.claims_by_others(self._loader)
        step = gauge.step_s()
        if step is None:  # the loop's pace is not known yet: one unit at a time
            return 0.0 if ahead <= 0 else math.inf
        needed = gauge.next_ask(now) + max(0, ahead) * step
        return needed - now - self.lead_s()

    def wait(self) -> bool:
        """Wait for this loader's turn to claim; False when the loop has left (claim nothing).

        Mid-run (``endgame()`` False) the turn is now: the buffer's bound alone paces the loader."""
        gauge = self._gauge
        while not gauge.closed:
            delay = self.delay() if self._endgame() else 0.0
            if delay <= 0:
                gauge.claiming(self._loader, True)
                self._since = self._clock()
                return True
            self._sleep(min(delay, POLL_S))
        return False

    def produced(self) -> None:
        """A batch was produced: the first of a unit ends its claim's latency."""
        self._gauge.produced(self._loader)
        if self._since is not None:
            self._latencies.append(self._clock() - self._since)
            self._since = None
            self._gauge.claiming(self._loader, False)

    def ended(self) -> None:
        """The claim found no unit, or the unit had no batch: this loader claims nothing now."""
        if self._since is not None:
            self._since = None
            self._gauge.claiming(self._loader, False)
