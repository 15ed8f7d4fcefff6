"""The figures of docs/data.md's disk cache: a second pass over S3 (moto's server), with and without.

    python -m benchmarks.disk_cache [MiB]

Each pass is a fresh ``TokenReader`` reading the whole file in order, as a restarted node would;
GET and HEAD requests are counted by the S3 client itself (a botocore event hook).
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import time
from typing import Any

os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")

import boto3  # noqa: E402
import fsspec  # noqa: E402
from moto.server import ThreadedMotoServer  # noqa: E402

from gradientmail.data import TokenReader  # noqa: E402


def one_pass(url: str, endpoint: str, cache_dir: str | None) -> dict[str, Any]:
    fs, path = fsspec.core.url_to_fs(url, endpoint_url=endpoint)
    fs.info(path)
    calls: list[str] = []

    def count(event_name: str, **_: Any) -> None:
        calls.append(event_name.rpartition(".")[2])

    for operation in ("GetObject", "HeadObject"):
        fs.s3.meta.events.register(f"before-call.s3.{operation}", count)
    began = time.perf_counter()
    reader = TokenReader(url, seq_len=1024, cache_dir=cache_dir, storage_options={"endpoint_url": endpoint})
    for start in range(0, len(reader), 64):
        reader.sequences(start, min(64, len(reader) - start))
    seconds = time.perf_counter() - began
    stats = reader.cache_stats()
    for operation in ("GetObject", "HeadObject"):
        fs.s3.meta.events.unregister(f"before-call.s3.{operation}", count)
    return {
        "GETs": calls.count("GetObject"),
        "HEADs": calls.count("HeadObject"),
        "MiB fetched": stats.bytes_read / 2**20,
        "disk hits": stats.disk_hits,
        "s": seconds,
    }


def main() -> None:
    mib = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    try:
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="figures")
        boto3.client("s3", endpoint_url=endpoint).put_object(Bucket="figures", Key="t.bin", Body=os.urandom(mib << 20))
        url = "s3://figures/t.bin"
        second = {}
        with tempfile.TemporaryDirectory() as cache:
            for label, cache_dir in (("no cache_dir", None), ("cache_dir", cache)):
                for number in (1, 2):
                    figures = one_pass(url, endpoint, cache_dir)
                    print(f"{label:>12}, pass {number}: " + ", ".join(f"{k} {v:,.1f}" for k, v in figures.items()))
                second[label] = figures
        baseline = max(1, second["no cache_dir"]["GETs"])
        print(f"disk_cache_second_pass_gets_ratio {second['cache_dir']['GETs'] / baseline:.3f} (cache_dir / none)")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
