"""Small batches travel from DataLoader workers inline, not through shared memory.

Handing a tensor over through shared memory costs about 1 ms whatever its size; copying a small
tensor's bytes through the worker's pipe is far cheaper. ``inline`` wraps contiguous CPU
tensors up to ``INLINE_BYTES`` (leaves of structured batches too) so they pickle as bytes and
arrive as ordinary tensors. Details: docs/queue.md.
"""

from __future__ import annotations

from typing import Any

import torch

from gradientmail.queue.batches import map_tensors

__all__ = [
    "Inline",
    "inline",
    "INLINE_BYTES",
]


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
