"""When a learner exchanges which fragment: one fragment per slot, on a grid at its own phase.

An interval (``every``) is cut into one slot per fragment. Each learner draws a random phase
when it joins and exchanges on the grid ``joined + phase + k * slot``, one fragment per slot, in
turn from a random first one, so that learners that joined together still fold each fragment
at different moments. Folds start at steps, one job at a time: the slots that came while a job
ran, or within a step longer than a slot, are all due at the next step (each fragment at most
once), so a learner folds every fragment once per ``every`` whenever its store and steps allow
it, and resumes on its own grid: it never takes ``now`` as its new phase, which would line
learners up behind the same slow moments and keep them folding in lock-step. A first ``step()``
long after joining folds one fragment (there was no progress to fold before it).
By steps (``every_steps``) each learner counts its own steps: no clock is shared to align on.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable


class Schedule:
    """One learner's exchange schedule over ``count`` fragments.

    Args:
        count: fragments the state is cut into (one exchanged per slot).
        every_s: seconds per whole exchange (``math.inf``: by steps only).
        every_steps: steps per whole exchange (``math.inf``: by time only).
        steps: the learner's step count at joining.
        clock: seconds, monotonic (tests pass a fake).
        rng: where the phase and the first fragment come from (tests pass a seeded one).

    Example:
        >>> now = [100.0]
        >>> plan = Schedule(4, every_s=8.0, every_steps=math.inf, steps=0, clock=lambda: now[0], rng=random.Random(1))
        >>> plan.phase_s < 2.0, plan.due(steps=0)
        (True, False)
        >>> now[0] = 131.0  # the first step comes many slots late: fold now, then on the grid
        >>> plan.due(steps=0), len(plan.take(steps=0)), 0 < plan.due_time - now[0] <= 2.0
        (True, 1, True)
    """

    def __init__(
        self,
        count: int,
        *,
        every_s: float,
        every_steps: float,
        steps: int,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        rng = rng if rng is not None else random.Random()
        self.count = count
        self.clock = clock
        self.slot_s = every_s / count
        self.slot_steps = every_steps / count
        self.next_fragment = rng.randrange(count)
        self.phase_s = rng.uniform(0, self.slot_s) if math.isfinite(self.slot_s) else math.inf
        self.origin = clock()
        self.slot = 0  # due_time = origin + phase_s + slot * slot_s: always on this learner's grid
        self.taken = False  # whether a fold was taken yet (slots before the first are not made up)
        self.due_step = steps + self.slot_steps

    @property
    def due_time(self) -> float:
        """When the next fold is due by time (on ``clock``)."""
        return self.origin + self.phase_s + self.slot * self.slot_s if math.isfinite(self.slot_s) else math.inf

    def due(self, steps: int) -> bool:
        """Whether a fold is due at ``steps`` (the learner's step count) or now."""
        return steps >= self.due_step or self.clock() >= self.due_time

    def take(self, steps: int, span_s: float = 0.0) -> list[int]:
        """The fragments to exchange now, and the schedule moved past them.

        By time: one fragment per slot; every slot that came since the previous take is due
        (a job that ran long, a step longer than a slot), each fragment at most once, and the
        next is the first slot of this learner's grid after now. A group starts exchanges only
        at its word steps: there the slots of the ``span_s`` seconds since the previous word
        step are all due too, from its first. By steps: every fragment whose slot has come, so
        that ``every_steps`` exchanges the whole model.
        """
        due = 1
        if steps >= self.due_step:
            due = min(self.count, 1 + int((steps - self.due_step) / self.slot_steps))
        now = self.clock()
        if math.isfinite(self.slot_s) and self.due_time <= now:
            came = now - self.due_time if self.taken else min(now - self.due_time, span_s)
            due = max(due, min(self.count, 1 + int(came / self.slot_s)))
        self.taken = True
        self.due_step += due * self.slot_steps
        if self.due_time <= now:
            self.slot = math.floor((now - self.origin - self.phase_s) / self.slot_s) + 1
        first, self.next_fragment = self.next_fragment, (self.next_fragment + due) % self.count
        return [(first + i) % self.count for i in range(due)]
