"""How the exchanged state is cut into fragments: contiguous ranges of the flattened parameters.

Each fragment is its own chain on the store (``session.chain``), exchanged on its own staggered
schedule, so that no single object serialises the run's folds, each transfer is a fraction of the
model and the bytes a node moves are spread over the interval (as Streaming DiLoCo's fragments).
Every node cuts the same model the same way: the cut depends only on the entries' names, sizes
and order in ``state_dict`` and on the fragment count, and each stored fragment names its pieces,
so a node with another cut is refused instead of mixing two layouts.

Example:
    >>> import torch
    >>> plan = FragmentPlan.of(torch.nn.Linear(3, 2), fragments=2)
    >>> [[(p.name, p.start, p.stop) for p in f.pieces] for f in plan.fragments]
    [[('weight', 0, 4)], [('weight', 4, 6), ('bias', 0, 2)]]
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from gradientmail.session.mail import Spec

# -- the model's exchanged state ----------------------------------------------------------------
WRAPPERS = 8
"""Most wrappers ``plain_module`` looks through (compile of DDP of a module is 2)."""


def plain_module(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside ``torch.compile`` and ``(Distributed)DataParallel`` wrappers.

    Their ``state_dict`` names carry a prefix (``_orig_mod.``, ``module.``) that the same model
    unwrapped, on another node or in ``consensus``, does not: the run exchanges the plain names.
    """
    for _ in range(WRAPPERS):
        inner = getattr(model, "_orig_mod", None)  # torch.compile's OptimizedModule
        if inner is None and isinstance(model, (torch.nn.DataParallel, torch.nn.parallel.DistributedDataParallel)):
            inner = model.module
        if not isinstance(inner, torch.nn.Module):
            return model
        model = inner
    return model


def float_state(model: torch.nn.Module) -> dict[str, Tensor]:
    """The model's floating-point ``state_dict`` entries, live, each storage only once, under the
    names of the plain module (``plain_module``: compiled or DDP-wrapped, the same names).

    Parameters and float buffers are exchanged; integer buffers (``num_batches_tracked``) stay
    local. Of a sharded entry (a ``DTensor``: FSDP2) only this rank's shard is live here. A tied weight appears under several names in ``state_dict``; only the first is kept
    so that progress is applied to it once.
    """
    seen: set[tuple] = set()
    entries: dict[str, Tensor] = {}
    for name, tensor in plain_module(model).state_dict(keep_vars=False).items():
        if not isinstance(tensor, Tensor) or not tensor.is_floating_point():
            continue
        tensor = local_shard(tensor)
        alias = (tensor.device, tensor.data_ptr(), tuple(tensor.shape), tensor.stride(), tensor.dtype)
        if tensor.numel() and alias in seen:
            continue
        seen.add(alias)
        entries[name] = tensor
    return entries


def local_shard(tensor: Tensor) -> Tensor:
    """This rank's shard of a sharded tensor (a ``DTensor``: FSDP2), else ``tensor`` itself.

    No tensor is a ``DTensor`` before ``torch.distributed.tensor`` is imported; importing it
    here would add half a second to every import of this package.
    """
    module = sys.modules.get("torch.distributed.tensor")
    if module is not None and isinstance(tensor, module.DTensor):
        return tensor.to_local()
    return tensor


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Sums of half-precision tensors are kept in float32; float32/float64 stay as they are."""
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def widen(tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Tensors as stored, copied into the dtype sums are taken in (float32, or float64 as it is)."""
    return {name: t.to(accumulation_dtype(t.dtype), copy=True) for name, t in tensors.items()}


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


def spec_of(tensors: Mapping[str, Tensor], wire_dtype: torch.dtype | None = None) -> Spec:
    """What a state of this model holds: each entry's shape, in the dtype it travels in."""
    return {name: (tuple(t.shape), wire_dtype or accumulation_dtype(t.dtype)) for name, t in tensors.items()}


# -- the cut ----------------------------------------------------------------------------------------
FRAGMENT_BYTES = 64 * 1024
"""Smallest fragment (as stored in float32) chosen automatically: below it a fold's cost is the
store's latency, and more fragments only add requests."""
MAX_AUTO_FRAGMENTS = 16
"""The most fragments chosen automatically (each costs a few requests per interval); a larger
model gets larger fragments. ``Session(fragments=...)`` sets any count up to ``MAX_FRAGMENTS``."""
MAX_FRAGMENTS = 1024


def auto_fragments(elements: int) -> int:
    """The fragment count for a model of ``elements`` exchanged values: one per 64 KiB of
    float32 state, at most 16.

    Example:
        >>> auto_fragments(6), auto_fragments(40_000), auto_fragments(1_000_000)
        (1, 3, 16)
    """
    return max(1, min(MAX_AUTO_FRAGMENTS, math.ceil(elements * 4 / FRAGMENT_BYTES)))


