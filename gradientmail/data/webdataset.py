"""WebDataset ``.tar`` shards as batches of samples, read with the standard library's ``tarfile``.

A sample is the consecutive files of one key (``images/0001.jpg`` and ``images/0001.cls`` are
sample ``images/0001`` with fields ``jpg`` and ``cls``), as WebDataset writes them. Files are only
read, never extracted to disk, and nothing read is unpickled.
"""

from __future__ import annotations

import io
import tarfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from gradientmail.data.errors import ShardError
from gradientmail.data.shard_cache import ShardCache
from gradientmail.data.shard_reader import Permutation, ShardLike, ShardReader

INTEGER_FIELDS = frozenset({"cls", "cls2", "class", "count", "index", "inx", "id"})
"""Fields WebDataset writes as a decimal integer in text: decoded to an ``int64`` scalar."""


def decode_fields(sample: dict[str, bytes]) -> dict[str, torch.Tensor]:
    """The default ``decode``: integer fields (``INTEGER_FIELDS``) as ``int64`` scalars, every
    other field as its bytes in a ``uint8`` tensor (decode images or text in your own ``decode``).

    Example:
        >>> decoded = decode_fields({"cls": b"7", "txt": b"hi"})
        >>> decoded["cls"].item(), decoded["txt"].tolist()
        (7, [104, 105])
    """
    decoded = {}
    for field, data in sample.items():
        if field in INTEGER_FIELDS:
            try:
                decoded[field] = torch.tensor(int(data.decode("ascii").strip()), dtype=torch.int64)
            except ValueError:
                raise ShardError(f"field {field!r} holds {data[:40]!r}, not an integer") from None
        else:
            decoded[field] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return decoded


def stack_samples(samples: list[dict[str, Any]]) -> dict[str, torch.Tensor | list[torch.Tensor]]:
    """The default ``collate``: each field stacked when every sample's has one shape, else a list.

    Raises:
        ShardError: the samples do not all have the same fields.
    """
    fields = list(samples[0])
    batch: dict[str, torch.Tensor | list[torch.Tensor]] = {}
    for sample in samples:
        if list(sample) != fields:
            raise ShardError(f"a sample has fields {sorted(sample)}, another {sorted(fields)}: pass a collate=")
    for field in fields:
        values = [sample[field] for sample in samples]
        same = all(isinstance(value, torch.Tensor) and value.shape == values[0].shape for value in values)
        batch[field] = torch.stack(values) if same else values
    return batch


def split_key(name: str) -> tuple[str, str]:
    """A member's name as WebDataset reads it: ``(key, field)``, the field after the base name's
    first dot.

    Example:
        >>> split_key("train/0001.seg.png")
        ('train/0001', 'seg.png')
    """
    directory, _, base = name.rpartition("/")
    stem, _, field = base.partition(".")
    return (f"{directory}/{stem}" if directory else stem), field


class TarReader(ShardReader):
    """A WebDataset ``.tar`` shard's samples, ``batch_size`` at a time, in the tar's order.

    Args:
        batch_size: samples per batch (the last batch of a shard may hold fewer).
        decode: turns a sample's ``{field: bytes}`` into ``{field: tensor}`` (``decode_fields``;
            module level, so DataLoader workers pickle it).
        collate: turns a list of decoded samples into the batch (``stack_samples``).
        cache, storage_options, shuffle: as ``ShardReader``'s.

    A remote tar is read front to back through the cache (one pass, no seeks), so its blocks are
    fetched once and kept for the next epoch like any reader's.
    """

    def __init__(
        self,
        *,
        batch_size: int = 32,
        decode: Callable[[dict[str, bytes]], Any] = decode_fields,
        collate: Callable[[list[Any]], Any] = stack_samples,
        cache: ShardCache | None = None,
        storage_options: Mapping[str, Any] | None = None,
        shuffle: bool = False,
    ) -> None:
        super().__init__(cache=cache, storage_options=storage_options, shuffle=shuffle)
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive number of samples, not {batch_size!r}")
        self.batch_size = batch_size
        self.decode = decode
        self.collate = collate

    def batches(self, shard: ShardLike, permutation: Permutation | None = None) -> Iterator[Any]:
        pending: list[Any] = []
        samples: Iterable[dict[str, bytes]] = self.samples(shard)
        if permutation is not None:
            held = list(samples)
            order = permutation(len(held))
            if sorted(order) != list(range(len(held))):
                raise ShardError(f"permutation({len(held)}) returned no permutation of the shard's samples")
            samples = [held[index] for index in order]
        for sample in samples:
            pending.append(self.decode(sample))
            if len(pending) == self.batch_size:
                yield self.collate(pending)
                pending = []
        if pending:
            yield self.collate(pending)

    def samples(self, shard: ShardLike) -> Iterator[dict[str, bytes]]:
        """The shard's samples as ``{field: bytes}``, before ``decode`` (``__key__`` files and
        names starting with ``.`` are left out)."""
        file = self.open(shard)
        try:
            stream: Any = open(file.local_path, "rb") if file.local_path else io.BufferedReader(file.raw(), 1 << 20)
            with stream, tarfile.open(fileobj=stream, mode="r|") as tar:
                key, sample = None, {}
                for member in tar:
                    if not member.isfile():
                        continue
                    name_key, field = split_key(member.name)
                    if not field or name_key.rpartition("/")[2].startswith((".", "__")):
                        continue
                    if name_key != key and sample:
                        yield sample
                        sample = {}
                    key = name_key
                    extracted = tar.extractfile(member)
                    if extracted is None:  # pragma: no cover - isfile() members always have data
                        continue
                    if field in sample:
                        raise ShardError(f"{file.url}: sample {key!r} has two {field!r} files")
                    sample[field] = extracted.read()
                if sample:
                    yield sample
        except tarfile.TarError as exc:
            raise ShardError(f"{file.url} is not a readable tar file: {exc}") from exc
        finally:
            file.close()
