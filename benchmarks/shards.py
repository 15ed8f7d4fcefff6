"""The documented case on Parquet shards against litdata and MosaicML streaming; readers' throughput.

    python -m benchmarks.shards [--quick] [--repeats N] [--peers] [--time-unit S]

(a) The documented case on 24 Parquet files (one unit each): four node processes at speeds
1:2:2:4 read them, sleeping their speed's time per sample (the training step): ours through
``shards()``, ``ParquetReader`` and ``shared_queue`` beside a ``Session``; litdata's
``StreamingDataset`` over the same files (its ``ParquetLoader``); MosaicML streaming's
``StreamingDataset`` over the same rows as MDS shards (its format). Makespan over a time unit
(node A's time per file): ideal 12, an equal split per rank 24. The peers run in their own
virtual environment (``--peers`` installs litdata and mosaicml-streaming there, under
``~/.cache/gradientmail/benchmark-peers``; never a dependency of the package); without it their
rows say why they did not run.

(b) and (c) below.

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

import json
import os
import socket
import statistics
import subprocess
import sys
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
ROOT = Path(__file__).resolve().parent.parent
PEERS_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "gradientmail" / "benchmark-peers"
"""The peers' virtual environment: this Python's packages (torch) plus litdata and streaming."""
PEERS = ("litdata", "mosaicml-streaming", "polars")
"""What ``--peers`` installs (polars: litdata's Parquet index)."""
LIBRARIES = ("ours", "litdata", "streaming")
FILES = 24
FILE_ROWS = 8
TORCHVISION_STUB = {
    "__init__.py": '"""A stand-in: the registry\'s torchvision is built for CUDA torch and fails to import on CPU torch."""\n',
    "datasets/__init__.py": "class VisionDataset:  # streaming.vision subclasses it when streaming is imported\n    pass\n",
    "transforms/__init__.py": "",
    "transforms/functional.py": "def to_tensor(picture):\n    raise NotImplementedError('a stand-in torchvision')\n",
}
"""streaming imports ``torchvision.datasets`` at import time (its vision datasets, unused here); on
CPU torch the registry's torchvision wheel cannot load its operators, so the peers' environment
gets these two names instead."""


def peers_python() -> tuple[str | None, str]:
    """The Python that imports litdata and streaming, or None and why not."""
    candidates = [PEERS_DIR / "bin" / "python", Path(sys.executable)]
    for python in candidates:
        if python.exists() and _imports_peers(str(python)):
            return str(python), ""
    return (
        None,
        f"litdata and mosaicml-streaming not installed (python -m benchmarks.shards --peers installs them in {PEERS_DIR})",
    )


def _imports_peers(python: str) -> bool:
    check = "import litdata, polars, streaming"
    try:
        return subprocess.run([python, "-c", check], capture_output=True, timeout=300).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def install_peers() -> tuple[str | None, str]:
    """litdata and mosaicml-streaming in ``PEERS_DIR`` (a venv over this Python's packages, torch
    pinned to this one so that no other build is pulled in)."""
    python, reason = peers_python()
    if python is not None:
        return python, reason
    try:
        return _install_peers()
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"installing {', '.join(PEERS)} in {PEERS_DIR} failed: {exc}"


def _install_peers() -> tuple[str | None, str]:
    import torch

    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(PEERS_DIR)], check=True)
    python = str(PEERS_DIR / "bin" / "python")
    constraints = PEERS_DIR / "constraints.txt"
    constraints.write_text(f"torch=={torch.__version__.split('+')[0]}\n")
    print(f"installing {', '.join(PEERS)} into {PEERS_DIR} ...", flush=True)
    done = subprocess.run(
        [python, "-m", "pip", "install", "-q", "-c", str(constraints), *PEERS], capture_output=True, text=True
    )
    if done.returncode != 0:
        return None, f"pip install {' '.join(PEERS)} failed: {done.stderr.strip()[-300:]}"
    subprocess.run([python, "-m", "pip", "uninstall", "-y", "-q", "torchvision"], capture_output=True)
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], capture_output=True, text=True
    ).stdout.strip()
    for name, text in TORCHVISION_STUB.items():
        path = Path(site, "torchvision", name)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    if not _imports_peers(python):
        return None, f"litdata or streaming installed in {PEERS_DIR} but does not import"
    return python, ""


