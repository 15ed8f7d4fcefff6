"""``shards()`` and the shard readers: files as units, parts read exactly once, a replaced file refused.

Shards are real files written at test time (tests/helpers/shard_files.py) from the standard
library's bytes; remote ones live on moto's S3 server.
"""

from __future__ import annotations

import io
import multiprocessing
import os
import pickle
import subprocess
import sys
import tarfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch
from shard_files import corpus_rows, jsonl_bytes, parquet_dataset, shard_node, tar_bytes, write_parquet

from gradientmail.data import (
    FileChangedError,
    JsonLinesReader,
    ParquetReader,
    Part,
    ShardError,
    TarReader,
    TokenReader,
    TokenShardReader,
    shards,
    write_tokens,
)
from gradientmail.data.shard_units import row_parts

pa = pytest.importorskip("pyarrow", reason="the Parquet and JSON Lines readers need pyarrow (the parquet extra)")


def ids_of(pairs) -> list[int]:
    return [n for _index, batch in pairs for n in batch["id"].tolist()]


# -- listing ---------------------------------------------------------------------------------
def test_identifiers_are_paths_relative_to_the_prefix_sorted_hidden_files_left_out(tmp_path):
    for name in ("b/2.jsonl", "a.parquet", "b/1.jsonl", ".hidden", "_SUCCESS", "b/_tmp/x.jsonl", "c.txt"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b'{"id": 1}\n')
    units = shards(tmp_path)
    assert list(units) == ["a.parquet", "b/1.jsonl", "b/2.jsonl", "c.txt"]
    shard = units["b/1.jsonl"]
    assert (shard.url, shard.path, shard.size, shard.format) == (str(tmp_path / "b/1.jsonl"), "b/1.jsonl", 10, "jsonl")
    assert shard.version and shard.version.startswith("mtime=") and shard.part is None
    assert list(shards(f"{tmp_path}/b/*.jsonl")) == ["1.jsonl", "2.jsonl"]  # relative to the glob's directory
    assert list(shards(f"{tmp_path}/**/*.jsonl")) == ["b/1.jsonl", "b/2.jsonl"]
    assert list(shards(tmp_path, suffixes=[".parquet", ".txt"])) == ["a.parquet", "c.txt"]
    assert list(shards(tmp_path / "a.parquet")) == ["a.parquet"]
    with pytest.raises(FileNotFoundError, match="no shards at"):
        shards(f"{tmp_path}/*.npy")
    with pytest.raises(ShardError, match="split must be a positive number"):
        shards(tmp_path, split=0)


def test_row_groups_are_packed_into_parts_and_a_large_one_is_cut():
    assert row_parts([10, 10, 10], 25) == [Part("rows", 0, 20), Part("rows", 20, 30)]
    assert row_parts([10, 10, 10], 30) == [Part("rows", 0, 30)]
    parts = row_parts([3, 50, 3, 3], 20)
    assert [(p.start, p.stop) for p in parts] == [(0, 3), (3, 19), (19, 36), (36, 53), (53, 59)]


# -- Parquet --------------------------------------------------------------------------------------
def test_a_parquet_file_split_by_rows_reads_every_row_once_in_order(tmp_path):
    rows = parquet_dataset(tmp_path, files=2, rows_per_file=57, row_group_rows=8)
    units = shards(tmp_path, split=20)  # 8-row groups packed into parts of 16 rows
    assert list(units)[:2] == ["part-00000.parquet@rows=00-16", "part-00000.parquet@rows=16-32"]
    reader = ParquetReader(batch_rows=5)
    got = [ids_of(reader(shard)) for shard in units.values()]
    assert [n for ids in got for n in ids] == [row["id"] for row in rows]
    assert all(len(ids) <= 20 for ids in got)
    index, batch = next(reader(units["part-00000.parquet@rows=16-32"]))
    assert index == 0 and batch["tokens"].shape == (5, 32) and batch["tokens"].dtype == torch.int64
    assert batch["tokens"][0].tolist() == rows[16]["tokens"]  # the row's own bytes
    cut = shards(tmp_path, split=3)  # groups of 8 cut in 3 parts each
    assert [n for shard in cut.values() for n in ids_of(reader(shard))] == [row["id"] for row in rows]


