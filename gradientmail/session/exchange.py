"""The background side of a ``Session``: one worker thread that joins, folds progress and leaves.

The training thread (``session.core``) hands jobs to a ``Worker`` and applies their results at a
step boundary; everything that touches the mailbox runs here. Data flows one way: ``core``
imports this module, never the reverse.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from gradientmail.errors import GradientMailError, SessionError
from gradientmail.layout import progress_key
from gradientmail.mailbox.base import Mailbox, describe
from gradientmail.session.chain import active_learners, create_base, fold, read_newest
from gradientmail.session.mail import Contribution, Spec, State, accumulation_dtype, float_state, member_key
from gradientmail.session.outer import OuterOptimizer


class Job:
    """One unit of background work; the training thread polls ``done`` (an ``Event``).

    A failure is recorded in ``error`` and raised later on the training thread, never here.
    """

    __slots__ = ("fn", "done", "result", "error")

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.fn()
        except BaseException as exc:  # recorded here, raised on the training thread
            self.error = exc
        finally:
            self.fn = None
            self.done.set()


class Worker:
    """The one background thread of a session; runs jobs one at a time, in order.

    Example:
        >>> worker = Worker("example")
        >>> job = worker.submit(lambda: 6 * 7)
        >>> job.done.wait(5), job.result
        (True, 42)
        >>> worker.close(5)
    """

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        # Daemon: a store that never answers must not keep the interpreter alive at exit; every
        # wait on this thread is bounded by the session's timeout instead.
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            job.run()

    def submit(self, fn: Callable[[], Any]) -> Job:
        """Queue ``fn``; its ``Job`` says when it is done and what it returned or raised."""
        job = Job(fn)
        self._jobs.put(job)
        return job

    def close(self, timeout: float) -> None:
        """Stop after the queued jobs; wait at most ``timeout`` seconds for the thread."""
        self._jobs.put(None)
        self._thread.join(timeout)


def surface(error: BaseException, what: str) -> BaseException:
    """The exception to raise on the training thread for a background ``error`` of ``what``.

    ``GradientMailError``s are raised as themselves (with a note saying where), anything else
    wrapped in ``SessionError``.
    """
    where = f"raised by {what}"
    if isinstance(error, GradientMailError):
        if hasattr(error, "add_note") and where not in getattr(error, "__notes__", ()):
            error.add_note(where)
        return error
    wrapped = SessionError(f"{what} failed: {type(error).__name__}: {error}")
    wrapped.__cause__ = error
    return wrapped


def snapshot_into(buffers: dict[str, Tensor], model: torch.nn.Module) -> dict[str, Tensor]:
    """The model's floating-point entries copied to the CPU, into ``buffers`` (reused).

    Called with no exchange in flight, so the previous snapshot is free to overwrite; reusing it
    avoids fresh (page-faulting) allocations, which cost more than the copy.
    """
    for name, tensor in float_state(model).items():
        buffer = buffers.get(name)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            pin = tensor.device.type == "cuda"  # page-locked: a faster copy from the GPU
            buffer = buffers[name] = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pin)
        buffer.copy_(tensor.detach())
    return buffers


@dataclass(frozen=True)
class Merge:
    """A finished exchange, to apply on the training thread.

    Attributes:
        delta: the run's state after this fold minus the snapshot, per entry.
        weights: ``{learner: samples}`` newly folded into the run, this learner included.
    """

    delta: dict[str, Tensor]
    weights: dict[str, int]

    def apply_to(self, model: torch.nn.Module) -> None:
        """Add ``delta`` to the live model: local progress made meanwhile stays."""
        live = float_state(model)
        with torch.no_grad():
            for name, delta in self.delta.items():
                target = live[name]
                target.add_(delta.to(device=target.device, dtype=target.dtype))


class Exchanger:
    """One learner's exchanges with the run's state; its methods run on the worker thread only.

    Args:
        mailbox: the run's store.
        learner_id: this learner's name (one key segment).
        outer: how progress becomes a contribution (one state per session: momentum).
        wire_dtype: the dtype the state is stored in (``None``: float32/float64).
        catch_up: measure progress from the run's state (True) or this model's own (False).
        max_staleness_s: seconds after which a silent member stops counting in ``N``.
        timeout_s: the longest a fold may keep losing versions to other writers.
    """

    def __init__(
        self,
        mailbox: Mailbox,
        learner_id: str,
        *,
        outer: OuterOptimizer,
        wire_dtype: torch.dtype | None,
        catch_up: bool,
        max_staleness_s: float,
        timeout_s: float,
    ) -> None:
        self.mailbox = mailbox
        self.learner_id = learner_id
        self.spec: Spec = {}
        """What a state of this model holds (``mail.spec_of``), set on enter."""
        self.wire_dtype = wire_dtype
        self.catch_up = catch_up
        self.max_staleness_s = max_staleness_s
        self.timeout_s = timeout_s
        self.known: State | None = None
        """The newest version of the run's state this learner holds."""
        self.conflicts = 0
        """Versions lost to other writers so far."""
        self._outer_state = outer.start()
        self._anchor: dict[str, Tensor] = {}  # where this learner's local progress is measured from
        self._member: str | None = None
        self._active = 1  # N when the previous fold (or joining) happened

    def enter(self, spec: Spec, initial: dict[str, Tensor]) -> tuple[State, Contribution | None]:
        """Join the run: its newest state (creating the base if none) and this learner's line in it."""
        mailbox, me = self.mailbox, self.learner_id
        self.spec = spec
        state, listing = read_newest(mailbox, self.spec)
        if state is None:
            state = create_base(mailbox, self.spec, initial, me)
        self._member = member_key(me, time.time())
        mailbox.put(self._member, json.dumps({"learner": me, "joined": time.time()}).encode())
        for key in listing.member_keys.get(me, []):  # an earlier incarnation's, if any
            if key != self._member:
                mailbox.delete(key)
        self.known = state
        self._anchor = widen(state.tensors) if self.catch_up else initial
        self._active = len(active_learners(listing, state.header, me, time.time(), self.max_staleness_s))
        return state, state.header.learners.get(me)

    def exchange(
        self, snapshot: dict[str, Tensor], totals: tuple[int, int, int], progress: dict[str, Any], final: bool
    ) -> Merge:
        """Fold the progress in ``snapshot`` into the run; ``totals`` is ``(seq, steps, samples)``."""
        mailbox, me = self.mailbox, self.learner_id
        seq, steps, samples = totals
        anchor = self._anchor
        local = {name: snapshot[name].to(anchor[name].dtype) - anchor[name] for name in anchor}
        for name, tensor in local.items():  # never spread a diverged model to every node
            if not bool(torch.isfinite(tensor).all()):
                raise SessionError(
                    f"learner {me!r}: this node's own parameters hold NaN or Inf in {name!r} "
                    "(local training diverged: lower the learning rate, clip gradients); nothing "
                    "was folded into the run, whose state stays finite"
                )
        wire = self.wire_dtype

        def add(base: Mapping[str, Tensor], increment: Mapping[str, Tensor]) -> dict[str, Tensor]:
            return {name: to_wire(base[name].to(increment[name].dtype) + increment[name], wire) for name in increment}

        done = fold(
            mailbox,
            self.spec,
            me=me,
            known=self.known,
            increment_for=lambda active: self._outer_state(local, self._scale_for(active)),
            entry=lambda header: Contribution(seq=seq, step=steps, samples=samples, time=time.time(), final=final),
            add=add,
            max_staleness=self.max_staleness_s,
            deadline=time.monotonic() + self.timeout_s,
        )
        self.conflicts += done.conflicts
        before = self.known.header.learners if self.known is not None else {}
        self.known = done.state
        self._anchor = widen(done.state.tensors)
        delta = {name: self._anchor[name] - snapshot[name].to(self._anchor[name].dtype) for name in self._anchor}
        weights = {}
        for learner, entry in done.state.header.learners.items():
            old = before.get(learner)
            gained = entry.samples - (old.samples if old is not None else 0)
            if gained > 0 or (learner == me and gained >= 0):
                weights[learner] = gained
        if final:
            self.leave()
        self.put_progress(progress)
        return Merge(delta=delta, weights=weights)

    def _scale_for(self, active: int) -> int:
        """``N`` for progress made since the previous fold: the larger of then and now.

        Never overshoots: progress made among four learners still counts 1/4 after the others
        left, and a learner that just joined does not yet inflate the others' contributions.
        """
        scale = max(active, self._active)
        self._active = active
        return scale

    def leave(self) -> None:
        """Delete this learner's member key, so peers stop counting it in ``N``."""
        if self._member is not None:
            self.mailbox.delete(self._member)
            self._member = None

    def put_progress(self, progress: dict[str, Any]) -> None:
        """Write this learner's progress record (what ``gradientmail status`` shows)."""
        record = dict(progress, units=units_claimed(self.learner_id))
        spans = unit_spans(describe(self.mailbox), self.learner_id)
        if spans is not None:  # when and for how long this learner trained its recent units
            record["unit_spans"] = spans
        self.mailbox.put(progress_key(self.learner_id), json.dumps(record).encode())


