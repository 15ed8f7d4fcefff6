"""The shared queue of a group: its rank 0 claims units, every rank trains its share of each step.

A group (the ranks of one machine training one model with DDP) is one learner of the queue:
its rank 0 runs the ordinary ``shared_queue`` (claims, prefetch, the elastic records) with a
``load`` that also tags each batch with its unit and position; before each batch it broadcasts
that tag, and every other rank loads the same unit on a thread of its own (the batches of a unit
read ahead) and keeps its share. Every rank gets a batch at every step and they all end at the
same step, so DDP never waits for a rank that ran out.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch

from gradientmail.errors import GroupError, LoaderError
from gradientmail.queue.batch_checks import Batch, loaded_batches
from gradientmail.queue.batches import TensorTree, map_tensors
from gradientmail.queue.handoff import HandOff
from gradientmail.session.group import GroupSync

__all__ = [
    "BATCH",
    "END",
    "FAILED",
    "FOLLOWER_PREFETCH",
    "STOP",
    "WORDS",
    "FollowerBatches",
    "GroupUnit",
    "LeaderBatches",
    "LeaderLoad",
    "follower_batches",
    "leader_batches",
    "refuse",
    "split_rows",
    "tagged_units",
]

V = TypeVar("V")

Split = Callable[[TensorTree, int, int], TensorTree]
"""``split(batch, rank, size)``: rank ``rank``'s share of a whole batch, of a group of ``size``."""

END, BATCH, FAILED, STOP = 0, 1, 2, 3
"""What rank 0 announces before each step: the batches ran out; a batch (unit, position, step,
and the unit its loader started next, if any); its queue failed; its loop left early (``break``)."""
WORDS = 5
"""Integers in each announcement: ``[what, unit index, position, step, next unit index or -1]``."""


FOLLOWER_PREFETCH = 2
"""Batches a rank other than 0 reads ahead when nothing says how many (``SharedQueueDataset``)."""


def split_rows(batch: TensorTree, rank: int, size: int) -> TensorTree:
    """Rank ``rank``'s rows of every tensor in ``batch``: near-equal contiguous blocks (views).

    Example:
        >>> split_rows(torch.arange(5), 1, 2)
        tensor([3, 4])
    """
    return map_tensors(batch, lambda tensor: tensor.tensor_split(size)[rank])


@dataclass(frozen=True)
class GroupUnit(Generic[V]):
    """A unit as rank 0's queue holds it: the user's value and where it is in the mapping."""

    identifier: str
    index: int
    value: V


def tagged_units(units: Mapping[str, V]) -> dict[str, GroupUnit[V]]:
    """Rank 0's units: each value tagged with its identifier and place in the mapping, which
    the other ranks hold alike (the announcement names a unit by that place)."""
    return {key: GroupUnit(key, index, value) for index, (key, value) in enumerate(units.items())}


class LeaderLoad(Generic[V]):
    """Rank 0's ``load``: its share of each batch, tagged ``[unit index, position]``.

    Module-level and made of picklable parts, so DataLoader workers take it like ``load``.
    ``started`` lists the units it began loading, in order: in rank 0's own process (a loader
    thread) the announcements name the next one, so the other ranks read it ahead; a worker
    process's copy stays its own, and the other ranks then learn of each unit with its first batch.
    """

    def __init__(self, load: Callable[[V], Iterable[tuple[int, TensorTree]]], split: Split | None, size: int) -> None:
        self.load = load
        self.split = split
        self.size = size
        self.started: list[int] = []

    def __call__(self, unit: GroupUnit[V]) -> Iterator[tuple[int, tuple[TensorTree, torch.Tensor]]]:
        self.started.append(unit.index)  # claimed, now loading (list.append: safe across threads)
        batches = loaded_batches(self.load, unit.value, unit.identifier)
        for position, (step, batch) in enumerate(batches):
            share = batch if self.split is None else self.split(batch, 0, self.size)
            yield step, (share, torch.tensor([unit.index, position]))


class LeaderBatches(Iterator[Batch]):
    """Rank 0's batches: each one announced to the group before the loop gets it, with the unit
    its loader started after that batch's (from ``started``, ``LeaderLoad.started``), if any."""

    def __init__(self, inner: Iterator[Any], sync: GroupSync, started: Sequence[int] = ()) -> None:
        self._inner = inner
        self._sync = sync
        self._started = started
        self._cursor = 0  # where the current unit is in ``started``
        self.ended = False

    def __iter__(self) -> LeaderBatches:
        return self

    def __next__(self) -> Batch:
        if self.ended:
            raise StopIteration
        try:
            step, (share, tag) = next(self._inner)
        except StopIteration:
            self._say(END)
            raise
        except BaseException:
            with contextlib.suppress(GroupError):  # the group already failed: the others know
                self._say(FAILED)
            raise
        index, position = (int(value) for value in tag.tolist())
        self._sync.announce([BATCH, index, position, step, self._next_unit(index)])
        return step, share

    def _next_unit(self, index: int) -> int:
        """The unit the loader started after unit ``index`` (-1: none known yet)."""
        started = self._started
        for at in range(self._cursor, len(started)):
            if started[at] == index:
                self._cursor = at
                return started[at + 1] if at + 1 < len(started) else -1
        return -1

    def _say(self, what: int) -> None:
        self.ended = True
        self._sync.announce([what] + [0] * (WORDS - 1))

    def leave(self) -> None:
        """The loop left before the end (on every rank, at the same step): tell the others."""
        if not self.ended:
            self._say(STOP)


