"""A virtual clock that runs real code as cooperative tasks, one at a time, in time order.

Only one task runs at any moment: it runs until it waits for virtual time (``sleep_until``),
for another task (``join``) or for an ``Event``; the clock then resumes the task due earliest
(ties in the order they were scheduled). So code written for threads (the Session's exchange
jobs, its overlapped requests) runs unchanged, in an order that depends only on virtual times
and the random seed: the same run twice gives the same figures. Each task is a greenlet when the
``greenlet`` package is installed (a switch costs about a microsecond, in one thread), else a
thread handed a semaphore (the same order, but each switch waits for the operating system to
schedule the next thread: tens of microseconds on an idle machine, far more on a busy one).

While ``VirtualClock.run`` runs, ``time.monotonic()`` and ``time.time()`` read the virtual clock
(``time.time()`` from ``EPOCH``): the one place the simulator patches the process, because the
protocol consults these clocks in several modules. Threads outside the simulation see the
virtual clock too meanwhile; nothing real should run beside a simulation.

Example:
    >>> clock = VirtualClock()
    >>> seen = []
    >>> def napper(name, seconds):
    ...     clock.sleep(seconds)
    ...     seen.append((name, time.monotonic()))
    >>> _ = clock.spawn(lambda: napper("slow", 2.0)), clock.spawn(lambda: napper("fast", 0.5))
    >>> clock.run()
    >>> seen
    [('fast', 0.5), ('slow', 2.0)]
"""

from __future__ import annotations

import heapq
import threading
import time
from collections.abc import Callable
from typing import Any

from gradientmail.session.overlap import OVERLAP

try:
    from greenlet import greenlet
except ImportError:  # tasks run as threads instead
    greenlet = None

EPOCH = 1_800_000_000.0
"""What ``time.time()`` reads at virtual time 0 (a date in 2027: keys with dates stay well formed)."""

STACK_BYTES = 512 * 1024
"""Each task's thread stack: thousands of tasks are alive at once in a large simulation."""


class SimulationError(RuntimeError):
    """A simulation that cannot go on: a task failed, or every task waits and none is due."""


class Task:
    """One cooperative task: its result or error once ``finished``."""

    def __init__(self, fn: Callable[[], Any], name: str, carrier: Carrier | None) -> None:
        self.fn: Callable[[], Any] | None = fn
        self.name = name
        self.finished = False
        self.result: Any = None
        self.error: BaseException | None = None
        self.waiters: list[Task] = []
        self.carrier = carrier
        self.glet: Any = None  # its greenlet, once started (greenlet tasks)


class Carrier:
    """A thread that runs tasks one after another (a thread start costs more than a task switch)."""

    def __init__(self) -> None:
        self.go = threading.Semaphore(0)
        self.task: Task | None = None


class Event:
    """A flag tasks wait on (``wait``) until some task sets it; on a ``VirtualClock``."""

    def __init__(self, clock: VirtualClock) -> None:
        self.clock = clock
        self.is_set = False
        self.waiters: list[Task] = []

    def set(self) -> None:
        self.is_set = True
        waiters, self.waiters = self.waiters, []
        for task in waiters:
            self.clock.wake(task)

    def wait(self) -> None:
        if not self.is_set:
            self.waiters.append(self.clock.current())
            self.clock.park()