def units_claimed(learner_id: str) -> int | None:
    """Units this learner claimed, from this process's shared queue when it has one, else None."""
    try:
        from gradientmail.queue.counter import units_claimed_by
    except (ImportError, AttributeError):
        return None
    try:
        units = units_claimed_by(learner_id)
    except Exception:  # a status field must never fail an exchange
        return None
    if isinstance(units, bool):
        return None
    if isinstance(units, int):
        return units
    try:
        return len(units)
    except TypeError:
        return None


def unit_spans(store: str, learner_id: str) -> dict[str, Any] | None:
    """The recent units' training spans timed by this process's shared queue, or None."""
    try:
        from gradientmail.queue.unit_timing import spans_record

        return spans_record(store, learner_id)
    except Exception:  # a display aid must never fail an exchange
        return None


def widen(tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Tensors as stored, in the dtype sums are taken in (float32, or float64 as it is)."""
    return {name: t.to(accumulation_dtype(t.dtype)) for name, t in tensors.items()}


def to_wire(tensor: Tensor, wire: torch.dtype | None) -> Tensor:
    """``tensor`` in the dtype it is stored in; bfloat16 is rounded stochastically (unbiased).

    Round-to-nearest would drop every contribution under half a bfloat16 step of the weight;
    random low bits added before truncating keep each one in expectation.

    Example:
        >>> to_wire(torch.ones(3), torch.bfloat16).dtype
        torch.bfloat16
    """
    if wire is None or wire == tensor.dtype:
        return tensor
    if wire == torch.bfloat16 and tensor.dtype == torch.float32:
        bits = tensor.contiguous().view(torch.int32)
        noise = torch.randint(0, 1 << 16, tensor.shape, dtype=torch.int32)
        return ((bits + noise) & -65536).view(torch.float32).to(torch.bfloat16)
    return tensor.to(wire)
