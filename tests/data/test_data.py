"""gradientmail.data: the token reader (local and S3 through moto's server), writer and corpus."""

from __future__ import annotations

import os
import pickle
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from data_workers import ReaderDataset
from torch.utils.data import DataLoader

from gradientmail.cli import main as cli_main
from gradientmail.data import (
    SequenceRangeError,
    TokenFileError,
    TokenReader,
    build_stdlib_corpus,
    stdlib_files,
    text_files,
    write_tokens,
)
from gradientmail.data.formats import npy_header


def raw_file(path: Path, tokens: list[int], code: str = "<H") -> Path:
    path.write_bytes(b"".join(struct.pack(code, t) for t in tokens))
    return path


@pytest.fixture
def counting(tmp_path) -> Path:
    """A raw uint16 file whose token i is i: 1,000 tokens."""
    return raw_file(tmp_path / "count.bin", list(range(1000)))


# -- reading ------------------------------------------------------------------------------------
def test_sequences_are_seq_len_plus_one_tokens_sharing_one(counting):
    reader = TokenReader(counting, seq_len=10)
    assert (reader.dtype, reader.num_tokens, len(reader)) == ("uint16", 1000, 99)
    batch = reader.sequences(3, 4)
    assert batch.dtype == torch.int64 and batch.shape == (4, 11)
    assert batch[0].tolist() == list(range(30, 41))
    assert batch[1, 0] == batch[0, -1]  # each row starts where the previous one ended
    x, y = batch[:, :-1], batch[:, 1:]
    assert torch.equal(y, x + 1)
    assert torch.equal(reader.sequences(98, 1)[0], torch.arange(980, 991))  # the last one
    assert reader.sequences(5, 0).shape == (0, 11)


def test_uint32_and_npy_files(tmp_path):
    big = [70_000 + i for i in range(50)]
    reader = TokenReader(raw_file(tmp_path / "big.bin", big, "<I"), seq_len=7, dtype="uint32")
    assert reader.sequences(0, 7).flatten().unique().tolist()[:3] == big[:3]
    path = tmp_path / "tokens.npy"
    path.write_bytes(npy_header("uint32", len(big)) + struct.pack(f"<{len(big)}I", *big))
    assert TokenReader(path, seq_len=7).dtype == "uint32"
    assert TokenReader(path, seq_len=7).tokens(0, 50).tolist() == big


def test_npy_written_by_numpy_and_read_back_by_numpy(tmp_path):
    np = pytest.importorskip("numpy")
    np.save(tmp_path / "a.npy", np.arange(500, dtype=np.uint16))
    assert TokenReader(tmp_path / "a.npy", seq_len=9).tokens(490, 10).tolist() == list(range(490, 500))
    (tmp_path / "doc.txt").write_bytes(b"hello world")
    write_tokens(tmp_path / "b.npy", [tmp_path / "doc.txt"], eot=256)
    assert np.load(tmp_path / "b.npy").tolist() == [*b"hello world", 256]


def test_cache_holds_at_most_its_bound_and_reuses_blocks(counting):
    reader = TokenReader(counting, seq_len=10, block_size=64, cache_bytes=256)
    generator = torch.Generator().manual_seed(0)
    for start in torch.randint(0, 90, (200,), generator=generator).tolist():
        assert torch.equal(reader.sequences(start, 5)[:, 0], torch.arange(start, start + 5) * 10)
        stats = reader.cache_stats()
        assert stats.held_bytes <= 256 and stats.capacity == 256
    before = reader.cache_stats()
    reader.sequences(0, 1)  # 22 bytes in block 0
    reader.sequences(0, 1)
    after = reader.cache_stats()
    assert after.reads - before.reads <= 1 and after.hits > before.hits


