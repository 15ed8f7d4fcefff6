"""Small Parquet, JSON Lines and WebDataset tar shards made at test time from the standard library's
``.py`` bytes, and a queue node that trains on them (module level: spawned processes import it).

Every row holds its global ``id`` and ``ROW_BYTES`` bytes of the corpus as ``tokens``, so a test can
tell which row it got and check its content.
"""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

ROW_BYTES = 32


def corpus_rows(count: int, first: int = 0) -> list[dict]:
    """``count`` rows from row ``first`` on: ``{"id": n, "tokens": [32 byte values]}``."""
    from gradientmail.data import stdlib_files

    data = b""
    for path in stdlib_files():
        data += path.read_bytes()
        if len(data) >= (first + count) * ROW_BYTES:
            break
    return [{"id": n, "tokens": list(data[n * ROW_BYTES : (n + 1) * ROW_BYTES])} for n in range(first, first + count)]


def write_parquet(path: Path, rows: list[dict], row_group_rows: int = 1 << 20) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=row_group_rows)
    return path


def jsonl_bytes(rows: list[dict]) -> bytes:
    return b"".join(json.dumps(row).encode() + b"\n" for row in rows)


def tar_bytes(rows: list[dict]) -> bytes:
    """A WebDataset tar: sample ``{id:06d}`` with fields ``cls`` (the id) and ``bin`` (its bytes)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for row in rows:
            for field, data in (("cls", str(row["id"]).encode()), ("bin", bytes(row["tokens"]))):
                info = tarfile.TarInfo(f"{row['id']:06d}.{field}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def parquet_dataset(directory: Path, files: int, rows_per_file: int, row_group_rows: int = 1 << 20) -> list[dict]:
    """``files`` Parquet files ``part-00000.parquet``... of consecutive rows; returns every row."""
    rows = corpus_rows(files * rows_per_file)
    for index in range(files):
        chunk = rows[index * rows_per_file : (index + 1) * rows_per_file]
        write_parquet(directory / f"part-{index:05d}.parquet", chunk, row_group_rows)
    return rows


def shard_node(directory: str, mailbox_dir: str, learner: str, out: str, workers: int) -> None:
    """One node: ``shared_queue`` over ``shards(directory, split=...)`` read by a ``ParquetReader``
    in ``workers`` DataLoader worker processes; writes the row ids its loop received, one a line."""
    from gradientmail import open_mailbox
    from gradientmail.data import ParquetReader, shards
    from gradientmail.patterns.shared_queue import shared_queue

    units = shards(directory, split=10)
    reader = ParquetReader(batch_rows=4, columns=["id", "tokens"])
    seen = []
    with shared_queue(
        units, mailbox=open_mailbox(mailbox_dir), learner_id=learner, load=reader, workers=workers, prefetch=4
    ) as batches:
        for _index, batch in batches:
            seen.extend(batch["id"].tolist())
    Path(out).write_text("".join(f"{n}\n" for n in seen))
