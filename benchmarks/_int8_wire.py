"""An 8-bit wire for the Session's state, simulated at the store: what it would cost in loss.

It measures whether 8-bit values (a scale per block, error feedback if needed) keep the
model's quality. ``Int8Wire`` wraps the mailbox of one node: every fragment version and pending
contribution it writes is rounded as an 8-bit encoding would round it (per block of
``BLOCK`` values: ``scale = absmax / 127``, each value ``round(x / scale)`` stochastically, so
a contribution below one step survives in expectation, as the bfloat16 wire does), then stored
dequantized, in float32, so that the Session reads it unchanged. It counts the bytes the
8-bit encoding would have sent (a byte per value plus a float32 scale per block) against the
bytes sent. The writer keeps its own unrounded copy of what it wrote (its anchor): a real
encoding would round that too; the difference is one rounding of one fold, on one node.

Example:
    >>> import torch
    >>> values = torch.linspace(-1, 1, 200)
    >>> rounded = round_trip(values)
    >>> bool((rounded - values).abs().max() <= 1 / 127), encoded_bytes(200)
    (True, 216)
"""

from __future__ import annotations

import math
import threading

import torch
from torch import Tensor

from gradientmail.mailbox.base import Mailbox
from gradientmail.mailbox.wrappers import MailboxWrapper
from gradientmail.session.mail import metadata_of

BLOCK = 64
"""Values per scale: 64 keeps an outlier's damage local at 1/16 byte of scale per value."""
STATE_PREFIX = "session/fragments/"


def round_trip(values: Tensor, block: int = BLOCK) -> Tensor:
    """``values`` as an 8-bit blockwise encoding (stochastic rounding) would return them."""
    flat = values.reshape(-1).to(torch.float32)
    count = flat.numel()
    blocks = torch.nn.functional.pad(flat, (0, (-count) % block)).view(-1, block)
    scale = blocks.abs().amax(dim=1, keepdim=True) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    steps = torch.floor(blocks / scale + torch.rand_like(blocks)).clamp_(-127, 127)
    return (steps * scale).view(-1)[:count].view_as(values).to(values.dtype)


def encoded_bytes(count: int, block: int = BLOCK) -> int:
    """Bytes of ``count`` values on the 8-bit wire: one each, plus a float32 scale per block."""
    return count + 4 * math.ceil(count / block)


class Int8Wire(MailboxWrapper):
    """Rounds every state fragment written through it as 8 bits would; counts both sizes."""

    def __init__(self, inner: Mailbox) -> None:
        super().__init__(inner)
        self.bytes_sent = 0  # float32 state bytes written (the Session's own wire)
        self.bytes_int8 = 0  # the same written as 8-bit values with per-block scales
        self._lock = threading.Lock()

    def put_if_absent(self, key: str, data: bytes) -> bool:
        return self.inner.put_if_absent(key, self._rounded(key, data))

    def put(self, key: str, data: bytes) -> None:
        self.inner.put(key, self._rounded(key, data))

    def _rounded(self, key: str, data: bytes) -> bytes:
        if not (key.startswith(STATE_PREFIX) and key.endswith(".safetensors")):
            return data
        from safetensors.torch import load, save

        metadata = {name: str(value) for name, value in metadata_of(data, key).items()}
        tensors = load(data)
        float_bytes = sum(t.numel() * t.element_size() for t in tensors.values() if t.is_floating_point())
        rounded = {name: round_trip(t) if t.is_floating_point() else t for name, t in tensors.items()}
        with self._lock:
            self.bytes_sent += len(data)
            self.bytes_int8 += (
                len(data)
                - float_bytes
                + sum(encoded_bytes(t.numel()) for t in tensors.values() if t.is_floating_point())
            )
        return save(rounded, metadata=metadata)
