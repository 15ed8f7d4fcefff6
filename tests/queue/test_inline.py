"""Small tensors travel from DataLoader workers inline: same values, dtype and shape on arrival."""

from __future__ import annotations

import pickle

import pytest
import torch
from queue_nodes import Item, named_units

from gradientmail import LocalMailbox
from gradientmail.patterns.shared_queue import shared_queue
from gradientmail.queue.inline import INLINE_BYTES, Inline, inline

pytestmark = pytest.mark.timeout(60)

SMALL = {
    "int64": torch.arange(12, dtype=torch.int64).reshape(3, 4),
    "bfloat16": torch.linspace(-2, 2, 35).reshape(5, 7).to(torch.bfloat16),
    "bool": torch.tensor([[True, False], [False, True]]),
    "scalar": torch.tensor(3.5),
    "empty": torch.zeros(0, 3),
    "complex": torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64),
    "conj": torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64).conj(),
    "neg": torch._neg_view(torch.arange(1.0, 4.0)),
}


@pytest.mark.parametrize("name", sorted(SMALL))
def test_small_tensors_pickle_inline_and_arrive_equal(name):
    tensor = SMALL[name]
    wrapped = inline(tensor)
    assert isinstance(wrapped, Inline)
    data = pickle.dumps(wrapped)
    assert len(data) < tensor.numel() * tensor.element_size() + 200  # the bytes, not a handle
    arrived = pickle.loads(data)
    assert type(arrived) is torch.Tensor
    assert (arrived.dtype, arrived.shape) == (tensor.dtype, tensor.shape)
    assert torch.equal(arrived, tensor)
    arrived.zero_()  # writable, and not the sender's memory
    assert torch.equal(tensor, SMALL[name])


@pytest.mark.parametrize(
    "value",
    [
        torch.zeros(INLINE_BYTES // 8 + 1, dtype=torch.int64),  # over the limit
        torch.zeros(3, requires_grad=True),
        torch.zeros(2, 2).to_sparse(),
        torch.nn.Parameter(torch.zeros(2)),
        torch.arange(24.0).reshape(4, 6)[:, ::2],
        torch.zeros(2, 3, 4, 4).to(memory_format=torch.channels_last),
        "not a tensor",
    ],
    ids=["large", "requires-grad", "sparse", "parameter", "strided-view", "channels-last", "str"],
)
def test_other_values_are_left_alone(value):
    assert inline(value) is value


def _mixed(item: Item):
    """Small tensors of several kinds, one over the inline limit, and a channels_last one."""
    yield 0, torch.full((4, 4), item.index, dtype=torch.int16)
    yield 1, (torch.arange(16.0).reshape(4, 4) + item.index).to(torch.bfloat16)
    yield 2, torch.arange(40, dtype=torch.int64).reshape(8, 5)[:, ::2] + item.index
    yield 3, torch.full((INLINE_BYTES // 8 + 8,), item.index, dtype=torch.int64)
    yield 4, torch.full((1, 3, 2, 2), item.index, dtype=torch.int64).to(memory_format=torch.channels_last)


@pytest.mark.parametrize("workers", [1, 2])
def test_batches_from_workers_arrive_as_loaded(tmp_path, workers):
    units = named_units(6)
    with shared_queue(
        units,
        mailbox=LocalMailbox(tmp_path),
        learner_id="n",
        load=_mixed,
        prefetch=4,
        workers=workers,
        multiprocessing_context="fork",
    ) as batches:
        received = list(batches)
    assert len(received) == 6 * 5
    for step, tensor in received:
        index = int(tensor.reshape(-1)[0])
        expected = dict(_mixed(Item(f"{index:05d}", index)))[step]
        assert type(tensor) is torch.Tensor
        assert (tensor.dtype, tensor.shape) == (expected.dtype, expected.shape)
        assert torch.equal(tensor, expected)
        # Small ones came through the pipe; the large and the channels_last one through shared
        # memory, as before (which keeps the strides).
        assert tensor.is_shared() == (step in (3, 4))
        assert tensor.stride() == expected.stride()


def _odd_views(item: Item):
    """Tensors whose bits say "conjugate" or "negate": view(uint8) refuses them."""
    yield 0, torch.tensor([item.index + 1j]).conj()
    yield 1, torch._neg_view(torch.tensor([float(item.index)]))


def test_conjugate_and_negative_views_arrive(tmp_path):
    # Pickling runs in the worker's queue feeder thread: a failure there dropped the batch silently.
    with shared_queue(
        named_units(3),
        mailbox=LocalMailbox(tmp_path),
        learner_id="n",
        load=_odd_views,
        prefetch=4,
        workers=1,
        multiprocessing_context="fork",
        shutdown_timeout=10,
    ) as batches:
        received = list(batches)
    assert sorted(step for step, _ in received) == [0, 0, 0, 1, 1, 1]
    for step, tensor in received:
        index = int(tensor.real.reshape(-1)[0]) if step == 0 else -int(tensor[0])
        assert torch.equal(tensor, dict(_odd_views(Item(f"{index:05d}", index)))[step])
