"""Checking what ``load`` yields and the order a node prefers, with messages that name the unit."""

from __future__ import annotations

import numbers
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from gradientmail.errors import LoaderError, short_repr
from gradientmail.queue.batches import TensorTree, first_non_tensor
from gradientmail.queue.inline import inline
from gradientmail.records import MAX_COUNT

__all__ = [
    "add_note",
    "Batch",
    "checked_batch",
    "checked_count",
    "checked_order",
    "describe_value",
    "Item",
    "keep_pairs",
    "loaded_batches",
    "UnitTag",
]


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
    (``consume.Batches``) reads it and hands the training loop the plain ``(step, batch)`` pair. It is
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
