"""Train the small GPT of train_lm.py on Parquet shards in a bucket: 2 epochs, a 90/10 mixture.

The documented loop over real files: ``shards()`` lists each source's Parquet files as units (split
by rows), ``epochs()`` makes two seeded passes of each one run, ``mix()`` interleaves library code
(90 %) and test code (10 %), and ``ParquetReader`` reads a unit's rows in its epoch's order
through a ``ShardCache`` directory shared by the machine's processes (the second epoch reads no
byte from the bucket). Held-out shards (``val/``) are evaluated whenever this learner moves on to
the next epoch, and the run's consensus at the end. Each run needs a fresh mailbox.

    python examples/train_shards.py --quick --mailbox /tmp/gm-shards-1          # moto's S3, in-process
    AWS_ENDPOINT_URL=http://127.0.0.1:9000 python examples/train_shards.py --write \\
        --data s3://my-bucket/stdlib-shards --mailbox /tmp/gm-shards-2 --rank 0 --world 2   # and --rank 1

``--data`` is a prefix (``s3://bucket/prefix`` through s3fs, which honours AWS_ENDPOINT_URL, or a
local directory) holding ``lib/``, ``tests/`` and ``val/`` folders of Parquet files with a
``tokens`` column: rows of ``seq_len + 1`` byte values. ``--write`` (implied by ``--quick``) has
rank 0 write them from the standard library's ``.py`` files and a ``_SUCCESS`` marker last; the
other ranks wait for the marker before listing.
"""

import argparse
import io
import json
import logging
import math
import os
import socket
import sys
import sysconfig
import time
import zlib
from collections import Counter
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch import nn
from train_lm import GPT, wait_for_learners  # the model and the end-of-run wait of the bigger example

from gradientmail import Session, consensus, open_mailbox
from gradientmail.data import EpochUnit, ParquetReader, Shard, ShardCache, SourceUnit, epochs, mix, shards, stdlib_files
from gradientmail.patterns.shared_queue import shared_queue
from gradientmail.status import read_run

SOURCES = {"lib": 0.9, "tests": 0.1}
"""The mixture: the standard library's code, and its tests (files under a ``test``/``tests`` folder)."""
MARKER = "_SUCCESS"
MAX_MARKER = 4096


def parse_args() -> argparse.Namespace:
    env = os.environ.get
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mailbox", required=True, help="a directory or s3://bucket/prefix, fresh for each run")
    p.add_argument("--data", default=None, help="the shards' prefix (s3://bucket/prefix or a directory)")
    p.add_argument("--endpoint-url", default=env("AWS_ENDPOINT_URL"), help="S3-compatible endpoint")
    p.add_argument("--write", action="store_true", help="rank 0 writes the standard library's shards to --data")
    p.add_argument("--cache-dir", default=os.path.expanduser("~/.cache/gradientmail/shard-cache"))
    p.add_argument("--rank", type=int, default=int(env("RANK", "0")))
    p.add_argument("--world", type=int, default=int(env("WORLD_SIZE", "1")))
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--files", type=int, default=18, help="Parquet files of lib/ to write (tests/: a ninth)")
    p.add_argument("--file-rows", type=int, default=1024, help="rows per file written")
    p.add_argument("--split", type=int, default=256, help="rows per unit (shards(split=))")
    p.add_argument("--batch", type=int, default=32, help="rows per batch")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--exchange-every", type=float, default=5.0, help="seconds between Session exchanges")
    p.add_argument("--quick", action="store_true", help="a tiny model and dataset, for CI")
    args = p.parse_args()
    if args.quick:
        args.write = True
        args.files, args.file_rows, args.split, args.batch = 9, 64, 32, 16
        args.seq_len, args.width, args.exchange_every = 64, 64, 1.0
        args.data = args.data or "s3://gradientmail-example/stdlib-shards"
    if args.data is None:
        p.error("--data is required (or --quick)")
    return args


def start_moto(args: argparse.Namespace) -> Any:
    """moto's S3 server on a free local port, for ``--quick`` over s3:// without an endpoint."""
    if args.world > 1:
        raise SystemExit("--quick starts its own S3 server for one process: give --endpoint-url for more")
    from moto.server import ThreadedMotoServer  # the test extra

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # a line per request otherwise

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    for name, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing")):
        os.environ.setdefault(name, value)
    args.endpoint_url = f"http://127.0.0.1:{port}"
    return server


def source_of(relative: str) -> str:
    """Where a standard-library file goes: ``tests``, ``val`` (1 in 20 others, by a hash) or ``lib``."""
    parts = relative.split("/")
    if any(part in ("test", "tests", "idle_test") for part in parts[:-1]):
        return "tests"
    return "val" if zlib.crc32(relative.encode()) % 20 == 0 else "lib"


