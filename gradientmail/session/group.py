"""One learner made of a ``torch.distributed`` group: its rank 0 exchanges, every rank applies together.

With DDP inside a group every rank holds the same parameters, so the group needs the store
only once: its rank 0 runs the Session's exchanges, the other ranks never touch the mailbox.
Every few steps (a *word step*), ``step()`` starts one small all-reduce (the ranks' samples
since the last word, summed, and rank 0's word on whether an exchange finished and which
fragments it changed) and reads the previous word, which ran while the steps between trained;
when that word says an exchange finished, rank 0 applies it and broadcasts those fragments, so
every rank moves to the same parameters at the same step boundary and no rank ever waits on
the store or on a collective of its own step. The steps between words cost a counter: rank 0
measures what a word costs against a training step and spaces the words (``WordPace``) so that
they take a constant, small share of the training time; each word says the spacing after the
next, so every rank knows the word steps in advance without asking.

An error rank 0 finds (a failed exchange, a ``wait()`` past its timeout, a lost lease) travels
in that word too, so every rank raises it at the same step (the next word step). A rank that
fails alone cannot say so: the others' next collective fails (at once when its process is
gone, after the group's timeout when it stands still) and raises ``GroupError``; once one
collective failed, every later one of the group raises at once rather than wait it out again.
"""

from __future__ import annotations

import collections
import contextlib
import math
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple, TypeVar

import torch
from torch import Tensor

from gradientmail.errors import GradientMailError, GroupError
from gradientmail.session.fragments import Fragment

__all__ = [
    "APPLY",
    "FAILED",
    "LEASE_LOST",
    "NOTHING",
    "TIMED_OUT",
    "GroupSync",
    "PendingStep",
    "StepWord",
    "WordPace",
    "keep",
]

T = TypeVar("T")

_RECENT_WORKS: collections.deque[Any] = collections.deque(maxlen=8)
"""The last collectives this process started on its groups, kept referenced from Python.

Why: gloo's worker thread drops its reference to a finished collective just after waking the
rank that waits for it. Were that the last reference, the worker would free the collective's
tensors there and need the GIL for their Python objects; a ``DistributedDataParallel`` freed
after ``dist.destroy_process_group()`` (at the end of a script's ``main``, say) destroys the
group while holding the GIL and joins that very thread: the process would hang at exit. Kept
here, the worker's reference is never the last; a work leaves this queue on the thread that
trains, eight collectives later, or at interpreter exit."""


def keep(work: Any) -> Any:
    """``work`` (a collective started with ``async_op=True``), kept among ``_RECENT_WORKS``."""
    _RECENT_WORKS.append(work)
    return work


NOTHING, APPLY, FAILED = 0, 1, 2
"""Rank 0's word at a step: nothing finished; an exchange finished (apply its fragments); it
finished with an error (apply what landed, then every rank raises)."""
TIMED_OUT, LEASE_LOST = 1, 2
"""Rank 0's stop at a step (besides its word): ``wait()`` ran past its timeout; the queue's
lease was lost (peers took its units over). Every rank raises at that step."""


class StepWord(NamedTuple):
    """What one step's collective agreed on, the same on every rank of the group."""

    samples: int
    """The samples every rank reported since the previous word, summed: the group's steps."""
    status: int
    """``NOTHING``, ``APPLY`` or ``FAILED``, as rank 0 said."""
    stop: int
    """``NOTHING``, ``TIMED_OUT`` or ``LEASE_LOST``: rank 0 raises an error, every rank with it."""
    fragments: tuple[int, ...]
    """The fragments rank 0 applied and now broadcasts (with ``APPLY`` and ``FAILED``)."""
    every: int = 1
    """Steps from the word step that reads this word to the next word step (rank 0's pace)."""


