"""Structured batches: tuples, lists, dicts and namedtuples of tensors through every path.

``load`` yields ``(step, batch)``; each test loads batches that name their unit and step, so
what arrives can be compared, type by type and tensor by tensor, with what was loaded.
"""

from __future__ import annotations

import pickle
import warnings
from collections import OrderedDict, defaultdict, namedtuple
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import pytest
import torch
from queue_nodes import Item, named_units
from torch.utils.data import DataLoader
from torch.utils.data._utils.collate import default_convert

from gradientmail import LoaderError, LocalMailbox, SharedQueueDataset
from gradientmail.patterns.shared_queue import shared_queue
from gradientmail.queue.batches import (
    INLINE_BYTES,
    MAX_DEPTH,
    Inline,
    UnitTag,
    checked_batch,
    first_non_tensor,
    inline,
    keep_pairs,
    map_tensors,
    to_device,
)
from gradientmail.queue.batches import Item as QueueItem
from gradientmail.status import read_run

pytestmark = pytest.mark.timeout(120)

Pair = namedtuple("Pair", "inputs targets")

KINDS = ["tuple", "list", "dict", "namedtuple", "nested"]


def make(kind: str, index: int, step: int) -> Any:
    """The batch of unit ``index`` at ``step``; its first tensor starts with ``index``."""
    x = torch.full((2, 3), float(index))
    y = torch.tensor([index, step])
    if kind == "tuple":
        return x, y
    if kind == "list":
        return [x, y, torch.tensor(step)]
    if kind == "dict":
        return {"input_ids": x, "labels": y}
    if kind == "namedtuple":
        return Pair(x, y)
    return {
        "a": (x, [y, {"b": Pair(x + 1, torch.zeros(0, dtype=torch.int16))}]),
        # Over the inline limit, and a strided view: both keep DataLoader's shared memory.
        "large": torch.full((INLINE_BYTES // 8 + 8,), index, dtype=torch.int64),
        "view": (torch.arange(24, dtype=torch.int32) + index).reshape(4, 6)[:, ::2],
    }


@dataclass(frozen=True)
class Shaped:
    """A picklable loader: ``item.steps`` batches of one kind."""

    kind: str

    def __call__(self, item: Item):
        for step in range(item.steps):
            yield step, make(self.kind, item.index, step)


def leaves(batch: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    map_tensors(batch, found.append)
    return found


def index_of(batch: Any) -> int:
    return int(leaves(batch)[0].reshape(-1)[0])


def assert_same(got: Any, expected: Any, path: str = "batch") -> None:
    """Same containers (exact types), same keys, tensors of the same dtype, shape and values."""
    assert type(got) is type(expected), f"{path}: {type(got).__name__} != {type(expected).__name__}"
    if isinstance(expected, torch.Tensor):
        assert (got.dtype, got.shape) == (expected.dtype, expected.shape), path
        assert torch.equal(got, expected), path
    elif isinstance(expected, dict):
        assert list(got) == list(expected), path
        for key in expected:
            assert_same(got[key], expected[key], f"{path}[{key!r}]")
    elif isinstance(expected, (tuple, list)):
        assert len(got) == len(expected), path
        for position, (a, b) in enumerate(zip(got, expected)):
            assert_same(a, b, f"{path}[{position}]")
    else:
        assert got == expected, path


def check_received(received: list[tuple[int, Any]], kind: str, units: int, steps: int) -> None:
    seen = []
    for step, batch in received:
        index = index_of(batch)
        assert_same(batch, make(kind, index, step))
        seen.append((index, step))
    assert sorted(seen) == [(i, s) for i in range(units) for s in range(steps)]


# -- through the queue ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("workers", [0, 2])
def test_structured_batches_arrive_as_loaded(tmp_path, kind, workers):
    """workers=0 (a thread) and real DataLoader worker processes, every kind of nesting."""
    with shared_queue(
        named_units(4, steps=2),
        mailbox=LocalMailbox(tmp_path),
        learner_id="n",
        load=Shaped(kind),
        prefetch=4,
        workers=workers,
    ) as batches:
        received = list(batches)
    check_received(received, kind, units=4, steps=2)


@pytest.mark.parametrize("workers", [1, 2])
def test_small_leaves_travel_inline_and_large_ones_through_shared_memory(tmp_path, workers):
    with shared_queue(
        named_units(3, steps=2),
        mailbox=LocalMailbox(tmp_path),
        learner_id="n",
        load=Shaped("nested"),
        prefetch=4,
        workers=workers,
    ) as batches:
        received = list(batches)
    check_received(received, "nested", units=3, steps=2)
    for _, batch in received:
        x, (y, inner) = batch["a"]
        assert not any(t.is_shared() for t in (x, y, *inner["b"])), "small leaves come inline"
        assert batch["large"].is_shared() and batch["view"].is_shared()
        assert batch["view"].stride() == (6, 2), "a view keeps its strides (shared memory)"


def test_inline_wraps_each_small_leaf_and_leaves_the_rest():
    batch = make("nested", 5, 1)
    before = pickle.dumps(batch)
    wrapped = inline(batch)
    x, (y, inner) = wrapped["a"]
    assert all(isinstance(leaf, Inline) for leaf in (x, y, *inner["b"]))
    assert type(inner["b"]) is Pair
    assert wrapped["large"] is batch["large"] and wrapped["view"] is batch["view"]
    assert pickle.dumps(batch) == before, "the loader's batch is not changed in place"
    assert_same(pickle.loads(pickle.dumps(wrapped)), batch)
    plain = torch.zeros(3)
    assert isinstance(inline(plain), Inline) and inline(None) is None


def test_the_worker_collate_inlines_structured_and_tagged_items():
    """``keep_pairs`` is DataLoader's collate_fn in the workers: pairs and ``Item``s (tags kept)."""
    batch = make("dict", 1, 0)
    step, kept = keep_pairs((0, batch))
    assert step == 0 and all(isinstance(v, Inline) for v in kept.values())
    tag = UnitTag("00001", "token", 3)
    item = keep_pairs(QueueItem(0, batch, tag))
    assert isinstance(item, QueueItem) and item.tag is tag and all(isinstance(v, Inline) for v in item.batch.values())
    end = QueueItem(None, None, UnitTag("00001", "token", end=True))
    assert keep_pairs(end) == end


@pytest.mark.parametrize("workers", [1, 2])
def test_pin_memory_keeps_the_structure_and_pins_every_leaf(tmp_path, workers):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*pin_memory.*")  # without an accelerator
        with shared_queue(
            named_units(3, steps=2),
            mailbox=LocalMailbox(tmp_path),
            learner_id="p",
            load=Shaped("nested"),
            prefetch=4,
            workers=workers,
            pin_memory=True,
        ) as batches:
            received = list(batches)
    check_received(received, "nested", units=3, steps=2)
    if torch.cuda.is_available():  # DataLoader pins only when there is an accelerator
        for _, batch in received:
            assert all(leaf.is_pinned() for leaf in leaves(batch))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pinned_structured_batches_move_to_the_gpu(tmp_path):
    device = torch.device("cuda")
    with shared_queue(
        named_units(3, steps=2),
        mailbox=LocalMailbox(tmp_path),
        learner_id="g",
        load=Shaped("nested"),
        prefetch=4,
        workers=2,
        pin_memory=True,
    ) as batches:
        moved = [(step, to_device(batch, device)) for step, batch in batches]
    torch.cuda.synchronize()
    for step, batch in moved:
        assert all(leaf.device.type == "cuda" for leaf in leaves(batch))
        cpu = to_device(batch, "cpu", non_blocking=False)
        assert_same(cpu, make("nested", index_of(cpu), step))


@pytest.mark.parametrize("workers", [0, 1])
def test_resume_continues_structured_batches_where_the_first_node_stopped(tmp_path, workers):
    box = LocalMailbox(tmp_path / "box")
    units = named_units(4, steps=3)
    got = []
    with shared_queue(
        units,
        mailbox=box,
        learner_id="node-0",
        load=Shaped("nested"),
        workers=workers,
        prefetch=2,
        resume=True,
        lease=timedelta(seconds=30),
    ) as batches:
        for pair in batches:
            got.append(pair)
            if len(got) == 5:
                break
    assert read_run(box).released
    with shared_queue(
        units,
        mailbox=box,
        learner_id="node-1",
        load=Shaped("nested"),
        workers=workers,
        prefetch=2,
        resume=True,
        lease=timedelta(seconds=30),
    ) as batches:
        got.extend(batches)
    check_received(got, "nested", units=4, steps=3)
    run = read_run(box)
    assert len(run.done) == 4 and not run.released


def test_a_dataset_iterated_in_this_process_yields_batches_as_loaded(memory_mailbox):
    dataset = SharedQueueDataset(named_units(3, steps=2), mailbox=memory_mailbox, learner_id="d", load=Shaped("nested"))
    check_received(list(dataset), "nested", units=3, steps=2)


@pytest.mark.parametrize("kind", ["tuple", "namedtuple", "nested"])
def test_a_bare_dataset_in_a_user_dataloader(local_mailbox, kind):
    """DataLoader(batch_size=None) applies its default_convert: tuples become lists, dicts and
    namedtuples stay; every leaf arrives."""
    dataset = SharedQueueDataset(named_units(4, steps=2), mailbox=local_mailbox, learner_id="u", load=Shaped(kind))
    received = list(DataLoader(dataset, batch_size=None, num_workers=2))
    seen = []
    for pair in received:
        assert type(pair) is list and len(pair) == 2
        step, batch = pair
        index = index_of(batch)
        assert_same(batch, default_convert(make(kind, index, step)))
        seen.append((index, step))
    assert sorted(seen) == [(i, s) for i in range(4) for s in range(2)]


# -- LoaderError ---------------------------------------------------------------------------------

T = torch.zeros(2)


def _self_holding() -> list[Any]:
    holder: list[Any] = [T]
    holder.append(holder)
    return holder


@pytest.mark.parametrize(
    "batch, where",
    [
        ({"input_ids": T, "labels": [T, "cat"]}, "batch['labels'][1] is a str 'cat'"),
        ((T, None), "batch[1] is a NoneType None"),
        ([T, (T, {"x": 3})], "batch[1][1]['x'] is an int 3"),
        (Pair(T, 1.5), "batch.targets is a float 1.5"),
        ({"pixels": np.zeros(2)}, "batch['pixels'] is a ndarray"),
        ("text", "batch is a str 'text'"),
        (_self_holding(), f"is nested deeper than {MAX_DEPTH} levels"),
    ],
    ids=["dict-list-str", "tuple-none", "nested-int", "namedtuple-field", "ndarray", "str", "cycle"],
)
def test_loader_error_names_the_path_of_a_non_tensor_leaf(memory_mailbox, batch, where):
    def bad_load(value):
        yield 0, make("tuple", 0, 0)
        yield 7, batch

    dataset = SharedQueueDataset({"u-7": 0}, mailbox=memory_mailbox, learner_id="x", load=bad_load)
    with pytest.raises(LoaderError) as caught:
        list(dataset)
    message = str(caught.value)
    assert "'u-7'" in message and where in message and "step 7" in message, message
    assert len(message) < 400, message


@pytest.mark.parametrize("step", [2**62 + 1, -(2**62) - 1, 10**40])
def test_a_step_label_outside_what_records_hold_is_refused_when_loaded(memory_mailbox, step):
    def bad_load(value):
        yield 0, T
        yield step, T

    dataset = SharedQueueDataset({"u-8": 0}, mailbox=memory_mailbox, learner_id="x", load=bad_load)
    with pytest.raises(LoaderError, match=r"unit 'u-8' yielded step .* outside \[-2\*\*62, 2\*\*62\]") as caught:
        list(dataset)
    assert len(str(caught.value)) < 400


def test_loader_error_from_a_worker_process_names_the_path(local_mailbox):
    with pytest.raises(LoaderError, match=r"unit '00001'.*batch\['labels'\]\[1\] is a str 'cat'"):
        with shared_queue(
            named_units(3), mailbox=local_mailbox, learner_id="w", load=_cat_at_one, prefetch=2, workers=1
        ) as batches:
            list(batches)


def _cat_at_one(item: Item):
    labels: list[Any] = [torch.zeros(1), "cat" if item.index == 1 else torch.ones(1)]
    yield 0, {"input_ids": torch.zeros(2), "labels": labels}


def test_checked_batches_are_passed_on_without_a_copy():
    plain = torch.zeros(3)
    assert checked_batch("u", (4, plain))[1] is plain
    nested = make("nested", 0, 0)
    step, same = checked_batch("u", [np.int64(4), nested])
    assert type(step) is int and step == 4 and same is nested
    assert checked_batch("u", (4, nested))[1] is nested


# -- the helpers ---------------------------------------------------------------------------------


def test_to_device_moves_every_leaf_and_keeps_the_rest():
    batch = {"a": (T, [T + 1, {"b": Pair(T, T)}]), "n": 3, "name": "x"}
    moved = to_device(batch, "meta")
    assert all(leaf.device.type == "meta" for leaf in leaves(moved))
    assert len(leaves(moved)) == 4
    assert moved["n"] == 3 and moved["name"] == "x" and type(moved["a"][1][1]["b"]) is Pair
    assert all(leaf.device.type == "cpu" for leaf in leaves(batch)), "the input is not changed"
    step, plain = to_device((5, T), "meta")
    assert step == 5 and plain.device.type == "meta"


class Tensors(list):
    """A list subclass with an attribute a constructor would not carry over."""

    note = "kept"


def test_map_tensors_keeps_container_types():
    counts: defaultdict[str, Any] = defaultdict(list, {"a": T})
    tagged = Tensors([T, T])
    tagged.note = "mine"
    structseq = torch.max(torch.arange(6.0).reshape(2, 3), dim=1)
    batch = (OrderedDict(x=T), counts, tagged, Pair(T, [T]), structseq)
    mapped = map_tensors(batch, lambda tensor: tensor + 1)
    assert [type(part) for part in mapped] == [type(part) for part in batch]
    assert mapped[1].default_factory is list and mapped[2].note == "mine"
    assert torch.equal(mapped[3].targets[0], T + 1) and torch.equal(mapped[4].values, structseq.values + 1)
    assert torch.equal(batch[0]["x"], T), "the input is not changed"


def test_first_non_tensor_accepts_tensors_and_empty_containers():
    assert first_non_tensor(make("nested", 0, 0)) is None
    assert first_non_tensor(((), [], {})) is None
    assert first_non_tensor({"a": [T, {1: b"x"}]}) == "batch['a'][1][1] is a bytes b'x'"


# -- counting samples --------------------------------------------------------
def test_batch_size_counts_rows_not_keys():
    """``session.step(samples=len(batch))`` counted a dict batch's keys; ``batch_size`` its rows."""
    from gradientmail.queue.batches import batch_size

    Pair = namedtuple("Pair", "inputs targets")
    assert batch_size(torch.zeros(5, 3)) == 5
    assert batch_size({"input_ids": torch.zeros(8, 16), "labels": torch.zeros(8, 16)}) == 8  # len() says 2
    assert batch_size(Pair(torch.zeros(4, 3), [torch.zeros(4), {"w": torch.zeros(4, 1)}])) == 4


@pytest.mark.parametrize(
    ("batch", "error", "match"),
    [
        ({"a": torch.zeros(8), "b": torch.zeros(3)}, ValueError, r"leading \(batch\) dimension \(3, 8\)"),
        (torch.tensor(1.0), ValueError, "a scalar"),
        ({}, ValueError, "no tensor"),
        ({"a": torch.zeros(2), "label": "cat"}, TypeError, r"batch\['label'\] is a str 'cat'"),
    ],
)
def test_batch_size_refuses_what_it_cannot_count(batch, error, match):
    from gradientmail.queue.batches import batch_size

    with pytest.raises(error, match=match):
        batch_size(batch)