def write_shards(fs: Any, root: str, args: argparse.Namespace, settings: dict[str, int]) -> None:
    """Each source's bytes as Parquet files of ``tokens`` rows (row groups of ``split`` rows), then the marker."""
    base = sysconfig.get_path("stdlib")
    files = {"lib": args.files, "tests": max(1, args.files // 9), "val": 1}
    rows = {name: count * args.file_rows for name, count in files.items()}
    width = args.seq_len + 1
    data = {name: bytearray() for name in files}
    for path in stdlib_files(base):
        name = source_of(path.relative_to(base).as_posix())
        if len(data[name]) < rows[name] * width:
            data[name] += path.read_bytes()
    for name, count in files.items():
        if len(data[name]) < rows[name] * width:
            raise SystemExit(f"the standard library holds too few bytes for {rows[name]:,} rows of {name}/")
        for index in range(count):
            at = index * args.file_rows * width
            chunk = bytes(data[name][at : at + args.file_rows * width])
            tokens = pa.FixedSizeListArray.from_arrays(pa.array(np.frombuffer(chunk, np.uint8)), width)
            out = io.BytesIO()
            pq.write_table(pa.table({"tokens": tokens}), out, row_group_size=args.split)
            fs.makedirs(f"{root}/{name}", exist_ok=True)  # a local directory; no-op on a bucket
            fs.pipe_file(f"{root}/{name}/part-{index:05d}.parquet", out.getvalue())
    fs.pipe_file(f"{root}/{MARKER}", json.dumps(settings).encode())


def prepare_data(args: argparse.Namespace, options: dict[str, Any]) -> None:
    """Rank 0 writes the shards unless a matching marker is there; the other ranks wait for it."""
    fs, root = fsspec.core.url_to_fs(args.data, **options)
    root = root.rstrip("/")
    settings = {"files": args.files, "file_rows": args.file_rows, "split": args.split, "seq_len": args.seq_len}
    deadline = time.monotonic() + 600
    while True:
        fs.invalidate_cache()
        if fs.exists(f"{root}/{MARKER}"):
            with fs.open(f"{root}/{MARKER}", "rb") as stream:  # untrusted: bounded, then checked
                raw = stream.read(MAX_MARKER + 1)
            try:
                found = json.loads(raw) if len(raw) <= MAX_MARKER else None
            except ValueError:
                found = None
            if found != settings:
                raise SystemExit(
                    f"{args.data} holds shards written with other settings ({raw[:200]!r}): use another --data"
                )
            return
        if args.rank == 0:
            bucket = root.split("/")[0]
            if args.data.startswith("s3://") and not fs.exists(bucket):
                fs.mkdir(bucket)
            write_shards(fs, root, args, settings)
            print(f"[node-0] wrote the standard library's shards to {args.data}", flush=True)
        elif time.monotonic() > deadline:
            raise SystemExit(f"no {MARKER} under {args.data} after 10 minutes: is rank 0 writing it (--write)?")
        else:
            time.sleep(0.5)


@dataclass(frozen=True)
class LoadUnit:
    """A mixture unit's batches: the reader's, with the unit's place in the mixture and its epoch.

    Module level and plain data, so DataLoader workers pickle it. Steps count from the unit's
    place (``position * per_unit + batch index``): global, for the learning rate's schedule.
    """

    reader: ParquetReader
    positions: dict[tuple[str, int, str], int]
    per_unit: int

    def __call__(self, item: SourceUnit[EpochUnit[Shard]]):
        position = self.positions[(item.source, item.unit.epoch, item.unit.identifier)]
        for index, batch in self.reader(item):
            tokens = batch["tokens"].long()
            unit = torch.tensor([position, item.unit.epoch, len(tokens)])
            yield position * self.per_unit + index, {"tokens": tokens, "unit": unit}


def learning_rate(step: int, total: int, lr: float) -> float:
    warmup = max(1, total // 10)
    return lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * min(step, total) / total)))


@torch.no_grad()
def validation_loss(model: GPT, val: torch.Tensor) -> float:
    model.eval()
    loss = sum(model(x[:, :-1], x[:, 1:]).item() * len(x) for x in val.split(64)) / len(val)
    model.train()
    return loss


def main() -> None:
    args = parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, args.world)))
    server = start_moto(args) if args.data.startswith("s3://") and not args.endpoint_url else None
    options = {"endpoint_url": args.endpoint_url} if args.data.startswith("s3://") and args.endpoint_url else {}
    try:
        if args.write:
            prepare_data(args, options)
        train(args, options)
    finally:
        if server is not None:
            server.stop()