def test_missing_blocks_are_fetched_in_one_ranged_read(counting):
    reader = TokenReader(counting, seq_len=10, block_size=64, cache_bytes=1024)
    reader.sequences(0, 10)  # 202 bytes: blocks 0-3
    stats = reader.cache_stats()
    assert (stats.reads, stats.misses, stats.bytes_read) == (1, 4, 256)
    whole = reader.sequences(0, 99)  # larger than the cache: served, never held beyond the bound
    assert whole[-1, -1] == 990 and reader.cache_stats().held_bytes <= 1024


def test_cache_smaller_than_a_block_reads_just_the_range(counting):
    reader = TokenReader(counting, seq_len=10, block_size=1 << 20, cache_bytes=0)
    reader.sequences(10, 2)
    assert reader.cache_stats().bytes_read == 21 * 2 and reader.cache_stats().held_bytes == 0


# -- bad inputs -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "start, count, message",
    [
        (99, 1, "reads past the end"),
        (0, 100, "holds 99 sequences"),
        (-1, 1, "start must be >= 0"),
        (0, -2, "count must be >= 0"),
    ],
)
def test_out_of_range_requests_are_refused(counting, start, count, message):
    with pytest.raises(SequenceRangeError, match=message) as info:
        TokenReader(counting, seq_len=10).sequences(start, count)
    assert isinstance(info.value, IndexError)


def test_non_integer_arguments_are_refused(counting):
    with pytest.raises(TypeError, match="start must be an int"):
        TokenReader(counting, seq_len=10).sequences(1.5, 1)
    with pytest.raises(ValueError, match="seq_len must be >= 1"):
        TokenReader(counting, seq_len=0)


def test_file_size_not_a_multiple_of_the_token_size(tmp_path):
    path = tmp_path / "odd.bin"
    path.write_bytes(b"\x01\x00\x02")
    with pytest.raises(TokenFileError, match=r"3 bytes is not a whole number of uint16 tokens"):
        TokenReader(path, seq_len=1)
    path.write_bytes(b"\x01\x00" * 3)
    with pytest.raises(TokenFileError, match="6 bytes is not a whole number of uint32"):
        TokenReader(path, seq_len=1, dtype="uint32")


def test_unsupported_dtypes(counting, tmp_path):
    with pytest.raises(TokenFileError, match="unsupported token dtype 'float32'"):
        TokenReader(counting, seq_len=4, dtype="float32")
    np = pytest.importorskip("numpy")
    np.save(tmp_path / "f.npy", np.zeros(10, dtype=np.float32))
    with pytest.raises(TokenFileError, match="'<f4' is not a token dtype"):
        TokenReader(tmp_path / "f.npy", seq_len=4)
    np.save(tmp_path / "be.npy", np.zeros(10, dtype=">u2"))
    with pytest.raises(TokenFileError, match="big-endian"):
        TokenReader(tmp_path / "be.npy", seq_len=4)
    np.save(tmp_path / "u2.npy", np.zeros(10, dtype=np.uint16))
    with pytest.raises(TokenFileError, match="header says uint16, but dtype='uint32'"):
        TokenReader(tmp_path / "u2.npy", seq_len=4, dtype="uint32")


@pytest.mark.parametrize(
    "data, message",
    [
        (npy_header("uint16", 10) + b"\0" * 18, "truncated: the header says 10 tokens"),
        (npy_header("uint16", 10) + b"\0" * 22, "longer than its header says"),
        (b"\x93NUMPY\x01\x00\xff\xff" + b" " * 20, "header of 65,535 bytes"),
        (b"\x93NUMPY\x01\x00\x08\x00__import", "unreadable .npy header"),
        (b"\x93NUMPY\x01\x00\x07\x00[1, 2]\n", "must be a dict"),
        (b"PK\x03\x04" + b"\0" * 20, "not a .npy file"),
    ],
)
def test_corrupt_npy_files(tmp_path, data, message):
    path = tmp_path / "bad.npy"
    path.write_bytes(data)
    with pytest.raises(TokenFileError, match=message):
        TokenReader(path, seq_len=2)


