"""``QueueGuard``: the Session's side of its learner's ``FoldGate`` (what it may still fold).

The queue of the same learner in this process counts a batch as done only once a fold holds it
(``gradientmail.fold_gate``). So a fold must not land what the queue leaves to be trained again:

- right before each write of a fold (its create, its pending contribution) the queue checks that
  no peer took its units over (``LeaseLostError`` otherwise): when the fold holds batches whose
  records are not written yet, by beating the learner's lease (``FoldGate.confirm_owner``: one
  read and one compare-and-swap, whatever the number of units), so that a peer that judged this
  node dead while it was merely slow (its lease record late) cannot fence the lease and take a
  unit over until the fold has landed; and after a pause of half a lease or more since the last
  step, the snapshot, or the last check, by reading the lease (a process frozen past its lease).
  With ``lease=`` only;
- once the queue stopped without recording every batch (an error, a replaced process), the
  Session folds nothing more (``revoke``): those batches go back to the run's units.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from gradientmail.errors import SessionError
from gradientmail.fold_gate import FoldGate, SessionLink, UnitMark

__all__ = ["QueueGuard"]


class QueueGuard:
    """Tells the Session's folds whether they may still land; one per entered Session."""

    def __init__(self, gate: FoldGate, learner_id: str) -> None:
        self.gate = gate
        self.learner_id = learner_id
        self.link: SessionLink | None = None
        self.revoked = False  # the queue stopped uncleanly: fold nothing more
        self.stepped_at = time.monotonic()  # the training thread's last step
        self._snapshot_at = 0.0  # when the fold under way took its snapshot (time.monotonic())
        self._checked_at = 0.0  # when the queue last found this learner's units its own
        self._marked = False  # the fold under way holds batches whose records are not written

    def attach(
        self,
        sync: Callable[[], None],
        fragments: int,
        wait_for_fold: Callable[[], None],
        joined: Sequence[Sequence[UnitMark]],
    ) -> None:
        """Join the gate: ``sync`` folds everything now; ``wait_for_fold`` waits for a fold under
        way; ``joined``: this learner's unit marks per fragment in the state the Session joined from."""

        def revoke() -> None:
            self.revoked = True
            wait_for_fold()

        self.link = self.gate.attach(sync, fragments, revoke, joined)
        self.stepped_at = time.monotonic()

    def detach(self, *, release: bool) -> None:
        if self.link is not None:
            self.gate.detach(self.link, release=release)

    def stepped(self) -> None:
        """A training step: if the loop stood still half a lease, check the units are still ours."""
        now = time.monotonic()
        stood_still, self.stepped_at = now - self.stepped_at, now
        if stood_still >= self.gate.pause_limit_s:
            self.gate.check_owner()

    def snapshot(self) -> tuple[int, tuple[UnitMark, ...], float]:
        """``(mark, unit marks, since)`` for a snapshot taken now; ``since``: when its batches
        were last known trained by a live process (the last step)."""
        assert self.link is not None
        mark, marks = self.link.snapshot()
        self._marked = bool(marks)
        return mark, tuple(marks.values()), min(time.monotonic(), self.stepped_at)

    def fold_started(self, since: float) -> None:
        """A fold job of a snapshot (``snapshot()``'s ``since``) starts on the exchange thread."""
        self._snapshot_at = since
        if time.monotonic() - since >= self.gate.pause_limit_s:
            self.gate.check_owner()

    def before_write(self, listed: float) -> None:
        """Right before a fold writes (its create, or its pending contribution): see the module."""
        if self.revoked:
            raise SessionError(
                f"learner {self.learner_id!r}: its queue stopped without recording its last batches "
                "(they are trained again by whoever continues its units); this fold would count them twice"
            )
        since = max(min(listed, self._snapshot_at), self._checked_at)
        if self._marked:
            self.gate.confirm_owner()
            self._checked_at = time.monotonic()
        elif time.monotonic() - since >= self.gate.pause_limit_s:
            self.gate.check_owner()
            self._checked_at = time.monotonic()
