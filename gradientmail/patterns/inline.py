"""Small batches travel from DataLoader workers inline, not through shared memory.

A DataLoader worker hands each tensor over by moving it into a new shared-memory segment and
passing its file descriptor to the training process over a socket, which then maps it. That
costs about 1 ms per tensor whatever its size: for a batch of a few KiB it is nearly all of the
hand-over, and the training process pays its half (``benchmarks.throughput``, small batches).
Copying a small tensor's bytes through the worker's result pipe is far cheaper, so ``inline``
wraps tensors up to ``INLINE_BYTES`` so that they pickle as bytes; they arrive as ordinary
tensors of the same dtype, shape and values, in the training process's memory. Larger
tensors, and non-contiguous ones (views, ``channels_last``: their strides are kept), take
DataLoader's shared-memory path as before. In a structured batch (tuples, lists and dicts of
tensors, ``gradientmail.patterns.batches``) each tensor is judged on its own: small leaves come
inline, large ones through shared memory, in the same containers.
"""

from __future__ import annotations

from typing import Any

import torch

from gradientmail.patterns.batches import map_tensors

__all__ = ["INLINE_BYTES", "inline"]

INLINE_BYTES = 256 * 1024
"""Tensors up to this many bytes are copied through the pipe instead of shared memory."""


def inline(tensor: Any) -> Any:
    """``tensor`` wrapped to pickle inline if it is a small contiguous plain CPU tensor; in
    tuples, lists and dicts, each such tensor wrapped (new containers); anything else unchanged.

    A plain tensor is tested first, so the common case costs what it did before structures.
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
        return _Inline(tensor)
    if isinstance(tensor, (tuple, list, dict)):
        return map_tensors(tensor, inline)
    return tensor


class _Inline:
    """Pickles as the tensor's raw bytes; unpickles as a plain tensor."""

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