def test_npy_bytes_under_a_bin_name_and_short_files(tmp_path):
    path = tmp_path / "x.bin"
    path.write_bytes(npy_header("uint16", 10) + b"\0" * 20)
    with pytest.raises(TokenFileError, match="starts with the .npy magic"):
        TokenReader(path, seq_len=2)
    assert TokenReader(path, seq_len=2, format="npy").num_tokens == 10
    with pytest.raises(TokenFileError, match="fewer than one sequence of seq_len \\+ 1 = 11"):
        TokenReader(raw_file(tmp_path / "short.bin", [1] * 10), seq_len=10)
    with pytest.raises(FileNotFoundError, match="no token file at"):
        TokenReader(tmp_path / "missing.bin", seq_len=2)


def test_tokens_outside_the_vocabulary_are_named(tmp_path):
    reader = TokenReader(raw_file(tmp_path / "v.bin", [1, 2, 3, 300, 4, 5]), seq_len=2, vocab_size=256)
    assert reader.sequences(0, 1).tolist() == [[1, 2, 3]]
    with pytest.raises(TokenFileError, match="token 300 at position 3 is not below vocab_size=256"):
        reader.sequences(1, 1)


def test_a_file_changed_after_pickling_is_refused(counting):
    copy = pickle.loads(pickle.dumps(TokenReader(counting, seq_len=10)))
    with open(counting, "ab") as stream:
        stream.write(b"\0\0")
    with pytest.raises(TokenFileError, match="2,002 bytes now, 2,000 when the reader was created"):
        copy.sequences(0, 1)


# -- DataLoader worker processes ------------------------------------------------------------------
def read_in_workers(reader: TokenReader, context: str) -> list[tuple[int, torch.Tensor, int]]:
    loader = DataLoader(ReaderDataset(reader, 8), batch_size=None, num_workers=2, multiprocessing_context=context)
    return list(loader)


@pytest.mark.slow
@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_reader_pickles_into_dataloader_workers(counting, context):
    reader = TokenReader(counting, seq_len=10, block_size=64, cache_bytes=128)
    reader.sequences(0, 1)  # the parent's handle and cache are not what workers use
    items = read_in_workers(reader, context)
    pids = {pid for pid, _, _ in items}
    assert len(pids) == 2 and os.getpid() not in pids
    for index, (_, batch, reads) in enumerate(items):
        assert torch.equal(batch, reader.sequences(2 * index, 2))
        assert reads >= 1  # the worker's own cache fetched from its own handle
    assert reader.cache_stats().held_bytes <= 128


# -- S3 through moto's server ----------------------------------------------------------------------
@pytest.fixture
def s3_tokens(s3_client, s3_bucket, counting) -> str:
    pytest.importorskip("s3fs")
    s3_client.put_object(Bucket=s3_bucket, Key="data/count.bin", Body=counting.read_bytes())
    return f"s3://{s3_bucket}/data/count.bin"


@pytest.mark.slow
def test_s3_reads_are_ranged_and_cached(s3_tokens, s3_endpoint, counting):
    reader = TokenReader(
        s3_tokens, seq_len=10, block_size=256, cache_bytes=512, storage_options={"endpoint_url": s3_endpoint}
    )
    local = TokenReader(counting, seq_len=10)
    assert torch.equal(reader.sequences(40, 3), local.sequences(40, 3))
    stats = reader.cache_stats()
    assert stats.reads == 1 and stats.bytes_read == 256 < counting.stat().st_size
    reader.sequences(41, 1)
    assert reader.cache_stats().reads == 1  # same block: no request
    assert torch.equal(reader.sequences(0, 99), local.sequences(0, 99))
    assert reader.cache_stats().held_bytes <= 512