@dataclass(frozen=True)
class Piece:
    """``[start, stop)`` of the flattened entry ``name``."""

    name: str
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Fragment:
    """One fragment: its index and the pieces of the model it holds, in order."""

    index: int
    pieces: tuple[Piece, ...]

    @property
    def spec(self) -> Spec:
        """What a stored version of this fragment holds: one 1-D tensor per piece."""
        return {piece.name: ((piece.size,), None) for piece in self.pieces}

    @property
    def size(self) -> int:
        return sum(piece.size for piece in self.pieces)

    def slices(self, model: torch.nn.Module) -> dict[str, Tensor]:
        """The live values of this fragment (views where the entry is contiguous, else copies)."""
        live = float_state(model)
        return {piece.name: _flat(live[piece.name])[piece.start : piece.stop] for piece in self.pieces}

    def snapshot_into(self, buffers: dict[str, Tensor], model: torch.nn.Module) -> dict[str, Tensor]:
        """This fragment's values copied to the CPU, into ``buffers`` (reused from call to call).

        Reusing the buffers avoids fresh (page-faulting) allocations, which cost more than the copy.
        """
        for name, values in self.slices(model).items():
            buffer = buffers.get(name)
            if buffer is None or buffer.shape != values.shape or buffer.dtype != values.dtype:
                pin = values.device.type == "cuda"  # page-locked: a faster copy from the GPU
                buffer = buffers[name] = torch.empty(values.shape, dtype=values.dtype, pin_memory=pin)
            buffer.copy_(values.detach())
        return buffers

    def add_into(self, model: torch.nn.Module, delta: Mapping[str, Tensor]) -> None:
        """Add ``delta`` (this fragment's pieces) to the live model: local progress made meanwhile stays."""
        self._write(model, delta, Tensor.add_)

    def load_into(self, model: torch.nn.Module, values: Mapping[str, Tensor]) -> None:
        """Overwrite the live model's pieces of this fragment with ``values``."""
        self._write(model, values, Tensor.copy_)

    def _write(
        self, model: torch.nn.Module, values: Mapping[str, Tensor], op: Callable[[Tensor, Tensor], Tensor]
    ) -> None:
        live = float_state(model)
        with torch.no_grad():
            for piece in self.pieces:
                target = live[piece.name]
                value = values[piece.name].to(device=target.device, dtype=target.dtype)
                if target.is_contiguous():
                    op(target.view(-1)[piece.start : piece.stop], value)
                else:  # rare (a transposed parameter): through a flat copy
                    flat = target.flatten()
                    op(flat[piece.start : piece.stop], value)
                    target.copy_(flat.view_as(target))


@dataclass(frozen=True)
class FragmentPlan:
    """The cut of a model's floating-point state into ``len(fragments)`` near-equal fragments.

    Attributes:
        fragments: the fragments, in index order; each holds the pieces of one contiguous range
            of all entries flattened one after another.
        dtypes: each entry's dtype as summed (float32, or float64 as it is).
    """

    fragments: tuple[Fragment, ...]
    dtypes: dict[str, torch.dtype]

    count: int = 0
    """How many fragments the run's state is cut into (0: ``len(fragments)``); more when this
    plan is one shard's (``session.shards``): its fragments' indices are then the run's."""
    shards: int = 1
    """How many shards the run's state is cut into first, each cut into fragments alike."""

    @classmethod
    def of(cls, model: torch.nn.Module, fragments: int | None = None) -> FragmentPlan:
        """Cut ``model``'s floating-point entries into ``fragments`` (None: ``auto_fragments``)."""
        entries = float_state(model)
        sizes = [(name, tensor.numel()) for name, tensor in entries.items()]
        total = sum(size for _, size in sizes)
        count = auto_fragments(total) if fragments is None else fragments
        count = max(1, min(count, total)) if total else 1
        dtypes = {name: accumulation_dtype(tensor.dtype) for name, tensor in entries.items()}
        return cls(tuple(Fragment(i, pieces) for i, pieces in enumerate(cut(sizes, count))), dtypes)

    @property
    def run_count(self) -> int:
        """How many fragments the run's state is cut into."""
        return self.count or len(self.fragments)

    def __len__(self) -> int:
        return len(self.fragments)

    def stored_spec(self, index: int, wire_dtype: torch.dtype | None) -> Spec:
        """Fragment ``index``'s spec with the dtype its tensors travel in."""
        return {
            piece.name: ((piece.size,), wire_dtype or self.dtypes[piece.name]) for piece in self.fragments[index].pieces
        }


def cut(sizes: list[tuple[str, int]], count: int, offsets: Mapping[str, int] | None = None) -> list[tuple[Piece, ...]]:
    """``count`` near-equal contiguous ranges of the entries ``sizes`` flattened one after another,
    each as its pieces; ``offsets`` moves each entry's pieces (a shard's place in its entry)."""
    total = sum(size for _, size in sizes)
    bounds = [total * i // count for i in range(count + 1)]
    pieces: list[list[Piece]] = [[] for _ in range(count)]
    offset = 0
    for name, size in sizes:
        shift = 0 if offsets is None else offsets[name]
        for index in range(count):
            start, stop = max(bounds[index], offset), min(bounds[index + 1], offset + size)
            if start < stop:
                pieces[index].append(Piece(name, start - offset + shift, stop - offset + shift))
        offset += size
    return [tuple(found) for found in pieces]


def _flat(tensor: Tensor) -> Tensor:
    return tensor.view(-1) if tensor.is_contiguous() else tensor.flatten()
