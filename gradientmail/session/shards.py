"""Sharded state (FSDP2): each rank of a group exchanges its own shard, cut into fragments.

A model sharded with ``torch.distributed.fsdp.fully_shard`` holds each parameter as a
``DTensor`` split along its first dimension over a 1-D device mesh: rank ``r`` of ``S`` holds
rows ``[r * c, (r + 1) * c)`` (``c = ceil(rows / S)``, ``torch.chunk``'s rule), one contiguous
range of the flattened parameter. The run's state is then cut into ``S`` shards, and each
shard into ``F`` fragments alike: fragment ``r * F + j`` is the ``j``-th of shard ``r``, so
each rank reads and writes only its own fragments and no rank ever gathers the whole model.
Every header says ``S`` (``mail``), so a node that shards differently, or not at all, is
refused rather than mixing two cuts. The same cut is computed from any model's shapes, so
``consensus`` loads a sharded run into a plain model, or each rank's shard into a sharded one.

The ranks of a group stay one learner: rank 0 alone registers it (member key, presence,
progress record) and runs the queue; every rank folds its fragments under the group's learner
id with the group's sample count, summed at word steps beside the training (``ShardProgress``,
paced as ``session.group``'s words are), a sum that also tells rank 0 how far every shard
holds the group's batches. Every rank starts its folds at word steps only, where its count is exact.
"""

from __future__ import annotations

import contextlib
import math
import sys
from dataclasses import dataclass
from typing import Any

import torch

from gradientmail.errors import MailRejectedError
from gradientmail.session.chain import RunCut
from gradientmail.session.fragments import (
    MAX_FRAGMENTS,
    Fragment,
    FragmentPlan,
    accumulation_dtype,
    auto_fragments,
    cut,
    float_state,
    plain_module,
)
from gradientmail.session.group import NOTHING, GroupSync, StepWord, keep

__all__ = [
    "AheadFragments",
    "NoPresence",
    "PendingShardStep",
    "ShardLayout",
    "ShardProgress",
    "ShardSync",
    "plan_for_run",
    "shard_layout",
    "shard_plan",
]

Shapes = dict[str, tuple[int, ...]]


@dataclass(frozen=True)
class ShardLayout:
    """Where this process's shard sits: rank ``rank`` of ``shards`` along every entry's first dimension."""

    rank: int
    shards: int
    shapes: Shapes
    """Every floating-point entry's whole (unsharded) shape, in ``state_dict`` order."""


def shard_layout(model: torch.nn.Module) -> ShardLayout | None:
    """The sharding of ``model`` (None: no entry is a ``DTensor``, the model is plain).

    Raises:
        ValueError: a sharding this module cannot follow: an entry not sharded along its first
            dimension on a 1-D mesh (HSDP, tensor parallelism), a floating-point entry left
            replicated (a buffer), or entries on meshes of different sizes.
    """
    module = sys.modules.get("torch.distributed.tensor")
    if module is None:  # nothing can be a DTensor before its module is imported
        return None
    state = {
        name: tensor
        for name, tensor in plain_module(model).state_dict(keep_vars=False).items()
        if isinstance(tensor, torch.Tensor) and tensor.is_floating_point()
    }
    sharded = {name: t for name, t in state.items() if isinstance(t, module.DTensor)}
    if not sharded:
        return None
    plain = [name for name in state if name not in sharded]
    if plain:
        raise ValueError(
            f"a sharded model's floating-point entries must all be sharded (FSDP2), but {plain[:3]} "
            "are plain tensors on every rank (replicated buffers); make them parameters or integer buffers"
        )
    meshes = set()
    for name, tensor in sharded.items():
        mesh = tensor.device_mesh
        if mesh.ndim != 1 or tuple(tensor.placements) != (module.Shard(0),) or tensor.dim() == 0:
            raise ValueError(
                f"entry {name!r} is sharded as {tuple(tensor.placements)} on a {mesh.ndim}-D mesh; a Session "
                "follows shards along the first dimension on a 1-D mesh (fully_shard over the group)"
            )
        meshes.add((mesh.size(), mesh.get_local_rank()))
    if len(meshes) != 1:
        raise ValueError(f"the model's entries are sharded on different meshes {sorted(meshes)}")
    ((shards, rank),) = meshes
    return ShardLayout(rank=rank, shards=shards, shapes={name: tuple(t.shape) for name, t in sharded.items()})


