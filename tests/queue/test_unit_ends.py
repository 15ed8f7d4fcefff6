"""A unit's end rides on the next unit's first batch: with one-batch units, end markers of
their own would take half the buffer (``prefetch=2`` would hold one unit ahead, not two) and the
loop would wait for each claim; every unit is still reported finished once, after its last batch."""

from __future__ import annotations

from collections.abc import Iterator

from gradientmail.queue.progress import Consumption, tagged_items
from gradientmail.queue.takeover import Assignment


class Claims:
    """Hands out the given units in order, one claim each."""

    def __init__(self, units: list[str]) -> None:
        self.units = list(units)

    def claim_next(self) -> Assignment | None:
        return Assignment(self.units.pop(0), f"token-{len(self.units)}") if self.units else None


def _load(sizes: dict[str, int]):
    def load(identifier: str) -> Iterator[tuple[int, int]]:
        for step in range(sizes[identifier]):
            yield step, step

    return load


def test_one_batch_units_send_one_end_marker_in_all():
    units = [f"u{i}" for i in range(5)]
    items = list(tagged_items(Claims(units), _load(dict.fromkeys(units, 1))))
    assert [item.tag.unit for item in items] == [*units, "u4"]  # not an end marker per unit
    assert [item.tag.end for item in items] == [False] * 5 + [True]
    assert [item.tag.ended and item.tag.ended[0] for item in items] == [None, "u0", "u1", "u2", "u3", None]


def test_a_unit_with_nothing_to_load_still_ends_in_order():
    sizes = {"a": 2, "empty": 0, "b": 1}
    items = list(tagged_items(Claims(list(sizes)), _load(sizes)))
    ends = [(item.tag.ended or (item.tag.unit,))[0] for item in items if item.tag.ended or item.tag.end]
    assert ends == ["a", "empty", "b"]


class Tracker:
    """What the loop's side tells the tracker, in order."""

    def __init__(self) -> None:
        self.said: list[tuple[str, str]] = []
        self.gate = self

    def deliver(self, mark) -> int:
        self.said.append(("batch", mark.unit))
        return len(self.said)

    def consumed(self, identifier, token, step, position, index) -> None:
        self.said.append(("consumed", identifier))

    def finished(self, identifier, token, index=None) -> None:
        self.said.append(("finished", identifier))

    def check(self) -> None: ...

    def waiting(self, waiting: bool) -> None: ...

    def confirm(self) -> None: ...


def test_each_unit_is_finished_once_after_its_last_batch_was_consumed():
    sizes = {"a": 2, "b": 1, "c": 1}
    items = tagged_items(Claims(list(sizes)), _load(sizes))
    tracker = Tracker()
    consumption = Consumption(tracker)
    taken = 0
    try:
        while True:
            consumption.next_from(items)
            taken += 1
    except StopIteration:
        pass
    assert taken == 4
    finished = [unit for what, unit in tracker.said if what == "finished"]
    assert finished == ["a", "b", "c"]
    for unit in sizes:  # finished only once its last batch was consumed
        said = tracker.said
        assert said.index(("finished", unit)) > max(i for i, entry in enumerate(said) if entry == ("consumed", unit))