class VirtualClock:
    """Schedules ``Task``s on virtual time; see the module docstring.

    Args:
        fail_fast: a task's exception stops the simulation (``run`` raises it) rather than
            being left in its ``Task.error`` for whoever joins it.
        threads: run tasks as threads even when ``greenlet`` is installed.
    """

    def __init__(self, *, fail_fast: bool = True, threads: bool = False) -> None:
        self.now = 0.0
        self.fail_fast = fail_fast
        self.greenlets = greenlet is not None and not threads
        self._current: Task | None = None
        self._hub: Any = None
        self.switches = 0
        self._due: list[tuple[float, int, Task]] = []
        self._order = 0
        self._live = 0
        self._finished = threading.Event()
        self._failure: BaseException | None = None
        self._carriers: list[Carrier] = []
        self._idle: list[Carrier] = []  # carriers whose task finished, for the next spawn

    # -- from the thread that owns the simulation ------------------------------------------
    def run(self) -> None:
        """Run every task spawned (and those they spawn) to the end, on virtual time.

        Raises:
            SimulationError: a task failed (with ``fail_fast``) or the tasks deadlocked.
        """
        real_monotonic, real_time = time.monotonic, time.time
        time.monotonic = lambda: self.now
        time.time = lambda: EPOCH + self.now
        try:
            if self.greenlets:
                self._hub = greenlet.getcurrent()
                while self._due and self._failure is None:
                    self._resume()
                self._stopped()
            else:
                self._finished.clear()
                self._next()
                self._finished.wait()
        finally:
            time.monotonic, time.time = real_monotonic, real_time
            for carrier in self._idle:  # let the idle threads end; busy ones (a failure) stay parked
                carrier.go.release()
            self._idle = []
        if self._failure is not None:
            raise SimulationError(f"the simulation stopped at {self.now:.3f} s: {self._failure!r}") from self._failure

    # -- from any task ---------------------------------------------------------------------
    def spawn(self, fn: Callable[[], Any], *, at: float | None = None, name: str = "task") -> Task:
        """Start ``fn`` as a task at virtual time ``at`` (default: now)."""
        if self.greenlets:
            carrier = None
        elif self._idle:
            carrier = self._idle.pop()
        else:
            carrier = Carrier()
            self._carriers.append(carrier)
            previous = threading.stack_size(STACK_BYTES)
            try:
                threading.Thread(target=self._carry, args=(carrier,), name="virtual-task", daemon=True).start()
            finally:
                threading.stack_size(previous)
        task = Task(fn, name, carrier)
        if carrier is not None:
            carrier.task = task
        self._live += 1
        self._schedule(self.now if at is None else max(at, self.now), task)
        return task

    def current(self) -> Task:
        task = self._current
        if task is None:
            raise SimulationError("only a task of this clock can wait on it")
        return task

    def sleep_until(self, when: float) -> None:
        """Let every task due before ``when`` run, then go on at ``when``."""
        when = max(when, self.now)
        if not self._due or when < self._due[0][0]:  # nobody runs in between: no switch needed
            self.now = when
            return
        self._schedule(when, self.current())
        self.park()

    def sleep(self, seconds: float) -> None:
        self.sleep_until(self.now + seconds)

    def join(self, task: Task) -> Any:
        """Wait for ``task`` to finish; its result (its exception is raised)."""
        if not task.finished:
            task.waiters.append(self.current())
            self.park()
        if task.error is not None:
            raise task.error
        return task.result

    def overlap(self, tasks: list[Callable[[], Any]], lanes: int) -> list[Any]:
        """``session.overlap.parallel`` on this clock: ``lanes`` tasks, each running its share in
        order (as the daemon lanes do), all starting now; the caller goes on when the last ends."""
        groups = [range(k, len(tasks), lanes) for k in range(min(lanes, len(tasks)))]
        results: list[Any] = [None] * len(tasks)
        errors: list[BaseException] = []

        def lane(indices: range) -> None:
            for i in indices:
                try:
                    results[i] = tasks[i]()
                except BaseException as exc:  # raised below, on the calling task
                    errors.append(exc)

        spawned = [self.spawn(lambda group=group: lane(group), name="overlap") for group in groups[1:]]
        lane(groups[0])
        for task in spawned:
            self.join(task)
        if errors:
            raise errors[0]
        return results

    # -- the scheduler (only the running task touches it) ----------------------------------
    def wake(self, task: Task) -> None:
        self._schedule(self.now, task)

    def park(self) -> None:
        """Hand the clock to the next task due and wait until this one is resumed."""
        task = self.current()
        if self.greenlets:
            self._hub.switch()
            return
        self._next()
        assert task.carrier is not None
        task.carrier.go.acquire()

    def _schedule(self, when: float, task: Task) -> None:
        self._order += 1
        heapq.heappush(self._due, (when, self._order, task))

    def _stopped(self) -> None:
        """No task is due any more: the end, or a deadlock when some still wait."""
        if self._live and self._failure is None:
            self._failure = SimulationError(f"{self._live} tasks wait and none is due (a deadlock)")

    def _resume(self) -> None:
        """Resume the task due first (greenlets: from the hub, until it parks or ends)."""
        when, _, task = heapq.heappop(self._due)
        self.now = when
        self.switches += 1
        self._current = task
        if task.glet is None:
            task.glet = greenlet(lambda: self._green(task))
        task.glet.switch()

    def _green(self, task: Task) -> None:
        OVERLAP.set(self.overlap)  # this task's overlapped requests: tasks of this clock
        self._body(task)

    def _next(self) -> None:
        """Threads: hand the clock to the task due first (the caller then waits or ends)."""
        if self._failure is not None and self.fail_fast:
            self._due.clear()
        if not self._due:
            self._stopped()
            self._finished.set()
            return
        when, _, task = heapq.heappop(self._due)
        self.now = when
        self.switches += 1
        self._current = task
        assert task.carrier is not None
        task.carrier.go.release()

    def _carry(self, carrier: Carrier) -> None:
        OVERLAP.set(self.overlap)  # this thread's overlapped requests: tasks of this clock
        while True:
            carrier.go.acquire()
            task = carrier.task
            if task is None:  # the clock is done with its carriers
                return
            self._body(task)
            carrier.task = None
            self._idle.append(carrier)
            self._next()

    def _body(self, task: Task) -> None:
        fn, task.fn = task.fn, None
        assert fn is not None
        try:
            task.result = fn()
        except BaseException as exc:  # recorded; raised by join, or by run when fail_fast
            task.error = exc
            if self.fail_fast and self._failure is None:
                self._failure = exc
        finally:
            task.finished = True
            self._live -= 1
            for waiter in task.waiters:
                self.wake(waiter)
            task.waiters = []