def refuse(sync: GroupSync) -> None:
    """Rank 0's queue failed before its first batch (a refused learner, another run's units):
    the other ranks, waiting for that batch, raise ``LoaderError`` with it."""
    with contextlib.suppress(GroupError):  # the group already failed: the others know
        sync.announce([FAILED] + [0] * (WORDS - 1))


class FollowerBatches(Iterator[Batch]):
    """The batches of a rank other than 0: the units rank 0 announces, loaded here, this rank's share.

    Args:
        units: the same mapping as rank 0's.
        load, split: as for ``shared_queue``.
        sync: the group.
        prefetch: batches read ahead of the current unit, and of the next one once rank 0 names it.
    """

    def __init__(
        self,
        units: Mapping[str, V],
        load: Callable[[V], Iterable[tuple[int, TensorTree]]],
        split: Split | None,
        sync: GroupSync,
        prefetch: int,
    ) -> None:
        self._units = list(units.items())
        self._load = load
        self._split = split
        self._sync = sync
        self._prefetch = prefetch
        self._unit = -1
        self._position = 0
        self._pump: HandOff | None = None
        self._next: tuple[int, HandOff] | None = None  # the next unit, read ahead
        self.ended = False

    def __iter__(self) -> FollowerBatches:
        return self

    def __next__(self) -> Batch:
        if self.ended:
            raise StopIteration
        what, index, position, step, ahead = self._sync.announce([0] * WORDS)
        if what != BATCH:
            self.ended = True
            self.close()
            if what == FAILED:
                raise LoaderError("the shared queue of this group failed on its rank 0 (its error is raised there)")
            raise StopIteration
        got, batch = self._batch(index, position)
        if ahead >= 0 and ahead != index and (self._next is None or self._next[0] != ahead):
            self._close_next()
            self._next = (ahead, self._start(ahead))
        if got != step:
            raise LoaderError(
                f"unit {self._units[index][0]!r} at position {position}: rank {self._sync.rank} loaded "
                f"step {got} where rank 0 loaded step {step}; load must yield the same batches on every rank"
            )
        share = batch if self._split is None else self._split(batch, self._sync.rank, self._sync.size)
        return step, share

    def _batch(self, index: int, position: int) -> tuple[int, TensorTree]:
        if index != self._unit or position < self._position:
            self._close_current()
            if self._next is not None and self._next[0] == index:
                self._pump, self._next = self._next[1], None  # read ahead since rank 0 named it
            else:
                self._close_next()
                self._pump = self._start(index)
            self._unit, self._position = index, 0
        assert self._pump is not None
        while True:  # a resumed unit starts past the batches already trained
            try:
                item = self._pump.take()
            except StopIteration:
                raise LoaderError(
                    f"unit {self._units[index][0]!r} has no batch at position {position} on rank "
                    f"{self._sync.rank}, where rank 0 had one; load must yield the same batches on every rank"
                ) from None
            self._position += 1
            if self._position > position:
                return item

    def _start(self, index: int) -> HandOff:
        identifier, value = self._units[index]
        batches = loaded_batches(self._load, value, identifier)
        return HandOff(batches, self._prefetch, f"gradientmail-group-unit-{identifier}")

    def leave(self) -> None:
        """The loop left before the end: take rank 0's word that it did too."""
        if not self.ended:
            self.ended = True
            self._sync.announce([0] * WORDS)
        self.close()

    def close(self) -> None:
        """Stop reading ahead."""
        self._close_current()
        self._close_next()

    def _close_current(self) -> None:
        pump, self._pump = self._pump, None
        if pump is not None:
            pump.stop()
            pump.finish(None, lambda: None)

    def _close_next(self) -> None:
        ahead, self._next = self._next, None
        if ahead is not None:
            ahead[1].stop()
            ahead[1].finish(None, lambda: None)


def leader_batches(inner: Iterable[Any], sync: GroupSync, started: Sequence[int] = ()) -> Iterator[Batch]:
    """Rank 0's batches from ``inner`` (a queue over ``tagged_units`` with a ``LeaderLoad``),
    each announced; a queue refused before its first batch is announced as failed."""
    try:
        batches = iter(inner)
    except BaseException:
        refuse(sync)
        raise
    yield from LeaderBatches(batches, sync, started)


def follower_batches(
    units: Mapping[str, V],
    load: Callable[[V], Iterable[tuple[int, TensorTree]]],
    split: Split | None,
    sync: GroupSync,
    prefetch: int = FOLLOWER_PREFETCH,
) -> Iterator[Batch]:
    """A rank other than 0's batches (``FollowerBatches``), reading ahead stopped however the
    loop ends (a generator: closed when the loop drops it)."""
    follower = FollowerBatches(units, load, split, sync, prefetch)
    try:
        yield from follower
    finally:
        follower.close()