@pytest.mark.slow
def test_s3_reader_in_forked_workers(s3_tokens, s3_endpoint, counting):
    reader = TokenReader(s3_tokens, seq_len=10, storage_options={"endpoint_url": s3_endpoint})
    reader.sequences(0, 1)  # the parent's s3fs client exists before the fork
    items = read_in_workers(reader, "fork")
    assert len({pid for pid, _, _ in items}) == 2
    local = TokenReader(counting, seq_len=10)
    assert all(torch.equal(batch, local.sequences(2 * i, 2)) for i, (_, batch, _) in enumerate(items))


@pytest.mark.slow
def test_s3_object_overwritten_during_a_run_is_refused_not_mixed(
    s3_tokens, s3_client, s3_bucket, s3_endpoint, counting
):
    reader = TokenReader(
        s3_tokens, seq_len=10, block_size=256, cache_bytes=512, storage_options={"endpoint_url": s3_endpoint}
    )
    first = reader.sequences(0, 1)  # block 0, of the version opened
    assert torch.equal(first, TokenReader(counting, seq_len=10).sequences(0, 1))
    s3_client.put_object(Bucket=s3_bucket, Key="data/count.bin", Body=bytes(counting.stat().st_size))  # same size
    with pytest.raises(TokenFileError, match="changed while it was being read"):
        reader.sequences(60, 1)  # another block: would be the new version's zeros
    assert torch.equal(reader.sequences(0, 1), first)  # cached blocks of the pinned version stay


def test_s3_missing_object(s3_bucket, s3_endpoint):
    pytest.importorskip("s3fs")
    with pytest.raises(FileNotFoundError, match=f"no token file at s3://{s3_bucket}/nope.bin"):
        TokenReader(f"s3://{s3_bucket}/nope.bin", seq_len=4, storage_options={"endpoint_url": s3_endpoint})


# -- writing ----------------------------------------------------------------------------------------
def test_write_bytes_from_files_and_directories(tmp_path):
    (tmp_path / "src" / "pkg").mkdir(parents=True)
    (tmp_path / "src" / "b.py").write_bytes(b"bb")
    (tmp_path / "src" / "pkg" / "a.py").write_bytes(b"\xff\x00a")
    (tmp_path / "src" / "notes.txt").write_bytes(b"skipped")
    (tmp_path / "src" / ".hidden.py").write_bytes(b"skipped")
    files = text_files([tmp_path / "src"], suffixes=[".py"])
    assert [f.name for f in files] == ["b.py", "a.py"]
    info = write_tokens(tmp_path / "out.bin", files, eot=256)
    assert (info.tokens, info.documents, info.dtype) == (7, 2, "uint16")
    assert TokenReader(info.path, seq_len=1).tokens(0, 7).tolist() == [98, 98, 256, 255, 0, 97, 256]
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_write_with_a_tokenizer(tmp_path):
    (tmp_path / "doc.txt").write_text("aé€", encoding="utf-8")
    info = write_tokens(tmp_path / "t.bin", [tmp_path / "doc.txt"], tokenizer=lambda s: [ord(c) for c in s])
    assert TokenReader(info.path, seq_len=1).tokens(0, 3).tolist() == [97, 233, 8364]
    with pytest.raises(TokenFileError, match="returned 70000, not a uint16 token id \\(pass dtype='uint32'\\)"):
        write_tokens(tmp_path / "t.bin", [tmp_path / "doc.txt"], tokenizer=lambda s: [1, 70_000])
    assert TokenReader(tmp_path / "t.bin", seq_len=1).num_tokens == 3  # the old file is untouched
    with pytest.raises(TokenFileError, match="returned -1"):
        write_tokens(tmp_path / "u.bin", [tmp_path / "doc.txt"], tokenizer=lambda s: [-1])
    (tmp_path / "latin.txt").write_bytes(b"caf\xe9")
    with pytest.raises(TokenFileError, match="latin.txt: not utf-8 text"):
        write_tokens(tmp_path / "u.bin", [tmp_path / "latin.txt"], tokenizer=list)
    with pytest.raises(TokenFileError, match="no input files"):
        write_tokens(tmp_path / "u.bin", [])
    assert not (tmp_path / "u.bin").exists()