def documented_case(python: str | None, reason: str, time_unit: float) -> tuple[dict[str, float], list[tuple]]:
    """(a): makespan in time units of each library on the documented case, and the table's rows."""
    figures: dict[str, float] = {}
    rows = []
    with tempfile.TemporaryDirectory(prefix="gm-shard-peers-") as tmp:
        data = Path(tmp, "data")
        (data / "parquet").mkdir(parents=True)
        write_files(data / "parquet", FILES, FILE_ROWS, row_group_rows=FILE_ROWS, jsonl=False)
        if python is not None:
            prepared = subprocess.run(
                [python, "-m", "benchmarks._shard_peers", "prepare", str(data)],
                cwd=ROOT,
                env=_env(),
                capture_output=True,
                text=True,
            )
            if prepared.returncode != 0:
                python, reason = None, f"converting the files for them failed: {prepared.stderr.strip()[-300:]}"
        for library in LIBRARIES:
            if library != "ours" and python is None:
                rows.append((library, "n/a", reason, ""))
                continue
            try:
                result = _run_case(python if library != "ours" else sys.executable, library, data, Path(tmp), time_unit)
            except RuntimeError as exc:
                if library == "ours":
                    raise
                rows.append((library, "failed", str(exc)[-300:], ""))  # theirs: reported, the run goes on
                continue
            figures[f"shards_makespan_{library}"] = result["makespan"]
            figures[f"shards_not_once_{library}"] = result["not_once"]
            rows.append(
                (
                    library,
                    f"{result['makespan']:.2f}",
                    "/".join(str(n) for n in result["units"]),
                    result["not_once"],
                )
            )
    return figures, rows


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def _run_case(python: str, library: str, data: Path, tmp: Path, time_unit: float) -> dict:
    """Four node processes of ``library``; makespan from the common start to the last sample's end."""
    run = tmp / f"run-{library}"
    run.mkdir()
    nodes = [
        subprocess.Popen(
            [python, "-m", "benchmarks._shard_peers", "node", library, str(rank), str(data), str(run)]
            + [str(time_unit), str(FILE_ROWS)],
            cwd=ROOT,
            env=_env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(4)
    ]
    try:
        deadline = time.monotonic() + 300
        while not all((run / f"ready-{rank}").exists() for rank in range(4)):
            failed = [node for node in nodes if node.poll() not in (None, 0)]
            if failed or time.monotonic() > deadline:
                raise RuntimeError(
                    f"{library}'s nodes did not start: {failed[0].stderr.read()[-2000:] if failed else 'timeout'}"
                )
            time.sleep(0.02)
        start = time.time() + 0.3
        (run / ".start").write_text(repr(start))
        os.replace(run / ".start", run / "start")
        for node in nodes:
            _, errors = node.communicate(timeout=300)
            if node.returncode != 0:
                raise RuntimeError(f"a {library} node failed: {errors[-2000:]}")
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
                node.wait()
    reports = [json.loads((run / f"node-{rank}.json").read_text()) for rank in range(4)]
    counts: dict[int, int] = {}
    for report in reports:
        for n in report["ids"]:
            counts[n] = counts.get(n, 0) + 1
    not_once = sum(1 for count in counts.values() if count != 1) + (FILES * FILE_ROWS - len(counts))
    return {
        "makespan": (max(report["end"] for report in reports) - start) / time_unit,
        "units": [len(report["ids"]) / FILE_ROWS for report in reports],
        "not_once": not_once,
    }


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


def write_files(directory: Path, files: int, rows_per_file: int, row_group_rows: int, jsonl: bool = True) -> None:
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
        if not jsonl:
            continue
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
    arguments.add_argument(
        "--peers", action="store_true", help=f"install litdata and mosaicml-streaming in {PEERS_DIR} if missing"
    )
    arguments.add_argument(
        "--time-unit", type=float, default=None, help="(a): seconds of node A per file (default 0.25, quick 0.1)"
    )
    options = arguments.parse_args()
    repeats = options.repeats or (2 if options.quick else 7)
    if options.peers:
        python, reason = install_peers()
    elif options.quick:  # CI: ours only, whatever is installed (the peers' processes take a minute)
        python, reason = None, "not run in --quick mode without --peers"
    else:
        python, reason = peers_python()
    time_unit = options.time_unit or (0.1 if options.quick else 0.25)
    case_figures, case_rows = documented_case(python, reason, time_unit)
    print(
        f"(a) the documented case on {FILES} Parquet files of {FILE_ROWS} rows, 4 processes at speeds 1:2:2:4, "
        f"a time unit of {time_unit} s"
    )
    print(table(("library", "makespan (ideal 12, equal split 24)", "files A/B/C/D", "rows not once"), case_rows))
    print()
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
        figures: dict[str, float] = dict(case_figures)
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
        if python is not None and not options.quick:
            found = subprocess.run(
                [python, "-m", "benchmarks._shard_peers", "litdata-read", str(directory), str(repeats)],
                cwd=ROOT,
                env=_env(),
                capture_output=True,
                text=True,
            )
            if found.returncode == 0:
                litdata = json.loads(found.stdout.strip().splitlines()[-1])
                figures["shards_read_ratio_litdata"] = round(litdata["ratio"], 3)
                figures["shards_read_cpu_ratio_litdata"] = round(litdata["cpu_ratio"], 3)
                rows.append(
                    (
                        "litdata, its own format",
                        f"{litdata['rows_s']:,.0f}",
                        "",
                        f"{litdata['ratio']:.3f}",
                        f"{litdata['spread'][0]:.3f}-{litdata['spread'][1]:.3f}",
                        f"{litdata['cpu_ratio']:.3f}",
                    )
                )
            else:
                rows.append(("litdata, its own format", "failed", "", "", found.stderr.strip()[-200:], ""))
        fetches = epoch_fetches(directory)
    print(
        f"(b) {files} files x {rows_per_file:,} rows of {ROW_BYTES} byte values, batches of {BATCH_ROWS}, {repeats} pairs"
    )
    headers = ("shards", "ours rows/s", "pyarrow rows/s", "ratio (median)", "spread", "CPU-time ratio")
    print(table(headers, rows))
    figures["shards_read_cores"] = os.cpu_count() or 0
    print()
    print(
        f"(c) two epochs over the {files} Parquet files in a bucket ({fetches['shards_dataset_mib']:.1f} MiB), moto's S3 server:"
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