class WordPace:
    """How many steps apart rank 0 asks for the group's words: few enough that they cost a
    constant ``budget`` share of the training time, a word at least every ``limit`` steps.

    A word step costs its collective (starting it, reading the previous one) on the training
    thread; the steps between cost nothing. Rank 0 measures both, smoothed, and asks for
    ``ceil(word cost / (budget * step time))`` steps: a model whose step is long next to the
    collective (a large model on GPUs) gets a word every step, a small fast one every few.
    Errors and merges reach the ranks at word steps, so ``limit`` bounds their delay.
    """

    SMOOTHING = 0.25

    def __init__(self, budget: float = 0.005, limit: int = 64) -> None:
        self.budget = budget
        self.limit = limit
        self._cost: float | None = None  # seconds a word step spends in its collective
        self._step: float | None = None  # seconds from one step() to the next
        self._last: tuple[float, int] | None = None  # the last word step: (clock, steps)

    def spent(self, cost_s: float, began: float, steps: int) -> None:
        """A word step at ``steps`` began at ``began`` (``time.perf_counter``) and spent ``cost_s``."""
        self._cost = self._smooth(self._cost, cost_s)
        if self._last is not None and steps > self._last[1]:
            self._step = self._smooth(self._step, (began - self._last[0]) / (steps - self._last[1]))
        self._last = (began, steps)

    def every(self) -> int:
        """Steps between the word steps asked for now (1 until both are measured)."""
        if self._cost is None or not self._step:
            return 1
        return max(1, min(self.limit, math.ceil(self._cost / (self.budget * self._step))))

    def _smooth(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.SMOOTHING * (new - old)


class PendingStep:
    """One step's all-reduce in flight; ``word()`` waits for it (once) and reads it."""

    def __init__(self, sync: GroupSync, work: Any, tensor: Tensor) -> None:
        self._sync = sync
        self._work = work
        self._tensor = tensor
        self._word: StepWord | None = None
        self.counted = False
        """Its samples are in the Session's count (the word is read more than once at most)."""

    def word(self) -> StepWord:
        if self._word is None:
            self._sync.collective("the step's word", self._work.wait)
            summed = self._tensor.tolist()
            fragments = tuple(i for i, flag in enumerate(summed[4:]) if flag)
            self._word = StepWord(summed[0], summed[1], summed[2], fragments, max(1, summed[3]))
        return self._word

    def settle(self) -> None:
        """Wait for it, whatever happens (leaving after an error): nothing of the group stays in
        flight once the Session has left, so tearing the group down right after is safe."""
        if self._word is None and self._sync.broken is None:
            with contextlib.suppress(GradientMailError, RuntimeError):
                self.word()


class GroupSync:
    """The collectives that keep the ranks of one group one learner.

    Every method is a collective: every rank of the group calls it, in the same order.

    Args:
        group: the ranks training one model in lockstep (DDP), a ``torch.distributed``
            process group this process belongs to. Its device: CUDA for NCCL, the CPU otherwise.

    It holds the group weakly: once the Session or queue has left, nothing of it keeps the
    process group alive, so ``dist.destroy_process_group()`` destroys it then and there (a
    group left to die at interpreter exit can abort the process there).

    Raises:
        ValueError: ``torch.distributed`` is not initialised, or this process is not in ``group``.
    """

    def __init__(self, group: Any) -> None:
        import torch.distributed as dist  # only a group needs it

        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("group= needs torch.distributed initialised (dist.init_process_group) first")
        rank = dist.get_rank(group)
        if rank < 0:
            raise ValueError("this process is not a member of the group it was given")
        self._group = weakref.ref(group)
        self.rank = rank
        self.size = dist.get_world_size(group)
        backend = str(dist.get_backend(group)).lower()
        self.device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else torch.device("cpu")
        self._dist = dist
        self.broken: str | None = None
        """What failed first, once a collective of the group failed: later ones raise at once."""

    @property
    def group(self) -> Any:
        """The process group, while it exists."""
        group = self._group()
        if group is None:
            raise GroupError(
                f"rank {self.rank} of a group of {self.size}: its process group was destroyed while a "
                "Session or queue of it was still in use; call dist.destroy_process_group() after "
                "leaving their `with` blocks",
                rank=self.rank,
                size=self.size,
            )
        return group

    def collective(self, what: str, action: Callable[[], T]) -> T:
        """``action()``, a collective of the group; its failure raised as ``GroupError``."""
        if self.broken is not None:
            raise self._error(f"{what}: the group already failed ({self.broken})")
        try:
            return action()
        except RuntimeError as error:  # gloo's and NCCL's errors (DistBackendError) alike
            self.broken = f"{what}: {str(error).splitlines()[0] if str(error) else type(error).__name__}"
            raise self._error(self.broken) from error

    def _error(self, detail: str) -> GroupError:
        return GroupError(
            f"rank {self.rank} of a group of {self.size}: {detail}. Another rank of the group failed, "
            "was killed or stood still past the group's timeout (init_process_group(timeout=)); its own "
            "error is in its log. The group stops as one learner; restart it whole (resume=True "
            "continues its units where the run's state ends)",
            rank=self.rank,
            size=self.size,
        )

    @property
    def leads(self) -> bool:
        """This rank talks to the store for the group (its rank 0)."""
        return self.rank == 0

    def agree(self, value: str) -> str:
        """Rank 0's ``value`` (a learner id) on every rank."""
        encoded = value.encode() if self.leads else b""
        (length,) = self.announce([len(encoded)])
        tensor = torch.zeros(length, dtype=torch.uint8, device=self.device)
        if self.leads:
            tensor.copy_(torch.frombuffer(bytearray(encoded), dtype=torch.uint8))
        self.broadcast("agreeing on the learner id", tensor)
        return bytes(tensor.cpu().tolist()).decode()

    def announce(self, words: Sequence[int]) -> list[int]:
        """Rank 0's ``words`` (int64) on every rank; the others pass as many placeholders."""
        tensor = torch.tensor(list(words), dtype=torch.int64, device=self.device)
        self.broadcast("rank 0's word", tensor)
        return tensor.tolist()

    def broadcast(self, what: str, tensor: Tensor) -> None:
        """Rank 0's ``tensor`` into every rank's (``keep`` says why it is started async)."""
        self.collective(
            what, lambda: keep(self._dist.broadcast(tensor, group=self.group, group_src=0, async_op=True)).wait()
        )

    def start(
        self, samples: int, status: int, fragments: Iterable[int], count: int, stop: int = NOTHING, every: int = 0
    ) -> PendingStep:
        """Start one word's all-reduce of ``[samples, status, stop, every, a flag per fragment]``, summed.

        Only rank 0 passes a ``status``, ``stop``, ``fragments`` and ``every``; the others pass
        ``NOTHING``, none and 0. It runs while the next steps train: waiting for it then costs nothing.
        """
        words = [samples, status, stop, every] + [0] * count
        for index in fragments:
            words[4 + index] = 1
        tensor = torch.tensor(words, dtype=torch.int64, device=self.device)
        work = self.collective(
            "the step's word", lambda: keep(self._dist.all_reduce(tensor, group=self.group, async_op=True))
        )
        return PendingStep(self, work, tensor)

    def share(self, model: torch.nn.Module, fragments: Iterable[Fragment]) -> None:
        """Make ``fragments`` of every rank's ``model`` rank 0's: broadcast, piece by piece."""
        for fragment in fragments:
            values = fragment.slices(model)
            received: dict[str, Tensor] = {}
            for name, value in values.items():
                buffer = value if self.leads else value.detach().clone()
                buffer = buffer if buffer.is_contiguous() else buffer.contiguous()
                self.broadcast("broadcasting a merge", buffer)
                received[name] = buffer
            if not self.leads:
                fragment.load_into(model, received)
