"""Batches: structured tensors, the checks of what ``load`` yields, and small batches sent inline.

Section ``batches`` below: Structured batches: a tensor, or tuples, lists and dicts of tensors nested to any depth.

Data libraries (torch's ``default_collate``, litdata, MosaicML streaming, webdataset) hand over
``(inputs, targets)`` tuples and ``{"input_ids": ..., "labels": ...}`` dicts, so ``load`` may
yield ``(step, batch)`` with ``batch`` of that shape. The queue checks every leaf where the
batch is made (``first_non_tensor``, so a mistake names its path, not a pickling failure in a
worker), moves small leaves inline (``gradientmail.queue.batches``) and DataLoader pins every
leaf (``pin_memory=True``); ``to_device`` moves a batch to the accelerator in the loop.
A plain tensor skips all of this: it is the common case and pays nothing extra.

Section ``inline`` below: Small batches travel from DataLoader workers inline, not through shared memory.

Handing a tensor over through shared memory costs about 1 ms whatever its size; copying a small
tensor's bytes through the worker's pipe is far cheaper. ``inline`` wraps contiguous CPU
tensors up to ``INLINE_BYTES`` (leaves of structured batches too) so they pickle as bytes and
arrive as ordinary tensors. Details: docs/queue.md.

Section ``batch_checks`` below: Checking what ``load`` yields and the order a node prefers, with messages that name the unit.
"""

from __future__ import annotations

import copy
import numbers
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple, TypeAlias, TypeVar

import torch

from gradientmail.errors import LoaderError, short_repr
from gradientmail.records import MAX_COUNT

__all__ = [
    "Batch",
    "INLINE_BYTES",
    "Inline",
    "Item",
    "MAX_DEPTH",
    "TensorTree",
    "add_note",
    "batch_size",
    "checked_batch",
    "checked_count",
    "checked_order",
    "describe_value",
    "first_non_tensor",
    "inline",
    "keep_pairs",
    "loaded_batches",
    "map_tensors",
    "to_device",
    "UnitTag",
]


# -- batches -----------------------------------------------------------------------------------------

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


# -- inline ------------------------------------------------------------------------------------------

INLINE_BYTES = 256 * 1024
"""Tensors up to this many bytes are copied through the pipe instead of shared memory."""


def inline(tensor: Any) -> Any:
    """``tensor`` wrapped to pickle inline if it is a small contiguous plain CPU tensor.

    In tuples, lists and dicts each such tensor is wrapped (new containers); anything else is
    returned unchanged. A plain tensor is tested first: the common case stays cheap.

    Example:
        >>> type(inline(torch.zeros(4))).__name__, type(inline(torch.zeros(1 << 20))).__name__
        ('Inline', 'Tensor')
    """
    if (
        type(tensor) is torch.Tensor
        and tensor.device.type == "cpu"
        and tensor.layout == torch.strided
        and not tensor.requires_grad
        and not tensor.is_quantized
        and not tensor.is_nested
        and tensor.is_contiguous()  # views and channels_last keep their strides (shared memory)
        and tensor.numel() * tensor.element_size() <= INLINE_BYTES
    ):
        return Inline(tensor)
    if isinstance(tensor, (tuple, list, dict)):
        return map_tensors(tensor, inline)
    return tensor


class Inline:
    """A tensor that pickles as its raw bytes and unpickles as a plain tensor (see ``inline``).

    Example:
        >>> import pickle
        >>> pickle.loads(pickle.dumps(Inline(torch.arange(3))))
        tensor([0, 1, 2])
    """

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # Runs in the worker's queue feeder thread, where an exception only prints a traceback
        # and drops the batch: never raise here, fall back to DataLoader's own path instead.
        try:
            tensor = self.tensor.resolve_conj().resolve_neg().contiguous()
            raw = tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
        except Exception:
            return _same, (self.tensor,)
        return _rebuild, (raw, tensor.dtype, tuple(tensor.shape))


