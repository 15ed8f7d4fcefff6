"""The untracked queue's marks of units being loaded (``queue.loading_marks``) never sit on the
loader's path: a store that takes its time over them delays no batch, a unit loaded before its
mark went out costs no request, and a store that refuses them stops nothing."""

from __future__ import annotations

import threading

import torch

from gradientmail.layout import WORK_PREFIX, work_key
from gradientmail.mailbox import MemoryMailbox
from gradientmail.mailbox.wrappers import MailboxWrapper
from gradientmail.queue.dataset import SharedQueueDataset
from gradientmail.queue.loading_marks import LoadingMarks

HELD_S = 10.0
"""How long a held mark write waits to be released before it gives up (only reached when the
loader waits for it: the failure this file tests against)."""


class HeldMarks(MailboxWrapper):
    """A store without compare-and-swap whose writes under ``work/`` wait until released."""

    supports_replace_if = False

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.release = threading.Event()
        self.entered = threading.Event()  # a mark's write reached the store
        self.timed_out = False
        self.requests: list[tuple[str, str]] = []

    def put(self, key: str, data: bytes) -> None:
        if key.startswith(WORK_PREFIX):
            self.requests.append(("put", key))
            self.entered.set()
            if not self.release.wait(HELD_S):
                self.timed_out = True
        self.inner.put(key, data)

    def delete(self, key: str) -> None:
        if key.startswith(WORK_PREFIX):
            self.requests.append(("delete", key))
        self.inner.delete(key)


def _load(value: int):
    for step in range(3):
        yield step, torch.tensor([value, step])


def test_a_slow_mark_write_delays_no_batch():
    store = HeldMarks(MemoryMailbox("loading-marks-held"))
    dataset = SharedQueueDataset({"a": 1, "b": 2}, mailbox=store, learner_id="node-0", load=_load)
    batches = iter(dataset)
    first = next(batches)  # not after the mark's put (HELD_S): the mark is written off the loader's path
    store.release.set()
    rest = list(batches)
    assert not store.timed_out, "the loader waited for the mark of its unit"
    assert [int(batch[1]) for _, batch in [first, *rest]] == [0, 1, 2, 0, 1, 2]
    assert list(store.inner.list(WORK_PREFIX)) == []  # every loaded unit's mark removed


def test_a_unit_loaded_before_its_mark_went_out_costs_no_request():
    store = HeldMarks(MemoryMailbox("loading-marks-skip"))
    marks = LoadingMarks(store, "node-0", b"{}")
    marks.loading("a")  # goes out at once, and is held there
    assert store.entered.wait(HELD_S)
    marks.loading("b")  # waits behind it
    marks.loaded("b")  # loaded first: never written
    marks.loaded("a")  # written: removed after its write
    store.release.set()
    marks.close()
    assert store.requests == [("put", work_key("node-0", "a")), ("delete", work_key("node-0", "a"))]
    assert list(store.inner.list(WORK_PREFIX)) == []


class RefusesMarks(MailboxWrapper):
    supports_replace_if = False

    def put(self, key: str, data: bytes) -> None:
        if key.startswith(WORK_PREFIX):
            raise PermissionError(f"no writes under {WORK_PREFIX}")
        self.inner.put(key, data)


def test_a_store_that_refuses_the_marks_is_logged_once_and_the_marks_go_on(caplog):
    store = RefusesMarks(MemoryMailbox("loading-marks-refused"))
    marks = LoadingMarks(store, "node-0", b"{}")
    for identifier in ("a", "b", "c"):
        marks.loading(identifier)  # returns at once: the refusals happen on the marks' thread
    marks.close()
    refused = [r for r in caplog.records if "could not write the mark" in r.getMessage()]
    assert len(refused) == 1