def train(args: argparse.Namespace, options: dict[str, Any]) -> None:
    data = args.data.rstrip("/")
    cache = ShardCache(args.cache_dir)  # shared by this machine's processes: epoch 2 reads from disk
    sources = {
        name: shards(f"{data}/{name}/*.parquet", split=args.split, storage_options=options, cache=cache)
        for name in SOURCES
    }
    val_units = shards(f"{data}/val/*.parquet", storage_options=options)
    lib, tests = sources["lib"], sources["tests"]
    # Two passes of lib, and as many of tests as its 10 % of the mixture needs: lib is used whole.
    needed = math.ceil(args.epochs * len(lib) * SOURCES["tests"] / SOURCES["lib"])
    mixed = mix(
        {
            "lib": (epochs(lib, args.epochs, seed=0), SOURCES["lib"]),
            "tests": (epochs(tests, max(args.epochs, math.ceil(needed / len(tests))), seed=0), SOURCES["tests"]),
        }
    )
    reader = ParquetReader(batch_rows=args.batch, cache=cache, storage_options=options, shuffle=True)
    per_unit = math.ceil(args.split / args.batch)
    positions = {(item.source, item.unit.epoch, item.unit.identifier): p for p, item in enumerate(mixed.values())}
    load = LoadUnit(reader, positions, per_unit)
    val_reader = ParquetReader(batch_rows=4096, cache=cache, storage_options=options)
    val = torch.cat([batch["tokens"] for shard in val_units.values() for _, batch in val_reader(shard)]).long()
    total_steps = len(mixed) * per_unit

    torch.manual_seed(0)  # the first learner's model becomes the run's base; the others catch up to it
    model = GPT(256, args.seq_len, args.width, args.layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    s3_box = args.mailbox.startswith("s3://") and args.endpoint_url
    box = open_mailbox(args.mailbox, **({"endpoint_url": args.endpoint_url} if s3_box else {}))
    learner = f"node-{args.rank}"
    print(f"[{learner}] {len(mixed)} units: {dict(Counter(item.source for item in mixed.values()))}", flush=True)

    started, epoch_seen = time.time(), 0
    trained: Counter[int] = Counter()  # mixture position -> rows trained
    session = Session(model, mailbox=box, learner_id=learner, every=timedelta(seconds=args.exchange_every))
    with session, shared_queue(mixed, mailbox=box, learner_id=learner, load=load) as batches:
        for step, batch in batches:
            position, epoch, rows = batch["unit"].tolist()
            if epoch > epoch_seen:  # this learner's first unit of the next epoch: evaluate here
                loss = validation_loss(model, val)
                print(f"[{learner}] epoch {epoch_seen} done here: validation loss {loss:.4f}", flush=True)
                epoch_seen = epoch
            for param_group in optimizer.param_groups:
                param_group["lr"] = learning_rate(step, total_steps, args.lr)
            tokens = batch["tokens"]
            loss = model(tokens[:, :-1], tokens[:, 1:])
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            session.step(samples=rows)
            trained[position] += rows
    keys = list(mixed)
    by_epoch = Counter(mixed[keys[p]].unit.epoch for p in trained)
    print(
        f"[{learner}] done: {len(trained)} units, {sum(trained.values()):,} rows in {time.time() - started:.1f}s "
        f"(units by epoch: {dict(sorted(by_epoch.items()))}; last epoch here: validation loss "
        f"{validation_loss(model, val):.4f})",
        flush=True,
    )
    if args.quick:  # what the CI test checks across processes: the units this learner trained
        print(f"[{learner}] units trained: {' '.join(keys[p] for p in sorted(trained))}", flush=True)

    if args.rank == 0:
        if not wait_for_learners(box, [f"node-{rank}" for rank in range(args.world)]):
            print("not every learner finished within 10 minutes: the consensus is the run so far")
        samples = consensus(box, model)
        claims = read_run(box).claims
        parts = [item.unit.unit.part for item in mixed.values()]
        expected = sum(part.stop - part.start for part in parts) if all(parts) else sum(samples.values())
        once = sorted(claim.identifier for claim in claims) == sorted(keys) and sum(samples.values()) == expected
        print(
            f"validation loss {validation_loss(model, val):.4f} (consensus of {len(samples)} learners, "
            f"{sum(samples.values()):,} rows, {time.time() - started:.1f}s)",
            flush=True,
        )
        if not once:
            sys.exit(
                f"not every (epoch, unit) once: {len(claims)} claims of {len(keys)} units, "
                f"{sum(samples.values()):,} rows in the consensus of {expected:,}"
            )
        print(f"every (epoch, unit) trained once: {len(keys)} units claimed once each, {expected:,} rows in the model")


if __name__ == "__main__":
    main()