def test_the_units_of_one_parquet_file_parse_its_footer_once_per_process(tmp_path):
    from gradientmail.data.tables import FOOTERS

    rows = parquet_dataset(tmp_path, files=2, rows_per_file=57, row_group_rows=8)
    units = shards(tmp_path, split=20)  # 4 units a file
    reader = ParquetReader(batch_rows=5)
    before = FOOTERS.parsed
    for _ in range(2):  # two passes: the footers are parsed on the first only
        assert [n for shard in units.values() for n in ids_of(reader(shard))] == [row["id"] for row in rows]
    assert FOOTERS.parsed - before == 2  # one per file, not one per unit (8) or per unit and pass (16)
    ids_of(reader(tmp_path / "part-00000.parquet"))  # a plain path pins no version: parsed, not kept
    assert FOOTERS.parsed - before == 3


def test_a_damaged_parquet_file_cannot_be_split_and_says_which(tmp_path):
    (tmp_path / "bad.parquet").write_bytes(b"PAR1" + b"\0" * 100)
    with pytest.raises(ShardError, match=r"bad.parquet: not a readable Parquet file"):
        shards(tmp_path, split=10)
    assert list(shards(tmp_path)) == ["bad.parquet"]  # listed whole, nothing read


def test_batches_hold_exactly_batch_rows_across_row_groups(tmp_path):
    write_parquet(tmp_path / "a.parquet", corpus_rows(23), row_group_rows=4)
    sizes = [len(batch["id"]) for _index, batch in ParquetReader(batch_rows=10)(tmp_path / "a.parquet")]
    assert sizes == [10, 10, 3]


def test_a_string_column_is_refused_with_the_fix_and_columns_leave_it_out(tmp_path):
    table = pa.table({"id": [1, 2], "text": ["a", "b"]})
    import pyarrow.parquet as pq

    pq.write_table(table, tmp_path / "t.parquet")
    with pytest.raises(ShardError, match=r"column 'text' holds string values.*columns=.*collate="):
        list(ParquetReader()(tmp_path / "t.parquet"))
    assert ids_of(ParquetReader(columns=["id"])(tmp_path / "t.parquet")) == [1, 2]


# -- JSON Lines -------------------------------------------------------------------------------
@pytest.mark.parametrize("split_bytes", [1, 7, 63, 64, 65, 500, 10_000])
def test_json_lines_split_by_bytes_read_every_line_once(tmp_path, split_bytes):
    rows = corpus_rows(40)
    (tmp_path / "a.jsonl").write_bytes(jsonl_bytes(rows))
    units = shards(tmp_path, split_bytes=split_bytes)
    reader = JsonLinesReader(batch_rows=6)
    assert [n for shard in units.values() for n in ids_of(reader(shard))] == list(range(40))
    first = next(reader(next(iter(units.values()))), None)
    if first is not None:
        assert first[1]["tokens"].shape[1] == 32


def test_a_gzipped_json_lines_shard_is_one_unit_read_whole_and_a_damaged_one_named(tmp_path):
    import gzip

    rows = corpus_rows(40)
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(jsonl_bytes(rows)))
    (tmp_path / "b.jsonl").write_bytes(jsonl_bytes(rows))
    units = shards(tmp_path, split_bytes=64)  # the plain file is split, the gzipped one cannot be
    assert units["a.jsonl.gz"].format == "jsonl" and units["a.jsonl.gz"].part is None
    reader = JsonLinesReader(batch_rows=6)
    assert ids_of(reader(units["a.jsonl.gz"])) == list(range(40))
    (tmp_path / "bad.jsonl.gz").write_bytes(b"\x1f\x8b" + b"not gzip" * 10)
    with pytest.raises(ShardError, match=r"bad.jsonl.gz: not a readable gzipped JSON Lines file"):
        list(reader(tmp_path / "bad.jsonl.gz"))


