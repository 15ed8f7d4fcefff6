"""``TokenReader(cache_dir=...)``: a remote file's blocks on local disk, shared by processes.

Against moto's S3 server; the readers under test run in processes of their own (forked, each a
fresh one), and their GET requests are counted by the S3 client itself (a botocore event hook),
not by the reader's own counters.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

from gradientmail.data import TokenFileError, TokenReader
from gradientmail.data.disk_cache import BLOCK_SUFFIX, TEMP_PREFIX

TOKENS = 4000
BLOCK = 256
BLOCKS = -(-TOKENS * 2 // BLOCK)  # 32: the last one is 64 bytes
SEQ_LEN = 10
CHUNK = 12  # sequences per read: 121 tokens, 242 bytes


def token_values(salt: int) -> list[int]:
    return [(i * 7 + salt) % 65_536 for i in range(TOKENS)]


def token_bytes(salt: int) -> bytes:
    return struct.pack(f"<{TOKENS}H", *token_values(salt))


@pytest.fixture
def remote(s3_client, s3_bucket, s3_endpoint) -> dict[str, Any]:
    pytest.importorskip("s3fs")
    s3_client.put_object(Bucket=s3_bucket, Key="data/train.bin", Body=token_bytes(0))
    return {"url": f"s3://{s3_bucket}/data/train.bin", "endpoint": s3_endpoint}


@contextmanager
def counting_gets(url: str, endpoint: str) -> Iterator[list[str]]:
    """The ``Range`` of every GET this process's s3fs client sends while the block runs.

    s3fs instances are cached per process and arguments, so a reader opened with the same
    endpoint uses this very client.
    """
    import fsspec

    fs, path = fsspec.core.url_to_fs(url, endpoint_url=endpoint)
    fs.info(path)  # the client exists from here on
    ranges: list[str] = []

    def count(params: dict[str, Any], **_: Any) -> None:
        ranges.append(params.get("headers", {}).get("Range", "whole"))

    fs.s3.meta.events.register("before-call.s3.GetObject", count)
    try:
        yield ranges
    finally:
        fs.s3.meta.events.unregister("before-call.s3.GetObject", count)


class Pass(NamedTuple):
    """What one process saw reading the whole file once."""

    pid: int
    gets: int
    reads: int
    disk_hits: int
    disk_misses: int
    most_held: int


def read_everything(
    url: str, endpoint: str, cache_dir: str | None, salt: int, reverse: bool = False, bound: int = 1 << 30
) -> Pass:
    """Open a reader in this (fresh) process and read every sequence, checking each against ``salt``'s file."""
    expected = torch.tensor(token_values(salt))
    with counting_gets(url, endpoint) as gets:
        reader = TokenReader(
            url,
            seq_len=SEQ_LEN,
            block_size=BLOCK,
            cache_bytes=0,  # every read goes to the disk cache (or the store)
            cache_dir=cache_dir,
            cache_dir_bytes=bound,
            storage_options={"endpoint_url": endpoint},
        )
        starts = list(range(0, len(reader), CHUNK))
        most_held = 0
        for start in reversed(starts) if reverse else starts:
            count = min(CHUNK, len(reader) - start)
            flat = expected[start * SEQ_LEN : (start + count) * SEQ_LEN + 1]
            assert torch.equal(reader.sequences(start, count), flat.unfold(0, SEQ_LEN + 1, SEQ_LEN))
            most_held = max(most_held, reader.cache_stats().disk_held_bytes)
        stats = reader.cache_stats()
        reader.close()
        return Pass(os.getpid(), len(gets), stats.reads, stats.disk_hits, stats.disk_misses, most_held)


def in_processes(*calls: tuple[Any, ...]) -> list[Pass]:
    """Each call of ``read_everything`` in a fresh process of its own, all at once."""
    context = multiprocessing.get_context("fork")
    with context.Pool(len(calls), maxtasksperchild=1) as pool:
        passes = pool.starmap_async(read_everything, calls).get(timeout=240)
    assert len({result.pid for result in passes} | {os.getpid()}) == len(calls) + 1
    return passes


