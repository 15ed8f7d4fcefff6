"""Structured batches: a tensor, or tuples, lists and dicts of tensors nested to any depth.

Data libraries (torch's ``default_collate``, litdata, MosaicML streaming, webdataset) hand over
``(inputs, targets)`` tuples and ``{"input_ids": ..., "labels": ...}`` dicts, so ``load`` may
yield ``(step, batch)`` with ``batch`` of that shape. The queue checks every leaf where the
batch is made (``first_non_tensor``, so a mistake names its path, not a pickling failure in a
worker), moves small leaves inline (``gradientmail.queue.inline``) and DataLoader pins every
leaf (``pin_memory=True``); ``to_device`` moves a batch to the accelerator in the loop.
A plain tensor skips all of this: it is the common case and pays nothing extra.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, TypeAlias, TypeVar

import torch

__all__ = [
    "batch_size",
    "first_non_tensor",
    "map_tensors",
    "MAX_DEPTH",
    "TensorTree",
    "to_device",
]


TensorTree: TypeAlias = torch.Tensor | tuple["TensorTree", ...] | list["TensorTree"] | dict[Any, "TensorTree"]
"""A batch: a tensor, or tuples (namedtuples too), lists and dicts of batches."""

MAX_DEPTH = 32
"""Deepest nesting accepted; deeper is taken for a container that holds itself."""

T = TypeVar("T")

_CONTAINERS = (tuple, list, dict)


def map_tensors(batch: T, function: Callable[[torch.Tensor], Any]) -> T:
    """``batch`` with ``function`` applied to every tensor in it, other values kept.

    Containers are rebuilt, never changed in place (a loader may yield the same dict again),
    with their own type where it allows: namedtuples, ``OrderedDict``, ``defaultdict`` and other
    subclasses of tuple, list and dict; a subclass that cannot be rebuilt becomes the plain type.
    """
    return _map(batch, function, 0)


def to_device(batch: T, device: torch.device | str | int, non_blocking: bool = True) -> T:
    """``batch`` with every tensor moved to ``device`` (``tensor.to(device, non_blocking=...)``).

    ``non_blocking=True`` lets a copy from pinned memory (``shared_queue(..., pin_memory=True)``)
    overlap the computation already queued on the accelerator; from unpinned memory the copy is
    synchronous anyway. Pass ``non_blocking=False`` when copying back to the CPU and reading the
    values at once. Non-tensor values (a step number) are kept, so ``to_device((step, batch), d)``
    also works.
    """
    return _map(batch, lambda tensor: tensor.to(device, non_blocking=non_blocking), 0)


def batch_size(batch: TensorTree) -> int:
    """The samples in ``batch``: the leading dimension every tensor in it shares.

    For ``session.step(samples=...)``: ``len(batch)`` counts a dict's keys or a tuple's fields,
    not its rows. Raises ``ValueError`` when the tensors disagree (or one is a scalar) and
    ``TypeError`` for a leaf that is not a tensor, naming where: count such a batch yourself.

    Example:
        >>> batch_size({"input_ids": torch.zeros(8, 128), "labels": torch.zeros(8, 128)})
        8
        >>> batch_size((torch.zeros(4, 3), torch.zeros(4)))
        4
    """
    problem = first_non_tensor(batch)
    if problem is not None:
        raise TypeError(f"batch_size: {problem}; a batch is a tensor, or tuples, lists and dicts of tensors")
    sizes: set[int | None] = set()  # None: a scalar, which has no batch dimension
    _map(batch, lambda tensor: sizes.add(tensor.shape[0] if tensor.dim() else None), 0)
    if len(sizes) != 1 or None in sizes:
        found = ", ".join(sorted("a scalar" if size is None else str(size) for size in sizes)) or "no tensor"
        raise ValueError(
            f"batch_size: the tensors of this batch do not share a leading (batch) dimension ({found}); "
            "count its samples yourself"
        )
    (size,) = sizes
    assert size is not None
    return size


def first_non_tensor(batch: object, root: str = "batch") -> str | None:
    """Where ``batch`` is not a tensor or tuples, lists and dicts of tensors, or None if it is.

    Says so as ``"batch['labels'][1] is a str 'cat'"`` (the first such leaf, depth first;
    namedtuple fields by name: ``batch.targets``), ``"batch is a NoneType None"``, or that the
    nesting is deeper than ``MAX_DEPTH``. The check walks the batch once without building
    paths; paths are spelled out only for a batch that fails it.
    """
    if _valid(batch, 0):  # the common case, without building paths
        return None
    return _problem(batch, root, 0)


def _map(value: Any, function: Callable[[torch.Tensor], Any], depth: int) -> Any:
    if isinstance(value, torch.Tensor):
        return function(value)
    if not isinstance(value, _CONTAINERS):
        return value
    if depth >= MAX_DEPTH:
        raise ValueError(f"batch nested deeper than {MAX_DEPTH} levels (a container that holds itself?)")
    depth += 1
    kind = type(value)
    if kind is tuple:
        return tuple(_map(item, function, depth) for item in value)
    if kind is list:
        return [_map(item, function, depth) for item in value]
    if kind is dict:
        return {key: _map(item, function, depth) for key, item in value.items()}
    if isinstance(value, dict):
        items = {key: _map(item, function, depth) for key, item in value.items()}
        try:
            clone = copy.copy(value)  # keeps what a constructor would not (defaultdict's factory)
            clone.update(items)
            return clone
        except Exception:
            return items
    mapped = [_map(item, function, depth) for item in value]
    try:
        if isinstance(value, list):
            clone = copy.copy(value)
            clone[:] = mapped
            return clone
        if hasattr(value, "_fields"):  # namedtuple
            return kind(*mapped)
        return kind(mapped)  # torch.return_types and other structseqs take one sequence
    except Exception:
        return tuple(mapped) if isinstance(value, tuple) else mapped


def _valid(value: object, depth: int) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if not isinstance(value, _CONTAINERS) or depth >= MAX_DEPTH:
        return False
    depth += 1
    for item in value.values() if isinstance(value, dict) else value:
        if not (isinstance(item, torch.Tensor) or _valid(item, depth)):
            return False
    return True


def _problem(value: object, path: str, depth: int) -> str | None:
    if isinstance(value, torch.Tensor):
        return None
    if not isinstance(value, _CONTAINERS):
        return f"{path} is {_a(value)}"
    if depth >= MAX_DEPTH:
        return f"{path} is nested deeper than {MAX_DEPTH} levels (a container that holds itself?)"
    if isinstance(value, dict):
        items = ((f"{path}[{_short(key, 40)}]", item) for key, item in value.items())
    elif hasattr(value, "_fields"):  # namedtuple: by field name
        items = ((f"{path}.{field}", item) for field, item in zip(value._fields, value))
    else:
        items = ((f"{path}[{index}]", item) for index, item in enumerate(value))
    for where, item in items:
        problem = _problem(item, where, depth + 1)
        if problem is not None:
            return problem
    return None


def _a(value: object) -> str:
    name = type(value).__name__
    article = "an" if name[:1].lower() in "aeiou" else "a"
    return f"{article} {name} {_short(value, 60)}"


def _short(value: object, limit: int) -> str:
    try:
        text = repr(value)
    except Exception:  # a broken __repr__ must not hide the real problem
        text = "<unrepresentable>"
    return text if len(text) <= limit else text[: limit - 3] + "..."