def test_a_json_line_longer_than_a_parse_block_is_read(tmp_path):
    rows = [{"id": 0, "tokens": [7] * 400_000}, *({"id": n, "tokens": [n]} for n in range(1, 5))]  # 1.2 MB line
    (tmp_path / "long.jsonl").write_bytes(jsonl_bytes(rows))
    (shard,) = shards(tmp_path).values()
    (_, batch), *_ = JsonLinesReader(batch_rows=5)(shard)
    assert batch["id"].tolist() == [0, 1, 2, 3, 4]
    assert [len(tokens) for tokens in batch["tokens"]] == [400_000, 1, 1, 1, 1]  # rows of other lengths: a list
    (tmp_path / "empty.jsonl").write_bytes(b"")
    assert list(JsonLinesReader()(tmp_path / "empty.jsonl")) == []


# -- WebDataset tar, token files --------------------------------------------------------------------
def test_a_tar_shard_yields_samples_grouped_by_key(tmp_path):
    rows = corpus_rows(7)
    (tmp_path / "a.tar").write_bytes(tar_bytes(rows))
    pairs = list(TarReader(batch_size=3)(tmp_path / "a.tar"))
    assert [index for index, _ in pairs] == [0, 1, 2]
    assert [batch["cls"].tolist() for _, batch in pairs] == [[0, 1, 2], [3, 4, 5], [6]]
    assert pairs[1][1]["bin"][0].tolist() == rows[3]["tokens"]  # stacked uint8: every sample 32 bytes
    (tmp_path / "bad.tar").write_bytes(b"not a tar" * 100)
    with pytest.raises(ShardError, match="not a readable tar file"):
        list(TarReader()(tmp_path / "bad.tar"))


