"""Parameter mail: safetensors bytes with a small metadata header. Data, never code.

A mail holds a model's floating-point ``state_dict`` entries (each storage once, so tied
weights travel once) and, in the safetensors ``__metadata__`` header, who sent it and how much
work it carries. Nothing is ever unpickled: a mail is parsed by ``safetensors`` and then
checked against this model's names, shapes and dtypes before any tensor is used.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from gradientmail.errors import MailRejectedError
from gradientmail.layout import SESSION_PREFIX

FORMAT = "gradientmail.session/1"
"""Value of the ``format`` metadata field; mail with another value is rejected."""

SUFFIX = ".safetensors"
FINAL_NAME = f"final{SUFFIX}"
SEQ_DIGITS = 12
"""Zero-padded width of the sequence number in a key, so that keys sort by sequence."""

Spec = dict[str, tuple[tuple[int, ...], torch.dtype]]
"""Name -> (shape, dtype) of every tensor a mail must hold."""


# -- keys ------------------------------------------------------------------------------------
def mail_key(learner: str, seq: int) -> str:
    return f"{SESSION_PREFIX}{learner}/{seq:0{SEQ_DIGITS}d}{SUFFIX}"


def final_key(learner: str) -> str:
    return f"{SESSION_PREFIX}{learner}/{FINAL_NAME}"


def parse_key(key: str) -> tuple[str, int | None] | None:
    """``(learner, seq)`` for a numbered mail, ``(learner, None)`` for a final one, else None."""
    if not key.startswith(SESSION_PREFIX):
        return None
    learner, sep, name = key[len(SESSION_PREFIX):].partition("/")
    if not sep or not learner or "/" in name:
        return None
    if name == FINAL_NAME:
        return learner, None
    stem = name[: -len(SUFFIX)] if name.endswith(SUFFIX) else ""
    if len(stem) == SEQ_DIGITS and stem.isascii() and stem.isdigit():
        return learner, int(stem)
    return None


# -- the model side ----------------------------------------------------------------------------
def float_state(model: torch.nn.Module) -> dict[str, Tensor]:
    """The model's floating-point ``state_dict`` entries, live, each storage only once.

    Parameters and float buffers are exchanged; integer buffers (``num_batches_tracked``) stay
    local. A tied weight appears under several names in ``state_dict``; only the first is kept
    so that a merge is applied to it once.
    """
    seen: set[tuple] = set()
    entries: dict[str, Tensor] = {}
    for name, tensor in model.state_dict(keep_vars=False).items():
        if not isinstance(tensor, Tensor) or not tensor.is_floating_point():
            continue
        alias = (tensor.device, tensor.data_ptr(), tuple(tensor.shape), tensor.stride(), tensor.dtype)
        if tensor.numel() and alias in seen:
            continue
        seen.add(alias)
        entries[name] = tensor
    return entries


def spec_of(tensors: Mapping[str, Tensor]) -> Spec:
    return {name: (tuple(t.shape), t.dtype) for name, t in tensors.items()}


# -- the mail ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class MailHeader:
    """What a mail says about itself (stored as strings in the safetensors metadata).

    Attributes:
        learner: the sender's learner id (must match the key it was found under).
        seq: the sender's sequence number, increasing with every mail it sends.
        step: the sender's ``Session.step`` count when it took the snapshot.
        samples_total: samples the sender processed in the whole run (weight in ``consensus``).
        samples_since_previous: samples since its previous mail (weight in a merge).
        time: the sender's wall clock (unix seconds) at the snapshot (for ``max_staleness``).
        final: True for the state mailed when the sender's session ended.
    """

    learner: str
    seq: int
    step: int
    samples_total: int
    samples_since_previous: int
    time: float
    final: bool = False

    def to_metadata(self) -> dict[str, str]:
        return {
            "format": FORMAT,
            "learner": self.learner,
            "seq": str(self.seq),
            "step": str(self.step),
            "samples_total": str(self.samples_total),
            "samples_since_previous": str(self.samples_since_previous),
            "time": repr(float(self.time)),
            "final": "true" if self.final else "false",
        }

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, str], *, key: str) -> MailHeader:
        fmt = metadata.get("format")
        if fmt != FORMAT:
            raise MailRejectedError(
                f"mail {key!r} has format {fmt!r}, expected {FORMAT!r} (written by another "
                "version of gradientmail, or not parameter mail at all)"
            )
        try:
            header = cls(
                learner=str(metadata["learner"]),
                seq=int(metadata["seq"]),
                step=int(metadata["step"]),
                samples_total=int(metadata["samples_total"]),
                samples_since_previous=int(metadata["samples_since_previous"]),
                time=float(metadata["time"]),
                final=metadata.get("final") == "true",
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise MailRejectedError(f"mail {key!r} has an unreadable metadata header: {exc!r}") from exc
        if min(header.seq, header.step, header.samples_total, header.samples_since_previous) < 0 or (
            not math.isfinite(header.time)
        ):
            raise MailRejectedError(f"mail {key!r} has out-of-range metadata: {header}")
        return header


@dataclass(frozen=True)
class Mail:
    key: str
    header: MailHeader
    tensors: dict[str, Tensor]


def encode(tensors: Mapping[str, Tensor], header: MailHeader) -> bytes:
    """Safetensors bytes of CPU ``tensors`` with ``header`` in the metadata."""
    return _save({name: t.contiguous() for name, t in tensors.items()}, header.to_metadata())


def _save(tensors: dict[str, Tensor], metadata: dict[str, str]) -> bytes:
    from safetensors.torch import save

    return save(tensors, metadata=metadata)


def _metadata(data: bytes, key: str) -> dict[str, str]:
    """The ``__metadata__`` of safetensors bytes, read from the header alone."""
    if len(data) < 8:
        raise MailRejectedError(f"mail {key!r} is truncated ({len(data)} bytes)")
    size = int.from_bytes(data[:8], "little")
    if size > len(data) - 8:
        raise MailRejectedError(
            f"mail {key!r} is truncated or corrupt: its header claims {size} bytes, "
            f"only {len(data) - 8} follow"
        )
    try:
        header = json.loads(bytes(data[8 : 8 + size]))
    except (ValueError, UnicodeDecodeError) as exc:
        raise MailRejectedError(f"mail {key!r} is corrupt: unreadable safetensors header") from exc
    metadata = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(metadata, dict):
        raise MailRejectedError(f"mail {key!r} has no gradientmail metadata header")
    return metadata


def decode(data: bytes, *, key: str, spec: Spec, learner: str | None = None) -> Mail:
    """Parse and check one mail; raise ``MailRejectedError`` unless it fits ``spec`` exactly.

    ``learner`` is the learner id the key was found under; a mail claiming another sender is
    rejected.
    """
    header = MailHeader.from_metadata(_metadata(data, key), key=key)
    if learner is not None and header.learner != learner:
        raise MailRejectedError(
            f"mail {key!r} says it is from learner {header.learner!r}, but lies under {learner!r}"
        )
    from safetensors.torch import load

    try:
        tensors = load(bytes(data))
    except Exception as exc:  # safetensors raises its own error types for every corruption
        raise MailRejectedError(f"mail {key!r} from learner {header.learner!r} is corrupt: {exc}") from exc
    check(tensors, spec, key=key, learner=header.learner)
    return Mail(key=key, header=header, tensors=tensors)


def check(tensors: Mapping[str, Tensor], spec: Spec, *, key: str, learner: str) -> None:
    """Raise ``MailRejectedError`` naming the first difference between ``tensors`` and ``spec``."""
    where = f"mail {key!r} from learner {learner!r} does not match this model"
    missing = [name for name in spec if name not in tensors]
    extra = sorted(name for name in tensors if name not in spec)
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing tensors {_names(missing)}")
        if extra:
            parts.append(f"unexpected tensors {_names(extra)}")
        raise MailRejectedError(f"{where}: {'; '.join(parts)} (a different model architecture?)")
    for name, (shape, dtype) in spec.items():
        got = tensors[name]
        if tuple(got.shape) != shape:
            raise MailRejectedError(
                f"{where}: tensor {name!r} has shape {tuple(got.shape)}, expected {shape}"
            )
        if got.dtype != dtype:
            raise MailRejectedError(f"{where}: tensor {name!r} has dtype {got.dtype}, expected {dtype}")


def _names(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return f"[{shown}{', ...' if len(names) > limit else ''}] ({len(names)})"