def cached_files(cache_dir: Path) -> dict[str, int]:
    return {path.name: path.stat().st_size for path in cache_dir.iterdir() if path.name.endswith(BLOCK_SUFFIX)}


@pytest.mark.slow
def test_a_new_process_reads_blocks_on_disk_without_a_request(remote, tmp_path):
    url, endpoint, cache = remote["url"], remote["endpoint"], str(tmp_path / "cache")
    first, backwards = in_processes((url, endpoint, cache, 0), (url, endpoint, cache, 0, True))
    assert first.gets >= 1 and backwards.gets >= 1  # two writers at once, each block written whole
    files = cached_files(tmp_path / "cache")
    assert len(files) == BLOCKS and sum(files.values()) == TOKENS * 2 + 4 * BLOCKS  # + a CRC-32 each
    assert not [name for name in os.listdir(cache) if name.startswith(TEMP_PREFIX)]

    (again,) = in_processes((url, endpoint, cache, 0))
    assert (again.gets, again.reads, again.disk_misses) == (0, 0, 0)
    assert again.disk_hits >= BLOCKS
    (uncached,) = in_processes((url, endpoint, None, 0))  # the same pass without cache_dir
    assert uncached.gets >= BLOCKS and uncached.disk_hits == 0


@pytest.mark.slow
def test_an_overwritten_object_is_read_fresh_never_from_old_blocks(remote, s3_client, s3_bucket, tmp_path):
    url, endpoint, cache = remote["url"], remote["endpoint"], str(tmp_path / "cache")
    old_reader = TokenReader(
        url, seq_len=SEQ_LEN, block_size=BLOCK, cache_dir=cache, storage_options={"endpoint_url": endpoint}
    )
    in_processes((url, endpoint, cache, 0))
    old_files = cached_files(tmp_path / "cache")
    assert len(old_files) == BLOCKS

    s3_client.put_object(Bucket=s3_bucket, Key="data/train.bin", Body=token_bytes(1))  # same size, new ETag
    (fresh,) = in_processes((url, endpoint, cache, 1))  # checks every token against the new file
    assert fresh.disk_misses == fresh.gets == BLOCKS  # every block fetched from the new version, once
    files = cached_files(tmp_path / "cache")
    assert len(files) == BLOCKS and not set(files) & set(old_files)  # the old version's blocks are gone

    worker = pickle.loads(pickle.dumps(old_reader))  # a DataLoader worker of a reader opened before
    with pytest.raises(TokenFileError, match="changed while it was being read"):
        worker.sequences(0, 1)
    with pytest.raises(TokenFileError, match="changed while it was being read"):
        old_reader.sequences(100, 1)  # not in its memory cache, not on disk for its version


@pytest.mark.slow
def test_the_bound_holds_with_several_processes_evicting(remote, tmp_path):
    url, endpoint, cache = remote["url"], remote["endpoint"], str(tmp_path / "cache")
    bound = 10 * (BLOCK + 4)  # 10 of the 32 blocks
    passes = in_processes((url, endpoint, cache, 0, False, bound), (url, endpoint, cache, 0, True, bound))
    assert all(0 < result.most_held <= bound for result in passes)  # the count, after every read
    files = cached_files(tmp_path / "cache")
    assert 0 < sum(files.values()) <= bound
    assert not [name for name in os.listdir(cache) if name.startswith(TEMP_PREFIX)]


