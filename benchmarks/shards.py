"""Reading throughput of the shard readers against pyarrow reading the same files directly.

    python -m benchmarks.shards [--quick] [--repeats N]

Parquet and JSON Lines shards of the standard library's bytes (rows of 65 byte values and an id)
are read whole, batch by batch, into tensors: by ``ParquetReader`` / ``JsonLinesReader`` over
``shards()`` units, and by pyarrow directly (``ParquetFile.iter_batches`` / ``json.read_json``,
each batch's columns turned into tensors the same way, ``torch.from_numpy``). Runs alternate, so
both sides share the machine's moods; the ratio is ours / direct in rows per second of wall time
(target >= 0.9), printed with its spread over the repeats, and the same in rows per second of CPU
time (every thread's), steadier on a busy machine. Units are listed once, outside the timing. A second row set reads Parquet files split by
rows (``split=``), each unit reading only its row groups.

Then the Parquet files are put in a bucket on moto's S3 server and read for two epochs, with a
``ShardCache`` directory and without: the bytes each epoch fetches from the store, counted by the
S3 client itself (target for the second epoch with the cache: 0).
"""

from __future__ import annotations

import os
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.json as pa_json
import pyarrow.parquet as pq
import torch

from benchmarks._common import emit, parser, table
from gradientmail.data import JsonLinesReader, ParquetReader, ShardCache, shards, stdlib_files

ROW_BYTES = 65
BATCH_ROWS = 1024


def corpus(rows: int) -> np.ndarray:
    """``rows`` x ``ROW_BYTES`` bytes of the standard library's ``.py`` files (repeated if short)."""
    data = bytearray()
    for path in stdlib_files():
        data += path.read_bytes()
        if len(data) >= rows * ROW_BYTES:
            break
    while len(data) < rows * ROW_BYTES:
        data += data
    return np.frombuffer(bytes(data[: rows * ROW_BYTES]), dtype=np.uint8).reshape(rows, ROW_BYTES).astype(np.int64)


def write_files(directory: Path, files: int, rows_per_file: int, row_group_rows: int) -> None:
    tokens = corpus(files * rows_per_file)
    for index in range(files):
        chunk = tokens[index * rows_per_file : (index + 1) * rows_per_file]
        offsets = pa.array(np.arange(0, chunk.size + 1, ROW_BYTES, dtype=np.int32))
        table_ = pa.table(
            {
                "id": pa.array(np.arange(index * rows_per_file, (index + 1) * rows_per_file)),
                "tokens": pa.ListArray.from_arrays(offsets, pa.array(chunk.ravel())),
            }
        )
        pq.write_table(table_, directory / f"part-{index:05d}.parquet", row_group_size=row_group_rows)
        with open(directory / f"part-{index:05d}.jsonl", "w") as stream:
            for n, row in zip(table_.column("id").to_pylist(), chunk.tolist()):
                stream.write(f'{{"id": {n}, "tokens": {row}}}\n')


def direct_tensors(batch: pa.RecordBatch) -> dict[str, torch.Tensor]:
    """What the baseline does with each batch: the same tensors as ``to_tensors``."""
    ids = torch.from_numpy(batch.column("id").to_numpy(zero_copy_only=False, writable=True))
    tokens = batch.column("tokens")
    values = torch.from_numpy(tokens.flatten().to_numpy(zero_copy_only=False, writable=True))
    return {"id": ids, "tokens": values.reshape(len(batch), -1)}


def parquet_direct(paths: list[Path]) -> int:
    rows = 0
    for path in paths:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=BATCH_ROWS):
            rows += len(direct_tensors(batch)["id"])
    return rows


def jsonl_direct(paths: list[Path]) -> int:
    rows = 0
    for path in paths:
        for batch in pa_json.read_json(path).to_batches(max_chunksize=BATCH_ROWS):
            rows += len(direct_tensors(batch)["id"])
    return rows


def ours(reader: ParquetReader | JsonLinesReader, units: dict) -> int:
    return sum(len(batch["id"]) for shard in units.values() for _, batch in reader(shard))


def timed(read: Callable[[], int]) -> tuple[float, float]:
    """Rows per second of wall time, and per second of this process's CPU time (all threads)."""
    began, began_cpu = time.perf_counter(), time.process_time()
    rows = read()
    return rows / (time.perf_counter() - began), rows / max(time.process_time() - began_cpu, 1e-9)


