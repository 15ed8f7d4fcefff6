"""One learner made of a ``torch.distributed`` group: its rank 0 exchanges, every rank applies together.

With DDP inside a group every rank holds the same parameters, so the group needs the store
only once: its rank 0 runs the Session's exchanges, the other ranks never touch the mailbox.
Each ``step()`` starts one small all-reduce (the ranks' samples summed, and rank 0's word on
whether an exchange finished and which fragments it changed) and reads the previous step's,
which ran while this step trained; when that word says an exchange finished, rank 0 applies it
and broadcasts those fragments, so every rank moves to the same parameters at the same step
boundary and no rank ever waits on the store or on a collective of its own step.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from gradientmail.session.fragments import Fragment

__all__ = ["APPLY", "FAILED", "NOTHING", "GroupSync", "PendingStep", "StepWord"]

NOTHING, APPLY, FAILED = 0, 1, 2
"""Rank 0's word at a step: nothing finished; an exchange finished (apply its fragments); it
finished with an error (apply what landed, then every rank raises)."""


class StepWord(NamedTuple):
    """What one step's collective agreed on, the same on every rank of the group."""

    samples: int
    """The samples every rank reported for this step, summed: the group's step."""
    status: int
    """``NOTHING``, ``APPLY`` or ``FAILED``, as rank 0 said."""
    fragments: tuple[int, ...]
    """The fragments rank 0 applied and now broadcasts (with ``APPLY`` and ``FAILED``)."""


class PendingStep:
    """One step's all-reduce in flight; ``word()`` waits for it (once) and reads it."""

    def __init__(self, work: Any, tensor: Tensor) -> None:
        self._work = work
        self._tensor = tensor
        self._word: StepWord | None = None
        self.counted = False
        """Its samples are in the Session's count (the word is read more than once at most)."""

    def word(self) -> StepWord:
        if self._word is None:
            self._work.wait()
            summed = self._tensor.tolist()
            fragments = tuple(i for i, flag in enumerate(summed[2:]) if flag)
            self._word = StepWord(summed[0], summed[1], fragments)
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

    @property
    def leads(self) -> bool:
        """This rank talks to the store for the group (its rank 0)."""
        return self.rank == 0

    def agree(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank (a learner id: small and picklable)."""
        box = [value]
        self._dist.broadcast_object_list(box, group=self.group, group_src=0)
        return box[0]

    def announce(self, words: Sequence[int]) -> list[int]:
        """Rank 0's ``words`` (int64) on every rank; the others pass as many placeholders."""
        tensor = torch.tensor(list(words), dtype=torch.int64, device=self.device)
        self._dist.broadcast(tensor, group=self.group, group_src=0)
        return tensor.tolist()

    def start(self, samples: int, status: int, fragments: Iterable[int], count: int) -> PendingStep:
        """Start one step's all-reduce of ``[samples, status, one flag per fragment]``, summed.

        Only rank 0 passes a ``status`` and ``fragments``; the others pass ``NOTHING`` and none.
        It runs while the next step trains: waiting for it then costs nothing.
        """
        words = [samples, status] + [0] * count
        for index in fragments:
            words[2 + index] = 1
        tensor = torch.tensor(words, dtype=torch.int64, device=self.device)
        return PendingStep(self._dist.all_reduce(tensor, group=self.group, async_op=True), tensor)

    def share(self, model: torch.nn.Module, fragments: Iterable[Fragment]) -> None:
        """Make ``fragments`` of every rank's ``model`` rank 0's: broadcast, piece by piece."""
        for fragment in fragments:
            values = fragment.slices(model)
            received: dict[str, Tensor] = {}
            for name, value in values.items():
                buffer = value if self.leads else value.detach().clone()
                buffer = buffer if buffer.is_contiguous() else buffer.contiguous()
                self._dist.broadcast(buffer, group=self.group, group_src=0)
                received[name] = buffer
            if not self.leads:
                fragment.load_into(model, received)
