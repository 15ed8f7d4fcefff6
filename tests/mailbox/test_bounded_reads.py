"""Bounded reads above the backends: the base class, the wrappers, ``exists`` and the error.

Each backend's own bounded read is in the conformance suite (``gradientmail.testing``); S3's
ranged GET against a store that ignores ``Range`` is in ``test_s3.py``.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator

import pytest

from gradientmail.errors import ValueTooLargeError
from gradientmail.mailbox.base import BaseVersionedMailbox, exists
from gradientmail.mailbox.wrappers import CountingMailbox, DelayedMailbox, FaultyMailbox, MailboxWrapper


class ReadsWhole(BaseVersionedMailbox):
    """A backend that ignores the bound: its raw reads return whole values."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}
        self.bounds: list[int | None] = []

    def _put_if_absent(self, key: str, data: bytes) -> bool:
        return self.values.setdefault(key, data) is data

    def _get(self, key: str, max_bytes: int | None) -> bytes | None:
        self.bounds.append(max_bytes)
        return self.values.get(key)

    def _get_versioned(self, key: str, max_bytes: int | None) -> tuple[bytes, str] | None:
        data = self._get(key, max_bytes)
        return None if data is None else (data, str(hash(data)))

    def _replace_if(self, key: str, data: bytes, version: str) -> bool:
        raise NotImplementedError

    def _put(self, key: str, data: bytes) -> None:
        self.values[key] = data

    def _delete(self, key: str) -> None:
        self.values.pop(key, None)

    def _list(self, prefix: str, start_after: str | None) -> Iterator[str]:
        return iter(sorted(k for k in self.values if k.startswith(prefix) and (start_after is None or k > start_after)))


def test_a_backend_that_ignores_the_bound_is_still_refused_by_the_base_class():
    box = ReadsWhole()
    box.put("k", b"12345")
    assert box.get("k", max_bytes=5) == b"12345" and box.get_versioned("k", max_bytes=5)[0] == b"12345"
    for read in (box.get, box.get_versioned):
        with pytest.raises(ValueTooLargeError, match="'k' holds more than the 4 bytes") as caught:
            read("k", max_bytes=4)
        assert (caught.value.key, caught.value.limit, caught.value.size) == ("k", 4, None)
    assert box.bounds == [5, 5, 4, 4], "the raw reads were given the bound"
    assert box.get("k") == b"12345" and box.bounds[-1] is None


def test_a_bound_is_checked_before_the_backend_is_asked():
    box = ReadsWhole()
    for bound, error in ((-1, ValueError), (2.0, TypeError), (False, TypeError)):
        with pytest.raises(error, match="max_bytes"):
            box.get("k", max_bytes=bound)
    assert box.bounds == []


def test_exists_reads_no_more_than_a_byte(memory_mailbox):
    memory_mailbox.put("empty", b"")
    memory_mailbox.put("full", b"x" * 10**6)
    assert exists(memory_mailbox, "empty") and exists(memory_mailbox, "full")
    assert not exists(memory_mailbox, "missing")
    counting = CountingMailbox(memory_mailbox)
    assert exists(counting, "full") and counting.bytes_read == 0


@pytest.mark.parametrize(
    "wrap",
    [
        MailboxWrapper,
        CountingMailbox,
        lambda inner: DelayedMailbox(inner, 0.0),
        lambda inner: FaultyMailbox(inner, lambda *_: None),
    ],
    ids=["wrapper", "counting", "delayed", "faulty"],
)
def test_wrappers_forward_the_bound(memory_mailbox, wrap):
    wrapped = wrap(memory_mailbox)
    wrapped.put("k", b"12345")
    assert wrapped.get("k", max_bytes=5) == b"12345" and wrapped.get_versioned("k", max_bytes=5)[0] == b"12345"
    with pytest.raises(ValueTooLargeError):
        wrapped.get("k", max_bytes=4)
    with pytest.raises(ValueTooLargeError):
        wrapped.get_versioned("k", max_bytes=4)


def test_counting_counts_a_refused_read_as_a_get_that_moved_nothing(memory_mailbox):
    counting = CountingMailbox(memory_mailbox)
    memory_mailbox.put("k", b"x" * 1000)
    with pytest.raises(ValueTooLargeError):
        counting.get("k", max_bytes=10)
    with pytest.raises(ValueTooLargeError):
        counting.get_versioned("k", max_bytes=10)
    assert counting.counts == {"get": 1, "get_versioned": 1} and counting.bytes_read == 0
    assert counting.get("k", max_bytes=1000) == b"x" * 1000 and counting.bytes_read == 1000


def test_the_refusal_names_key_bound_size_and_store_and_survives_pickling():
    refusal = ValueTooLargeError("progress/a.json", 65536, 2**30, store="file:///run")
    assert str(refusal) == (
        "file:///run: 'progress/a.json' holds 1,073,741,824 bytes, more than the 65,536 bytes this read "
        "allows (refused, not read whole)"
    )
    copy = pickle.loads(pickle.dumps(refusal))
    assert (copy.key, copy.limit, copy.size, copy.store, str(copy)) == (
        refusal.key,
        refusal.limit,
        refusal.size,
        refusal.store,
        str(refusal),
    )
    assert isinstance(copy, ValueError)