def test_a_truncated_or_damaged_file_is_fetched_again(remote, tmp_path):
    url, endpoint, cache = remote["url"], remote["endpoint"], tmp_path / "cache"
    options = {"endpoint_url": endpoint}

    def reader() -> TokenReader:
        return TokenReader(
            url, seq_len=SEQ_LEN, block_size=BLOCK, cache_bytes=0, cache_dir=cache, storage_options=options
        )

    expected = reader().tokens(0, TOKENS)
    files = sorted(cached_files(cache))
    assert len(files) == BLOCKS
    truncated, damaged, vanished = (cache / files[i] for i in (3, 7, 9))
    truncated.write_bytes(truncated.read_bytes()[:100])
    data = bytearray(damaged.read_bytes())
    data[5] ^= 0xFF  # the right length, the wrong checksum
    damaged.write_bytes(bytes(data))
    vanished.unlink()  # evicted by another process after this one listed it

    with counting_gets(url, endpoint) as gets:
        again = reader()
        assert torch.equal(again.tokens(0, TOKENS), expected)
    assert len(gets) == 3 and again.cache_stats().disk_misses == 3
    assert cached_files(cache)[truncated.name] == BLOCK + 4 and len(cached_files(cache)) == BLOCKS
    with counting_gets(url, endpoint) as gets:
        assert torch.equal(reader().tokens(0, TOKENS), expected)
    assert gets == []


def test_a_pickled_reader_shares_the_directory(remote, tmp_path):
    url, endpoint = remote["url"], remote["endpoint"]
    reader = TokenReader(
        url, seq_len=SEQ_LEN, block_size=BLOCK, cache_dir=tmp_path, storage_options={"endpoint_url": endpoint}
    )
    first = reader.sequences(0, 30)
    copy = pickle.loads(pickle.dumps(reader))  # what a DataLoader worker receives
    with counting_gets(url, endpoint) as gets:
        assert torch.equal(copy.sequences(0, 30), first)
    stats = copy.cache_stats()
    assert gets == [] and stats.disk_hits >= 1 and stats.disk_capacity == reader.cache_stats().disk_capacity


def test_an_abandoned_temporary_file_is_removed_and_not_ours_is_kept(remote, tmp_path):
    url, endpoint = remote["url"], remote["endpoint"]
    abandoned, mine = tmp_path / f"{TEMP_PREFIX}killed", tmp_path / "notes.txt"
    abandoned.write_bytes(b"x" * 100)
    mine.write_bytes(b"y" * 100_000)  # more than the bound: not ours, never counted or removed
    os.utime(abandoned, (1, 1))
    reader = TokenReader(
        url,
        seq_len=SEQ_LEN,
        block_size=BLOCK,
        cache_dir=tmp_path,
        cache_dir_bytes=4 * (BLOCK + 4),
        storage_options={"endpoint_url": endpoint},
    )
    reader.tokens(0, TOKENS)
    assert not abandoned.exists() and mine.exists()
    assert sum(cached_files(tmp_path).values()) == reader.cache_stats().disk_held_bytes <= 4 * (BLOCK + 4)


def test_cache_dir_options(tmp_path, remote):
    local = tmp_path / "local.bin"
    local.write_bytes(token_bytes(0))
    reader = TokenReader(local, seq_len=SEQ_LEN, cache_dir=tmp_path / "cache")  # a local file: ignored
    assert reader.sequences(0, 3).shape == (3, SEQ_LEN + 1)
    assert not (tmp_path / "cache").exists() and reader.cache_stats().disk_capacity == 0
    with pytest.raises(ValueError, match="cache_dir_bytes must hold at least one block"):
        TokenReader(
            remote["url"],
            seq_len=SEQ_LEN,
            block_size=BLOCK,
            cache_dir=tmp_path / "cache",
            cache_dir_bytes=BLOCK,
            storage_options={"endpoint_url": remote["endpoint"]},
        )


def test_a_cache_dir_that_cannot_be_used_warns_and_reads_on_from_the_store(tmp_path, remote):
    """Not writable, not a directory (as here: a file stands in its path; root ignores modes):
    a warning, and the reader reads from the store as without ``cache_dir``."""
    (tmp_path / "file").write_bytes(b"x")
    with pytest.warns(RuntimeWarning, match="cannot be used.*reading on from the store"):
        reader = TokenReader(
            remote["url"],
            seq_len=SEQ_LEN,
            block_size=BLOCK,
            cache_dir=tmp_path / "file" / "cache",
            storage_options={"endpoint_url": remote["endpoint"]},
        )
    assert reader.sequences(0, 3).shape == (3, SEQ_LEN + 1)
    assert reader.cache_stats().disk_capacity == 0