def _shard_of(shapes: Shapes, shard: int, shards: int) -> tuple[list[tuple[str, int]], dict[str, int]]:
    """Shard ``shard``'s size of each entry and where it starts in the flattened entry."""
    sizes, offsets = [], {}
    for name, shape in shapes.items():
        rows = shape[0] if shape else 1
        per_row = math.prod(shape[1:]) if shape else 1
        chunk = -(-rows // shards)
        first = min(shard * chunk, rows)
        last = min(first + chunk, rows)
        sizes.append((name, (last - first) * per_row))
        offsets[name] = first * per_row
    return sizes, offsets


def per_shard(shapes: Shapes, shards: int, fragments: int | None) -> int:
    """How many fragments each shard is cut into: ``fragments`` (None: ``auto_fragments`` of
    a shard's size), at most the smallest shard's size and ``MAX_FRAGMENTS`` in all."""
    totals = [sum(size for _, size in _shard_of(shapes, shard, shards)[0]) for shard in range(shards)]
    if min(totals) == 0:
        raise ValueError(f"a shard of this model holds nothing (shard sizes {totals}): shard it over fewer ranks")
    count = auto_fragments(max(totals)) if fragments is None else fragments
    return max(1, min(count, min(totals), MAX_FRAGMENTS // shards))


def shard_plan(model: torch.nn.Module, layout: ShardLayout, fragments: int | None) -> FragmentPlan:
    """This rank's fragments: its shard of every entry cut into ``per_shard`` fragments, whose
    pieces index the local shards and whose indices are the run's."""
    count = per_shard(layout.shapes, layout.shards, fragments)
    local = float_state(model)
    sizes, _ = _shard_of(layout.shapes, layout.rank, layout.shards)
    for name, size in sizes:
        if local[name].numel() != size:
            raise ValueError(
                f"entry {name!r}: this rank holds {local[name].numel()} values, its shard along the "
                f"first dimension would hold {size} (a sharding other than fully_shard's?)"
            )
    first = layout.rank * count
    found = cut(sizes, count)
    return FragmentPlan(
        tuple(Fragment(first + j, pieces) for j, pieces in enumerate(found)),
        {name: accumulation_dtype(tensor.dtype) for name, tensor in local.items()},
        count=count * layout.shards,
        shards=layout.shards,
    )


def plan_for_run(model: torch.nn.Module, run: RunCut) -> FragmentPlan:
    """The plan that reads the run's state into ``model`` as the run cuts it: this rank's
    fragments of a sharded model, every fragment of every shard of a plain one.

    Raises:
        MailRejectedError: a sharded model sharded other than the run.
    """
    layout = shard_layout(model)
    if layout is not None:
        if layout.shards != run.shards:
            raise MailRejectedError(
                f"the run's state is cut into {run.shards} shard(s), this model into {layout.shards}: "
                "load it into a model sharded over as many ranks, or into a plain model"
            )
        return shard_plan(model, layout, run.fragments // run.shards)
    if run.shards == 1:
        return FragmentPlan.of(model, run.fragments)
    entries = float_state(model)
    shapes = {name: tuple(tensor.shape) for name, tensor in entries.items()}
    count = run.fragments // run.shards
    fragments = []
    for shard in range(run.shards):
        sizes, offsets = _shard_of(shapes, shard, run.shards)
        found = cut(sizes, count, offsets)
        fragments.extend(Fragment(shard * count + j, pieces) for j, pieces in enumerate(found))
    dtypes = {name: accumulation_dtype(tensor.dtype) for name, tensor in entries.items()}
    return FragmentPlan(tuple(fragments), dtypes, count=run.fragments, shards=run.shards)


class ShardSync:
    """The few collectives of a sharded group's enter and exit (every rank calls each, in order)."""

    def __init__(self, sync: GroupSync) -> None:
        import torch.distributed as dist  # only a group needs it

        self.sync = sync  # holds the process group weakly
        self._dist = dist
        self.device = sync.device

    def least(self, *values: int) -> list[int]:
        """Each of ``values``, the smallest any rank passed."""
        tensor = torch.tensor(list(values), dtype=torch.int64, device=self.device)
        keep(self._dist.all_reduce(tensor, op=self._dist.ReduceOp.MIN, group=self.sync.group, async_op=True)).wait()
        return tensor.tolist()

    def all_ok(self, ok: bool) -> bool:
        """Whether every rank passed True (a rank that failed passes False, then raises)."""
        return bool(self.least(int(ok))[0])


class PendingShardStep:
    """One word's sum in flight, ``[samples, every, then each rank's held step in a slot of its
    own]``; ``word()`` waits for it (once) and reads it."""

    def __init__(self, work: Any, tensor: torch.Tensor, step: int) -> None:
        self._work = work
        self._tensor = tensor
        self.step = step
        """The step it was started at: its samples are the group's up to that step."""
        self._word: StepWord | None = None
        self.held: tuple[int, ...] = ()
        """Each rank's held step (``ShardProgress``), once read."""
        self.counted = False
        """Its samples are in the Session's count (the word is read more than once at most)."""

    def word(self) -> StepWord:
        if self._word is None:
            self._work.wait()
            summed = self._tensor.tolist()
            self.held = tuple(summed[2:])
            # No stop code: each rank exchanges alone. ``every``: rank 0's pace (``WordPace``).
            self._word = StepWord(summed[0], NOTHING, NOTHING, (), max(1, summed[1]))
        return self._word

    def settle(self) -> None:
        """Wait for it, whatever happens (leaving after an error): nothing of the group stays in
        flight once the Session has left, so tearing the group down right after is safe."""
        if self._word is None:
            with contextlib.suppress(RuntimeError):
                self.word()


class ShardProgress:
    """How far every rank's shard holds the group's steps, so that rank 0's folds never claim more.

    Rank 0's folds carry the queue's unit marks (where each unit stands), from which a restarted
    group continues its units; the other ranks fold on their own schedules. Every rank notes the
    step at which each of its fragments' landed folds was snapshotted; its *held* step is the
    smallest. The sum at each word step carries each rank's held step in a slot of its own, so
    rank 0 learns, one word later and without waiting, how far every shard holds the group's batches,
    and its folds carry the marks of that step (or of their own, if earlier) with that step's
    totals (``Contribution.marked``): a restarted group continues exactly there, and never skips
    a batch that some shard does not hold. What it trains again, a shard that already held it
    does not fold twice (``AheadFragments``).

    Args:
        group: the sharded group's ``GroupSync`` (the word steps' collective).
        held: per fragment of this rank's shard, the group's step its run state holds.
        step, samples: the group's totals on entering (every shard holds the run up to them).
        mark: rank 0's queue position then (its ``FoldGate`` mark), ``units`` its unit marks.
    """

    def __init__(
        self, group: GroupSync, held: list[int], step: int, samples: int, mark: int, units: tuple[Any, ...]
    ) -> None:
        import torch.distributed as dist  # only a group needs it

        self._dist = dist
        self.group = group
        self.rank, self.size = group.rank, group.size
        self._held = [max(step, h) for h in held]  # per own fragment: the step its newest landed fold holds
        # Rank 0: word step -> its marks then, and the group's samples up to it (once counted).
        self._at: dict[int, tuple[int, tuple[Any, ...], int | None]] = {step: (mark, units, samples)}
        self.reported = [step] * self.size  # rank 0: each rank's held step, as last read

    def landed(self, position: int, step: int) -> None:
        """A fold of own fragment ``position``, snapshotted at ``step``, landed (exchange thread)."""
        self._held[position] = max(self._held[position], step)

    def start(self, step: int, samples: int, every: int = 0) -> PendingShardStep:
        """Start one word's sum at ``step``: this rank's samples since the last and its held step
        (it runs beside the next steps); rank 0 also says ``every``, the steps between the word
        steps after."""
        words = [samples, every] + [0] * self.size
        words[2 + self.rank] = min(self._held)
        tensor = torch.tensor(words, dtype=torch.int64, device=self.group.device)
        work = keep(self._dist.all_reduce(tensor, group=self.group.group, async_op=True))
        return PendingShardStep(work, tensor, step)

    def stepped(self, step: int, mark: int, units: tuple[Any, ...]) -> None:
        """Rank 0: its queue position and unit marks at ``step`` (after that step's batch)."""
        self._at[step] = (mark, units, None)

    def read(self, pending: PendingShardStep, samples: int) -> None:
        """Rank 0: note every rank's held step from a sum already counted, and ``samples``,
        the group's samples up to the step it was started at."""
        entry = self._at.get(pending.step)
        if entry is not None:
            self._at[pending.step] = (entry[0], entry[1], samples)
        for rank, step in enumerate(pending.held):
            self.reported[rank] = max(self.reported[rank], step)
        floor = self._marked(min(self.reported[1:], default=0))
        for step in [s for s in self._at if s < floor]:
            del self._at[step]

    def safe(self, step: int, mark: int, units: tuple[Any, ...]) -> tuple[int, tuple[Any, ...], tuple[int, int] | None]:
        """Rank 0: the marks a fold snapshotted at ``step`` (now: ``mark``, ``units``) may carry:
        those of the latest step every other rank's shard holds, if earlier, with the group's
        totals at that step (None: its own step's marks)."""
        held = min([step, *self.reported[1:]])
        if held >= step:
            return mark, units, None
        at = self._marked(held)
        mark, units, samples = self._at[at]
        assert samples is not None
        return mark, units, (at, samples)

    def _marked(self, held: int) -> int:
        """The latest word step at most ``held`` whose marks and totals are known: a shard that
        holds ``held`` holds it (the step entered at is always known)."""
        return max(s for s, (_, _, samples) in self._at.items() if s <= held and samples is not None)


class AheadFragments:
    """This rank's fragments whose run state already holds steps its restarted group trains again.

    Each rank folds its own shard, so a group killed mid-run leaves fragments that hold its
    steps up to different points; the group restarts where its queue's marks stand (the
    earliest), and trains the batches after that again. A fragment that held them must not
    take them twice: it is not folded until the group is back at the step it holds, and at that
    step it is set back to the values it held on entering (the run's, which hold those batches
    once), dropping what training them again added here.

    Args:
        positions: per fragment position of this rank's plan, ``(step it holds, values read on
            entering)``, for those that hold a later step than the group restarts at.
    """

    def __init__(self, positions: dict[int, tuple[int, dict[str, torch.Tensor]]]) -> None:
        self._ahead = positions

    def __len__(self) -> int:
        return len(self._ahead)

    def foldable(self, positions: list[int]) -> list[int]:
        """Those of ``positions`` that may be folded now (not ahead of the group's step)."""
        return [p for p in positions if p not in self._ahead]

    def reached(self, step: int, plan: FragmentPlan, model: torch.nn.Module, *, leaving: bool = False) -> None:
        """The group is at ``step`` (``leaving``: it folds every fragment now, ahead or not):
        set each fragment ahead that it reached back to its values on entering."""
        for position in [p for p, (held, _) in self._ahead.items() if leaving or held <= step]:
            _, values = self._ahead.pop(position)
            plan.fragments[position].load_into(model, values)


class NoPresence:
    """The presence of a rank that does not register its learner (rank 0 of its group does)."""

    replaced = False

    def start(self) -> None:
        pass

    def check(self) -> None:
        pass

    def close(self) -> None:
        pass