def epoch_fetches(directory: Path) -> dict[str, float]:
    """Bytes fetched from a bucket (moto's server) by each of two epochs over the Parquet shards."""
    for name, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing")):
        os.environ.setdefault(name, value)
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    import boto3
    import fsspec
    from moto.server import ThreadedMotoServer

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    try:
        client = boto3.client("s3", endpoint_url=endpoint)
        client.create_bucket(Bucket="shards")
        paths = sorted(directory.glob("*.parquet"))
        for path in paths:
            client.put_object(Bucket="shards", Key=f"train/{path.name}", Body=path.read_bytes())
        options = {"endpoint_url": endpoint}
        units = shards("s3://shards/train/*.parquet", storage_options=options)
        fs = fsspec.filesystem("s3", **options)
        fs.ls("shards")  # the client the readers share (same options)
        fetched: list[int] = []

        def count(parsed: dict, **_: object) -> None:
            fetched.append(parsed.get("ContentLength", 0))

        fs.s3.meta.events.register("after-call.s3.GetObject", count)
        figures = {"shards_dataset_mib": sum(path.stat().st_size for path in paths) / 2**20}
        with tempfile.TemporaryDirectory() as cache:
            for label, reader in (
                ("cached", ParquetReader(batch_rows=BATCH_ROWS, cache=ShardCache(cache), storage_options=options)),
                ("uncached", ParquetReader(batch_rows=BATCH_ROWS, storage_options=options)),
            ):
                for epoch in (1, 2):
                    fetched.clear()
                    ours(reader, units)
                    figures[f"shards_epoch{epoch}_mib_fetched_{label}"] = sum(fetched) / 2**20
        return figures
    finally:
        server.stop()


def main() -> None:
    arguments = parser(__doc__)
    arguments.add_argument("--repeats", type=int, default=None, help="alternating runs per pair (default 7, quick 2)")
    options = arguments.parse_args()
    repeats = options.repeats or (2 if options.quick else 7)
    files, rows_per_file = (4, 5_000) if options.quick else (8, 50_000)
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        write_files(directory, files, rows_per_file, row_group_rows=rows_per_file // 5)
        parquet_paths = sorted(directory.glob("*.parquet"))
        jsonl_paths = sorted(directory.glob("*.jsonl"))
        whole = shards(directory, suffixes=[".parquet"])  # listed once, as a run does
        split = shards(directory, suffixes=[".parquet"], split=rows_per_file // 5)
        lines = shards(directory, suffixes=[".jsonl"])
        cases = {
            "parquet": (
                lambda: ours(ParquetReader(batch_rows=BATCH_ROWS), whole),
                lambda: parquet_direct(parquet_paths),
            ),
            "parquet_split": (
                lambda: ours(ParquetReader(batch_rows=BATCH_ROWS), split),
                lambda: parquet_direct(parquet_paths),
            ),
            "jsonl": (
                lambda: ours(JsonLinesReader(batch_rows=BATCH_ROWS), lines),
                lambda: jsonl_direct(jsonl_paths),
            ),
        }
        figures: dict[str, float] = {}
        rows = []
        for name, (our_read, direct_read) in cases.items():
            assert our_read() == direct_read() == files * rows_per_file  # warm the page cache, check the count
            ratios, cpu_ratios, ours_rates, direct_rates = [], [], [], []
            for _ in range(repeats):
                (ours_wall, ours_cpu), (direct_wall, direct_cpu) = timed(our_read), timed(direct_read)
                ours_rates.append(ours_wall)
                direct_rates.append(direct_wall)
                ratios.append(ours_wall / direct_wall)
                cpu_ratios.append(ours_cpu / direct_cpu)
            ratio, cpu_ratio = statistics.median(ratios), statistics.median(cpu_ratios)
            figures[f"shards_read_ratio_{name}"] = round(ratio, 3)
            figures[f"shards_read_ratio_{name}_spread"] = [round(min(ratios), 3), round(max(ratios), 3)]
            figures[f"shards_read_cpu_ratio_{name}"] = round(cpu_ratio, 3)
            rows.append(
                (
                    name,
                    f"{statistics.median(ours_rates):,.0f}",
                    f"{statistics.median(direct_rates):,.0f}",
                    f"{ratio:.3f}",
                    f"{min(ratios):.3f}-{max(ratios):.3f}",
                    f"{cpu_ratio:.3f}",
                )
            )
        fetches = epoch_fetches(directory)
    print(
        f"{files} files x {rows_per_file:,} rows of {ROW_BYTES} byte values, batches of {BATCH_ROWS}, {repeats} pairs"
    )
    headers = ("shards", "ours rows/s", "pyarrow rows/s", "ratio (median)", "spread", "CPU-time ratio")
    print(table(headers, rows))
    figures["shards_read_cores"] = os.cpu_count() or 0
    print()
    print(
        f"two epochs over the {files} Parquet files in a bucket ({fetches['shards_dataset_mib']:.1f} MiB), moto's S3 server:"
    )
    print(
        table(
            ("MiB fetched from the store", "epoch 1", "epoch 2"),
            [
                (label, *(f"{fetches[f'shards_epoch{epoch}_mib_fetched_{key}']:.2f}" for epoch in (1, 2)))
                for label, key in (("ShardCache(directory)", "cached"), ("no cache directory", "uncached"))
            ],
        )
    )
    figures.update(fetches)
    figures["shards_epoch2_bytes_fetched"] = round(fetches["shards_epoch2_mib_fetched_cached"] * 2**20)
    emit(figures)


if __name__ == "__main__":
    main()
