"""One node of the documented case on Parquet shards, for our queue, litdata or MosaicML streaming.

    python -m benchmarks._shard_peers prepare DATA              # litdata's index, streaming's MDS shards
    python -m benchmarks._shard_peers node LIBRARY RANK DATA RUN TIME_UNIT ROWS
    python -m benchmarks._shard_peers litdata-read DIRECTORY REPEATS   # (b): its reader, its format

``benchmarks.shards`` starts four ``node`` processes per library (speeds 1:2:2:4) and runs litdata's
and streaming's in the peers' Python (a separate virtual environment), ours in its own. Each node
builds its dataset, says it is ready (``RUN/ready-RANK``), waits for ``RUN/start`` (the time to
start at, written once all four are ready), reads its samples one by one, sleeping its speed's
time per sample (the training step), and writes the ids it read with its last sample's end to
``RUN/node-RANK.json``. Kept free of imports the other Python lacks.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

SPEEDS = (1.0, 2.0, 2.0, 4.0)
"""Time per unit of nodes A, B, C and D, in time units (the documented case)."""


def prepare(data: Path) -> None:
    """litdata's index of the Parquet files (read in place) and the same rows as MDS shards for streaming."""
    import pyarrow.parquet as pq
    from litdata.streaming.writer import index_parquet_dataset
    from streaming import MDSWriter
    from streaming.base.util import clean_stale_shared_memory

    index_parquet_dataset(str(data / "parquet"), num_workers=1)
    clean_stale_shared_memory()
    with MDSWriter(out=str(data / "mds"), columns={"id": "int64", "tokens": "bytes"}, size_limit=1 << 30) as out:
        for path in sorted((data / "parquet").glob("*.parquet")):
            for row in pq.read_table(path).to_pylist():
                out.write({"id": row["id"], "tokens": bytes(row["tokens"])})


def samples(library: str, rank: int, data: Path, run: Path):
    """The node's dataset, built before the start: an iterable of sample ids."""
    world = len(SPEEDS)
    if library == "litdata":
        os.environ.update(WORLD_SIZE=str(world), GLOBAL_RANK=str(rank))
        from litdata import StreamingDataset
        from litdata.streaming.item_loader import ParquetLoader

        dataset = StreamingDataset(str(data / "parquet"), item_loader=ParquetLoader(), shuffle=False)
        return (int(item["id"]) for item in dataset)
    if library == "streaming":
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29555")
        from streaming import StreamingDataset

        dataset = StreamingDataset(local=str(data / "mds"), shuffle=False, batch_size=1)
        return (int(item["id"]) for item in dataset)
    return ours(rank, data, run)


def ours(rank: int, data: Path, run: Path):
    """The documented loop: ``shared_queue`` beside a ``Session``, one unit per Parquet file."""
    from datetime import timedelta

    import torch

    from gradientmail import Session
    from gradientmail.data import ParquetReader, shards
    from gradientmail.mailbox.local import LocalMailbox
    from gradientmail.patterns.shared_queue import shared_queue

    units = shards(data / "parquet", suffixes=[".parquet"])
    box = LocalMailbox(run / "mailbox")
    learner = f"node-{rank}"
    session = Session(torch.nn.Linear(4, 1), mailbox=box, learner_id=learner, every=timedelta(seconds=0.5))
    reader = ParquetReader(batch_rows=1 << 20, columns=["id"])
    yield None  # built: the start comes next
    with session, shared_queue(units, mailbox=box, learner_id=learner, load=reader) as batches:
        for _step, batch in batches:
            yield from batch["id"].tolist()
            session.step(samples=len(batch["id"]))


def node(library: str, rank: int, data: Path, run: Path, time_unit: float, rows: int) -> None:
    import torch

    torch.set_num_threads(1)
    found = samples(library, rank, data, run)
    if library == "ours":
        next(found)  # the mailbox and Session built
    (run / f"ready-{rank}").write_text("")
    start_file = run / "start"
    while not start_file.exists():
        time.sleep(0.005)
    start = float(start_file.read_text())
    time.sleep(max(0.0, start - time.time()))
    sample_s = SPEEDS[rank] * time_unit / rows
    ids, end = [], start
    for n in found:
        began = time.time()
        ids.append(n)
        time.sleep(max(0.0, began + sample_s - time.time()))  # the node's training step for one sample
        end = time.time()
    temporary = run / f".node-{rank}.json"
    temporary.write_text(json.dumps({"ids": ids, "end": end}))
    os.replace(temporary, run / f"node-{rank}.json")


def file_rows(path: str):
    """One Parquet file's rows as litdata's ``optimize`` takes them (module level: its workers pickle it)."""
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    tokens = table.column("tokens").combine_chunks()
    values = tokens.flatten().to_numpy().astype("uint8").reshape(len(table), -1)
    for n, row in zip(table.column("id").to_pylist(), values):
        yield {"id": n, "tokens": row}


def litdata_read(directory: Path, repeats: int) -> None:
    """(b): litdata's reader on its own format (``optimize``d from the first Parquet file, untimed) into
    batches of tensors (``StreamingDataLoader``), against pyarrow reading the Parquet files, in
    alternating runs; prints one JSON line."""
    import statistics

    from litdata import StreamingDataLoader, StreamingDataset, optimize

    from benchmarks.shards import BATCH_ROWS, parquet_direct, timed

    paths = sorted(directory.glob("*.parquet"))[:1]  # optimize() converts about 1,000 rows a second here
    out = directory / "litdata"
    optimize(fn=file_rows, inputs=[str(path) for path in paths], output_dir=str(out), chunk_bytes="64MB", num_workers=1)

    def read() -> int:
        loader = StreamingDataLoader(StreamingDataset(str(out)), batch_size=BATCH_ROWS, num_workers=0)
        return sum(len(batch["id"]) for batch in loader)

    assert read() == parquet_direct(paths)  # warm, and the same rows
    ratios, cpu_ratios, rates = [], [], []
    for _ in range(repeats):
        (theirs, theirs_cpu), (direct, direct_cpu) = timed(read), timed(lambda: parquet_direct(paths))
        ratios.append(theirs / direct)
        cpu_ratios.append(theirs_cpu / direct_cpu)
        rates.append(theirs)
    print(
        json.dumps(
            {
                "rows_s": statistics.median(rates),
                "ratio": statistics.median(ratios),
                "spread": [min(ratios), max(ratios)],
                "cpu_ratio": statistics.median(cpu_ratios),
            }
        )
    )


if __name__ == "__main__":
    if sys.argv[1] == "prepare":
        prepare(Path(sys.argv[2]))
    elif sys.argv[1] == "litdata-read":
        litdata_read(Path(sys.argv[2]), int(sys.argv[3]))
    else:
        library, rank, data, run, time_unit, rows = sys.argv[2:8]
        node(library, int(rank), Path(data), Path(run), float(time_unit), int(rows))