def test_stdlib_corpus_split_by_file_and_reused(tmp_path):
    root = tmp_path / "lib"
    for i in range(40):
        (root / f"mod{i}").mkdir(parents=True)
        (root / f"mod{i}" / "__init__.py").write_text(f"x = {i}\n")
    (root / "site-packages" / "third").mkdir(parents=True)
    (root / "site-packages" / "third" / "big.py").write_text("excluded\n" * 100)
    corpus = build_stdlib_corpus(tmp_path / "c", validation=0.2, root=root)
    assert corpus.files == 40 and corpus.vocab_size == 256
    assert corpus.train_tokens + corpus.validation_tokens == sum(len(f"x = {i}\n") for i in range(40))
    assert 0 < corpus.validation_tokens < corpus.train_tokens
    stamp = corpus.train.stat().st_mtime_ns
    assert build_stdlib_corpus(tmp_path / "c", validation=0.2, root=root) == corpus
    assert corpus.train.stat().st_mtime_ns == stamp  # reused, not rewritten
    corpus.train.write_bytes(b"\0\0")  # damaged: rebuilt
    assert build_stdlib_corpus(tmp_path / "c", validation=0.2, root=root).train.stat().st_size > 2


@pytest.mark.slow
def test_stdlib_files_are_the_standard_library():
    files = stdlib_files()
    names = {f.name for f in files}
    assert {"os.py", "functools.py"} <= names and len(files) > 100
    assert not any("site-packages" in f.parts for f in files)


def test_cli_writes_token_files(tmp_path, capsys):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.py").write_bytes(b"abc")
    assert cli_main(["tokens", "write", str(tmp_path / "o.npy"), str(tmp_path / "d")]) == 0
    assert "3 uint16 tokens from 1 files" in capsys.readouterr().out
    assert TokenReader(tmp_path / "o.npy", seq_len=2).tokens(0, 3).tolist() == [97, 98, 99]
    assert cli_main(["tokens", "write", str(tmp_path / "o.bin"), str(tmp_path / "nothing")]) == 1
    assert "no file or directory at" in capsys.readouterr().err


@pytest.mark.slow
def test_python_m_gradientmail_data(tmp_path):
    (tmp_path / "a.py").write_bytes(b"xyz")
    done = subprocess.run(
        [sys.executable, "-m", "gradientmail.data", "write", str(tmp_path / "o.bin"), str(tmp_path / "a.py")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "o.bin").read_bytes() == b"x\0y\0z\0"


def test_a_huge_npy_shape_is_refused_in_a_short_message(tmp_path):
    """Hostile input is echoed short: a 4,000-digit shape gave a 10,786-character message."""
    header = "{'descr': '<u2', 'fortran_order': False, 'shape': (" + "9" * 4000 + ",), }"
    header += " " * (-(len(header) + 11) % 64) + "\n"
    path = tmp_path / "huge.npy"
    path.write_bytes(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode() + b"\0" * 20)
    with pytest.raises(TokenFileError, match="holds more tokens than any file can") as caught:
        TokenReader(path, seq_len=2)
    assert len(str(caught.value)) < 400


def test_no_error_message_is_longer_than_two_thousand_characters():
    from gradientmail.errors import MAX_MESSAGE, MailboxError

    for error in (TokenFileError("start " + "x" * 50_000 + " end"), MailboxError("start " + "y" * 5_000 + " end")):
        text = str(error)
        assert len(text) == MAX_MESSAGE and "characters in all; the middle cut" in text, text[-60:]
        assert text.startswith("start ") and text.endswith(" end"), "what failed and its cause both stay"
    assert str(TokenFileError("short")) == "short"