def _same(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _rebuild(raw: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if not raw:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)


# -- batch_checks ------------------------------------------------------------------------------------

Batch = tuple[int, TensorTree]


class UnitTag(NamedTuple):
    """Which unit a queue item comes from: what the loop's side needs to time units and record progress."""

    unit: str
    token: str | None = None
    """The claim's token when the consuming side records progress (``resume=``/``lease=``)."""
    position: int | None = None
    """The batch's index in the unit's ``load()`` iteration (recorded with progress)."""
    end: bool = False
    """No batch: the unit's batches are all out (progress records the unit finished)."""
    ended: tuple[str, str | None] | None = None
    """``(unit, token)`` of the unit whose batches were all out before this batch: its end rides
    on the next unit's first batch, so it takes no place of its own in the buffer."""


class Item(NamedTuple):
    """What travels from a loader to the loop inside ``shared_queue``: a batch and its unit.

    One type whatever the run records: the loader's side fills the tag, the loop's side
    (``pumps``) reads it and hands the training loop the plain ``(step, batch)`` pair. It is
    a tuple of plain values, so it survives DataLoader's worker pipes, collation and pinning.

    Example:
        >>> item = Item(3, torch.ones(1), UnitTag("000001-0.json"))
        >>> item.pair[0], item.tag.unit
        (3, '000001-0.json')
    """

    step: int | None
    batch: Any
    tag: UnitTag

    @property
    def pair(self) -> Batch:
        """The ``(step, batch)`` pair the training loop gets."""
        return (self.step, self.batch)  # type: ignore[return-value]  # None only for an end marker


def add_note(exc: BaseException, note: str) -> None:
    """Add ``note`` to ``exc`` (shown under its traceback) where Python supports it."""
    if hasattr(exc, "add_note"):  # Python >= 3.11
        exc.add_note(note)


def checked_count(name: str, value: object, minimum: int) -> int:
    """``value`` if it is an int (not a bool) of at least ``minimum``; else TypeError/ValueError.

    Example:
        >>> checked_count("prefetch", 8, 1)
        8
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, not {type(value).__name__} ({value!r})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, not {value}")
    return value


def describe_value(value: object, limit: int = 120) -> str:
    """Type and a shortened ``repr`` of ``value``, for error messages.

    Example:
        >>> describe_value([1, 2])
        'list [1, 2]'
    """
    return f"{type(value).__name__} {short_repr(value, limit)}"


def checked_batch(identifier: str, item: object) -> Batch:
    """``item`` as a ``(step, batch)`` pair, the batch not copied.

    Raises:
        LoaderError: ``item`` is no pair of an int step and a tensor tree; the message names
            the unit and the offending leaf.

    Example:
        >>> checked_batch("u", (4, torch.zeros(2)))
        (4, tensor([0., 0.]))
    """
    if isinstance(item, (tuple, list)) and len(item) == 2:
        step, batch = item
        if isinstance(step, numbers.Integral) and not isinstance(step, bool):
            if not -MAX_COUNT <= step <= MAX_COUNT:
                raise LoaderError(
                    f"load for unit {identifier!r} yielded step {describe_value(step, 40)}, outside "
                    f"[-2**62, 2**62]: step labels are recorded in the mailbox to resume a unit, and "
                    "records hold steps in that range (label steps by count, not by a hash or a time in ns)"
                )
            if isinstance(batch, torch.Tensor):  # the common case: no walk
                return int(step), batch
            problem = first_non_tensor(batch)
            if problem is None:
                return int(step), batch
            raise LoaderError(
                f"load for unit {identifier!r} yielded a (step, batch) {type(item).__name__} at "
                f"step {int(step)} whose {problem}, not a torch.Tensor; a batch is a tensor, or "
                "tuples, lists and dicts of tensors (convert numbers and arrays with "
                "torch.as_tensor, keep other values out of the batch)"
            )
    raise LoaderError(
        f"load for unit {identifier!r} yielded {describe_value(item)}; "
        "it must yield (step, batch) pairs: an int step and a torch.Tensor (or tuples, lists "
        "and dicts of tensors)"
    )


def checked_order(order: Sequence[str] | None, units: Mapping[str, Any]) -> list[str]:
    """``order`` as a list, checked to be a permutation of the units' identifiers (None: theirs).

    Raises:
        ValueError: identifiers missing, unknown or repeated (the message lists a few).

    Example:
        >>> checked_order(["b", "a"], {"a": 1, "b": 2})
        ['b', 'a']
    """
    if order is None:
        return list(units)
    if isinstance(order, (str, bytes)) or not isinstance(order, Iterable):
        raise ValueError(f"order must be a sequence of unit identifiers, not {type(order).__name__}")
    listed = list(order)
    strange = [entry for entry in listed if not isinstance(entry, str)]
    if strange:
        raise ValueError(f"order must hold unit identifiers (str), found {describe_value(strange[0], 60)}")
    if len(listed) == len(units) and set(listed) == set(units):
        return listed
    counts = Counter(listed)
    repeated = [entry for entry, count in counts.items() if count > 1]
    unknown = [entry for entry in counts if entry not in units]
    missing = [identifier for identifier in units if identifier not in counts]
    problems = []
    for name, entries in (("missing", missing), ("unknown", unknown), ("repeated", repeated)):
        if entries:
            shown = ", ".join(repr(entry) for entry in entries[:3])
            more = f" and {len(entries) - 3} more" if len(entries) > 3 else ""
            problems.append(f"{name}: {shown}{more}")
    raise ValueError(
        "order must list every unit identifier exactly once (a permutation of the units' keys); " + "; ".join(problems)
    )


def keep_pairs(item: Batch | Item) -> Batch | Item:
    """DataLoader ``collate_fn`` that keeps each ``(step, batch)`` pair or ``Item`` as it is,
    but lets small tensors travel to the training process inline (``queue.batches``).

    Example:
        >>> item = keep_pairs(Item(0, torch.ones(1), UnitTag("unit")))
        >>> item.step, item.tag.unit, type(item.batch).__name__
        (0, 'unit', 'Inline')
    """
    if isinstance(item, Item):
        return item._replace(batch=inline(item.batch))
    if isinstance(item, tuple) and len(item) == 2:
        return (item[0], inline(item[1]))
    return item


def loaded_batches(load: Callable[[Any], Any], value: Any, identifier: str) -> Iterator[Batch]:
    """Run ``load(value)`` for unit ``identifier`` and yield its pairs, each checked.

    An error from ``load`` gets a note naming the unit; the loader's iterator is closed at the
    end (its ``finally`` blocks run even when the consumer leaves early).

    Raises:
        LoaderError: ``load`` returned no iterable, or yielded something that is no pair.

    Example:
        >>> list(loaded_batches(lambda n: [(0, torch.tensor([n]))], 7, "u"))
        [(0, tensor([7]))]
    """
    try:
        batches = load(value)
    except Exception as exc:
        add_note(exc, f"while loading unit {identifier!r}")
        raise
    try:
        iterator = iter(batches)
    except TypeError:
        raise LoaderError(
            f"load for unit {identifier!r} returned {describe_value(batches)}, not an iterable "
            "of (step, batch) pairs; write load as a generator that yields them"
        ) from None
    try:
        while True:
            try:
                item = next(iterator)
            except StopIteration:
                return
            except Exception as exc:
                add_note(exc, f"while loading unit {identifier!r}")
                raise
            yield checked_batch(identifier, item)
    finally:
        close = getattr(iterator, "close", None)
        if close is not None:
            close()
