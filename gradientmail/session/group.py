"""One learner made of a ``torch.distributed`` group: its rank 0 exchanges, every rank applies together.

With DDP inside a group every rank holds the same parameters, so the group needs the store
only once: its rank 0 runs the Session's exchanges, the other ranks never touch the mailbox.
Each ``step()`` starts one small all-reduce (the ranks' samples summed, and rank 0's word on
whether an exchange finished and which fragments it changed) and reads the previous step's,
which ran while this step trained; when that word says an exchange finished, rank 0 applies it
and broadcasts those fragments, so every rank moves to the same parameters at the same step
boundary and no rank ever waits on the store or on a collective of its own step.

An error rank 0 finds (a failed exchange, a ``wait()`` past its timeout, a lost lease) travels
in that word too, so every rank raises it at the same step. A rank that fails alone cannot say
so: the others' next collective fails (at once when its process is gone, after the group's
timeout when it stands still) and raises ``GroupError``; once one collective failed, every
later one of the group raises at once rather than wait out the timeout again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple, TypeVar

import torch
from torch import Tensor

from gradientmail.errors import GroupError
from gradientmail.session.fragments import Fragment

__all__ = ["APPLY", "FAILED", "LEASE_LOST", "NOTHING", "TIMED_OUT", "GroupSync", "PendingStep", "StepWord"]

T = TypeVar("T")

NOTHING, APPLY, FAILED = 0, 1, 2
"""Rank 0's word at a step: nothing finished; an exchange finished (apply its fragments); it
finished with an error (apply what landed, then every rank raises)."""
TIMED_OUT, LEASE_LOST = 1, 2
"""Rank 0's stop at a step (besides its word): ``wait()`` ran past its timeout; the queue's
lease was lost (peers took its units over). Every rank raises at that step."""


class StepWord(NamedTuple):
    """What one step's collective agreed on, the same on every rank of the group."""

    samples: int
    """The samples every rank reported for this step, summed: the group's step."""
    status: int
    """``NOTHING``, ``APPLY`` or ``FAILED``, as rank 0 said."""
    stop: int
    """``NOTHING``, ``TIMED_OUT`` or ``LEASE_LOST``: rank 0 raises an error, every rank with it."""
    fragments: tuple[int, ...]
    """The fragments rank 0 applied and now broadcasts (with ``APPLY`` and ``FAILED``)."""


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
            fragments = tuple(i for i, flag in enumerate(summed[3:]) if flag)
            self._word = StepWord(summed[0], summed[1], summed[2], fragments)
        return self._word


class GroupSync:
    """The collectives that keep the ranks of one group one learner.

    Every method is a collective: every rank of the group calls it, in the same order.

    Args:
        group: the ranks training one model in lockstep (DDP), a ``torch.distributed``
            process group this process belongs to. Its device: CUDA for NCCL, the CPU otherwise.

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
        self.group = group
        self.rank = rank
        self.size = dist.get_world_size(group)
        backend = str(dist.get_backend(group)).lower()
        self.device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else torch.device("cpu")
        self._dist = dist
        self.broken: str | None = None
        """What failed first, once a collective of the group failed: later ones raise at once."""

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

    def agree(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank (a learner id: small and picklable)."""
        box = [value]
        self.collective(
            "agreeing on the learner id", lambda: self._dist.broadcast_object_list(box, group=self.group, group_src=0)
        )
        return box[0]

    def announce(self, words: Sequence[int]) -> list[int]:
        """Rank 0's ``words`` (int64) on every rank; the others pass as many placeholders."""
        tensor = torch.tensor(list(words), dtype=torch.int64, device=self.device)
        self.collective("rank 0's word", lambda: self._dist.broadcast(tensor, group=self.group, group_src=0))
        return tensor.tolist()

    def start(
        self, samples: int, status: int, fragments: Iterable[int], count: int, stop: int = NOTHING
    ) -> PendingStep:
        """Start one step's all-reduce of ``[samples, status, stop, one flag per fragment]``, summed.

        Only rank 0 passes a ``status``, ``stop`` and ``fragments``; the others pass ``NOTHING``
        and none. It runs while the next step trains: waiting for it then costs nothing.
        """
        words = [samples, status, stop] + [0] * count
        for index in fragments:
            words[3 + index] = 1
        tensor = torch.tensor(words, dtype=torch.int64, device=self.device)
        work = self.collective(
            "the step's word", lambda: self._dist.all_reduce(tensor, group=self.group, async_op=True)
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
                self.collective(
                    "broadcasting a merge", lambda b=buffer: self._dist.broadcast(b, group=self.group, group_src=0)
                )
                received[name] = buffer
            if not self.leads:
                fragment.load_into(model, received)