def test_a_token_file_shard_is_its_sequences_in_batches(tmp_path):
    text = tmp_path / "t.txt"
    text.write_bytes(bytes(range(256)) * 3)
    info = write_tokens(tmp_path / "tokens/a.bin", [text])
    (shard,) = shards(tmp_path / "tokens").values()
    pairs = list(TokenShardReader(seq_len=16, batch_size=10, vocab_size=256)(shard))
    whole = TokenReader(info.path, seq_len=16).sequences(0, (768 - 1) // 16)
    assert torch.equal(torch.cat([batch["input_ids"] for _, batch in pairs]), whole[:, :-1])
    assert torch.equal(torch.cat([batch["labels"] for _, batch in pairs]), whole[:, 1:])


# -- units of epochs() and mix(): a shard in .unit, rows shuffled by the pass -------------------------
@dataclass(frozen=True)
class Pass:
    """Like an ``EpochUnit`` of ``epochs()``: the unit in ``.unit``, the pass's row order drawn."""

    unit: object
    seed: int

    def permutation(self, n: int) -> list[int]:
        return torch.randperm(n, generator=torch.Generator().manual_seed(self.seed)).tolist()


@dataclass(frozen=True)
class FromSource:
    """Like a ``SourceUnit`` of ``mix()``: the unit in ``.unit``, no order of its own."""

    source: str
    unit: object


def test_units_wrapping_a_shard_are_read_and_shuffled_by_their_pass(tmp_path):
    rows = corpus_rows(23)
    write_parquet(tmp_path / "a.parquet", rows, row_group_rows=5)
    (tmp_path / "a.jsonl").write_bytes(jsonl_bytes(rows))
    (tmp_path / "a.tar").write_bytes(tar_bytes(rows))
    units = shards(tmp_path)
    readers = {"parquet": ParquetReader, "jsonl": JsonLinesReader, "tar": TarReader}
    for name, make in readers.items():
        key = "cls" if name == "tar" else "id"
        shard = units[f"a.{name}"]
        plain = make(**({"batch_size": 4} if name == "tar" else {"batch_rows": 4}))
        shuffling = make(shuffle=True, **({"batch_size": 4} if name == "tar" else {"batch_rows": 4}))
        assert [n for _, b in plain(FromSource("web", shard)) for n in b[key].tolist()] == list(range(23))
        for seed in (1, 2):
            value = Pass(FromSource("web", shard), seed)  # epochs(mix(...)): the pass's order wins
            got = [n for _, b in shuffling(value) for n in b[key].tolist()]
            assert got == value.permutation(23), name
            assert [len(b[key]) for _, b in shuffling(value)] == [4, 4, 4, 4, 4, 3]
        with pytest.raises(ShardError, match="shuffle=True.*epochs"):
            list(shuffling(FromSource("web", shard)))
    with pytest.raises(TypeError, match="reads a Shard"):
        list(ParquetReader()(FromSource("web", 7)))


def test_a_token_shard_is_shuffled_by_sequence(tmp_path):
    text = tmp_path / "t.txt"
    text.write_bytes(bytes(range(256)))
    write_tokens(tmp_path / "tokens/a.bin", [text])
    (shard,) = shards(tmp_path / "tokens").values()
    value = Pass(shard, seed=3)
    pairs = list(TokenShardReader(seq_len=16, batch_size=4, shuffle=True)(value))
    firsts = [int(row[0]) // 16 for _, batch in pairs for row in batch["input_ids"]]
    assert firsts == value.permutation((256 - 1) // 16)


# -- a replaced file, pickling ----------------------------------------------------------------------
def test_a_file_replaced_after_listing_is_refused_when_read(tmp_path):
    write_parquet(tmp_path / "a.parquet", corpus_rows(10))
    (tmp_path / "b.jsonl").write_bytes(jsonl_bytes(corpus_rows(10)))
    units = shards(tmp_path)
    write_parquet(tmp_path / "a.parquet", corpus_rows(10, first=10))  # same size, other data
    os.utime(tmp_path / "a.parquet", ns=(1, 1))  # a different mtime even on a coarse clock
    with pytest.raises(FileChangedError, match="replaced since it was listed.*list the shards again"):
        list(ParquetReader()(units["a.parquet"]))
    with open(tmp_path / "b.jsonl", "ab") as stream:
        stream.write(b'{"id": 99, "tokens": []}\n')
    with pytest.raises(FileChangedError, match="replaced since it was listed"):
        list(JsonLinesReader()(units["b.jsonl"]))


def test_a_replaced_tar_or_token_file_is_refused_too(tmp_path):
    (tmp_path / "a.tar").write_bytes(tar_bytes(corpus_rows(3)))
    (tmp_path / "t.txt").write_bytes(bytes(range(200)))
    write_tokens(tmp_path / "a.bin", [tmp_path / "t.txt"])
    units = shards(tmp_path, suffixes=[".tar", ".bin"])
    for name in ("a.tar", "a.bin"):
        os.utime(tmp_path / name, ns=(1, 1))  # rewritten in place: same size, another mtime
    with pytest.raises(FileChangedError, match="replaced since it was listed"):
        list(TarReader()(units["a.tar"]))
    with pytest.raises(FileChangedError, match="replaced since it was listed"):
        list(TokenShardReader(seq_len=4, batch_size=2)(units["a.bin"]))


def test_units_and_readers_pickle_for_dataloader_workers(tmp_path):
    write_parquet(tmp_path / "a.parquet", corpus_rows(10), row_group_rows=3)
    units = shards(tmp_path, split=4)
    reader = pickle.loads(pickle.dumps(ParquetReader(batch_rows=4)))
    assert pickle.loads(pickle.dumps(units)) == units
    assert [n for shard in units.values() for n in ids_of(reader(shard))] == list(range(10))
    for other in (JsonLinesReader(), TarReader(), TokenShardReader(seq_len=4, batch_size=2)):
        assert type(pickle.loads(pickle.dumps(other))) is type(other)


@pytest.mark.slow
def test_nodes_sharing_a_queue_over_shards_read_every_row_once(tmp_path):
    rows = parquet_dataset(tmp_path / "data", files=6, rows_per_file=25, row_group_rows=5)
    context = multiprocessing.get_context("spawn")
    nodes = [
        context.Process(
            target=shard_node,
            args=(str(tmp_path / "data"), str(tmp_path / "box"), f"node-{i}", str(tmp_path / f"seen-{i}.txt"), i % 2),
        )
        for i in range(3)
    ]
    for node in nodes:
        node.start()
    for node in nodes:
        node.join(timeout=240)
    assert [node.exitcode for node in nodes] == [0, 0, 0]
    seen = Counter(int(line) for i in range(3) for line in (tmp_path / f"seen-{i}.txt").read_text().split())
    assert sorted(seen) == [row["id"] for row in rows] and set(seen.values()) == {1}


# -- remote shards and the cache ------------------------------------------------------------------
@pytest.fixture
def bucket_shards(s3_client, s3_bucket, s3_endpoint):
    pytest.importorskip("s3fs")
    import pyarrow.parquet as pq

    rows = corpus_rows(60)

    for index in range(2):
        stream = io.BytesIO()
        pq.write_table(pa.Table.from_pylist(rows[index * 30 : (index + 1) * 30]), stream, row_group_size=10)
        s3_client.put_object(Bucket=s3_bucket, Key=f"shards/train/{index}.parquet", Body=stream.getvalue())
    s3_client.put_object(Bucket=s3_bucket, Key="shards/train/a.jsonl", Body=jsonl_bytes(rows))
    s3_client.put_object(Bucket=s3_bucket, Key="shards/train/a.tar", Body=tar_bytes(rows))
    s3_client.put_object(Bucket=s3_bucket, Key="shards/other/x.jsonl", Body=b"{}\n")
    return f"s3://{s3_bucket}/shards", s3_endpoint, rows


def read_all(units: dict, readers: dict) -> dict[str, list[int]]:
    """Every shard read by the reader of its format: the ids (``cls`` for tar) by format."""
    got: dict[str, list[int]] = {}
    for shard in units.values():
        key = "cls" if shard.format == "tar" else "id"
        got.setdefault(shard.format, []).extend(
            n for _, batch in readers[shard.format](shard) for n in batch[key].tolist()
        )
    return got


@pytest.fixture
def store_gets(bucket_shards) -> Iterator[list[int]]:
    """The bytes of every GET this process's s3fs client gets from the store while the test runs."""
    import fsspec

    fs = fsspec.filesystem("s3", endpoint_url=bucket_shards[1])
    fs.ls("")  # the client exists from here on (readers with the same options share it)
    sizes: list[int] = []

    def count(parsed: dict, **_: object) -> None:
        sizes.append(parsed.get("ContentLength", 0))

    fs.s3.meta.events.register("after-call.s3.GetObject", count)
    try:
        yield sizes
    finally:
        fs.s3.meta.events.unregister("after-call.s3.GetObject", count)


def test_remote_shards_are_listed_read_and_cached_so_a_second_pass_fetches_nothing(bucket_shards, store_gets, tmp_path):
    from gradientmail.data import ShardCache

    prefix, endpoint, rows = bucket_shards
    options = {"endpoint_url": endpoint}
    units = shards(f"{prefix}/train/*", split=20, storage_options=options)
    assert list(units) == [
        "0.parquet@rows=00-20",
        "0.parquet@rows=20-30",
        "1.parquet@rows=00-20",
        "1.parquet@rows=20-30",
        "a.jsonl",
        "a.tar",
    ]
    assert all(shard.version and shard.version.startswith("ETag=") for shard in units.values())
    assert units["a.jsonl"].url == f"{prefix}/train/a.jsonl"
    cache = ShardCache(str(tmp_path / "cache"), block_size=1024)
    readers = {
        "parquet": ParquetReader(batch_rows=7, cache=cache, storage_options=options),
        "jsonl": JsonLinesReader(batch_rows=7, cache=cache, storage_options=options),
        "tar": TarReader(batch_size=7, cache=cache, storage_options=options),
    }

    assert len(store_gets) == 2  # listing: the two Parquet footers, for split=
    store_gets.clear()
    with multiprocessing.get_context("fork").Pool(1) as pool:  # the first pass: another process
        first = pool.apply(read_all, (units, readers))  # units and readers pickled there
    assert first == {"parquet": list(range(60)), "jsonl": list(range(60)), "tar": list(range(60))}
    assert store_gets == []
    assert read_all(units, readers) == first  # here: every block from the disk cache the other process filled
    assert store_gets == []  # 0 bytes from the store
    uncached = ParquetReader(storage_options=options)
    assert ids_of(uncached(units["0.parquet@rows=00-20"])) == list(range(20)) and sum(store_gets) > 0


def test_a_listing_with_a_cache_reads_the_footers_from_disk_the_second_time(bucket_shards, store_gets, tmp_path):
    from gradientmail.data import ShardCache

    prefix, endpoint, _ = bucket_shards
    options = {"endpoint_url": endpoint}
    cache = ShardCache(str(tmp_path / "cache"), block_size=1024)
    first = shards(f"{prefix}/train/*.parquet", split=20, storage_options=options, cache=cache)
    assert len(store_gets) >= 2 and sum(store_gets) > 0  # the two footers, fetched once
    store_gets.clear()
    again = shards(f"{prefix}/train/*.parquet", split=20, storage_options=options, cache=cache)  # a restart
    assert again == first and store_gets == []  # the footers from the cache directory: no GET
    assert shards(f"{prefix}/train/*.parquet", split=20, storage_options=options) == first
    assert len(store_gets) == 2  # without the cache, fetched again


def test_a_remote_gzipped_json_lines_shard_is_read_through_the_cache(bucket_shards, s3_client, s3_bucket, tmp_path):
    import gzip

    from gradientmail.data import ShardCache

    prefix, endpoint, rows = bucket_shards
    s3_client.put_object(Bucket=s3_bucket, Key="shards/gz/a.jsonl.gz", Body=gzip.compress(jsonl_bytes(rows)))
    options = {"endpoint_url": endpoint}
    units = shards(f"{prefix}/gz/", split_bytes=100, storage_options=options)
    assert list(units) == ["a.jsonl.gz"]
    reader = JsonLinesReader(
        batch_rows=7, cache=ShardCache(str(tmp_path / "cache"), block_size=1024), storage_options=options
    )
    assert ids_of(reader(units["a.jsonl.gz"])) == [row["id"] for row in rows]


def test_a_remote_shard_overwritten_after_listing_is_refused(bucket_shards, s3_client, s3_bucket):
    prefix, endpoint, rows = bucket_shards
    options = {"endpoint_url": endpoint}
    units = shards(f"{prefix}/train/", storage_options=options)
    s3_client.put_object(Bucket=s3_bucket, Key="shards/train/a.jsonl", Body=jsonl_bytes(rows[::-1]))  # same size
    with pytest.raises(FileChangedError, match="ETag="):
        list(JsonLinesReader(storage_options=options)(units["a.jsonl"]))


def test_aws_endpoint_url_from_the_environment_reaches_the_store(bucket_shards):
    prefix, endpoint, _ = bucket_shards
    code = (
        "from gradientmail.data import shards, JsonLinesReader\n"
        f"units = shards({prefix + '/train/*.jsonl'!r})\n"
        "print(list(units), sum(len(b['id']) for _, b in JsonLinesReader()(units['a.jsonl'])))\n"
    )
    env = {**os.environ, "AWS_ENDPOINT_URL": endpoint}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["['a.jsonl']", "60"]


def test_the_cache_names_the_endpoint_from_the_environment(monkeypatch):
    from gradientmail.data.disk_cache import remote_identity

    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9000")
    assert remote_identity("s3://b/k", {}) == "s3://b/k @ http://127.0.0.1:9000"  # two stores, two entries
    assert remote_identity("s3://b/k", {"endpoint_url": "http://other"}) == "s3://b/k @ http://other"
    assert remote_identity("gs://b/k", {}) == "gs://b/k"


def test_a_tar_read_through_the_cache_matches_tarfile(bucket_shards, tmp_path):
    prefix, endpoint, rows = bucket_shards
    (tmp_path / "a.tar").write_bytes(tar_bytes(rows))
    with tarfile.open(tmp_path / "a.tar") as tar:
        expected = [tar.extractfile(member).read() for member in tar if member.name.endswith(".bin")]
    samples = list(TarReader(storage_options={"endpoint_url": endpoint}).samples(f"{prefix}/train/a.tar"))
    assert [sample["bin"] for sample in samples] == expected
