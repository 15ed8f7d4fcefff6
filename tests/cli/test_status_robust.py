"""``gradientmail status`` on odd records never tracebacks.

Odd records (a progress ``last_seen`` of -1e300, a nested JSON claim, fields of the wrong type,
NaN) are listed as unreadable, one line each; ``--json`` is strict JSON (no NaN or Infinity).
Runs the real command in a fresh process, on a directory and on S3 through moto's server.
"""

from __future__ import annotations

import json
import os
import sys
import time

import pytest
from cli_helpers import cli_env, run_cli, run_cli_measured, write_documented_run

from gradientmail.errors import RunNotFoundError
from gradientmail.status import read_run, require_run


def _strict(text: str):
    """``json.loads`` that refuses NaN and Infinity, as every other JSON parser does."""

    def refuse(name: str):
        raise ValueError(f"{name} in --json output")

    return json.loads(text, parse_constant=refuse)


def _plant_odd_records(box) -> None:
    now = time.time()
    box.put_if_absent("units/nested.json", b'{"learner": ' + b"[" * 5000 + b"]" * 5000 + b"}")
    box.put_if_absent("units/dotdot.json", json.dumps({"learner": "..", "token": "t"}).encode())
    box.put_if_absent("units/types.json", json.dumps({"learner": "node-A", "claimed_at": "noon", "pid": "12"}).encode())
    box.put_if_absent("units/plain.json", b"node-Z")  # an old claim: just the learner's name
    box.put("progress/node-A.json", json.dumps({"learner": "node-A", "samples": 5, "last_seen": -1e300}).encode())
    box.put("progress/node-B.json", b'{"learner": "node-B", "samples_per_s": NaN, "samples": 1}')
    box.put(
        "progress/node-C.json",
        json.dumps({"learner": "node-C", "samples": 10**18, "started": 0, "last_seen": 1e-300}).encode(),
    )
    box.put(
        "progress/node-D.json",
        json.dumps(
            {"learner": "node-D", "samples": 8, "started": now - 4, "last_seen": now, "finished": False}
        ).encode(),
    )
    box.put("leases/node-D.json", b'{"lease_s": 1e999, "state": "running", "time": 0}')


ODD_KEYS = {
    "units/nested.json",
    "units/dotdot.json",
    "units/types.json",
    "progress/node-A.json",
    "progress/node-B.json",
    "leases/node-D.json",
}


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["local", "s3"])
def test_status_json_of_odd_records_is_strict_json_listing_them(request, mailbox_factory, backend):
    box = mailbox_factory(backend)
    write_documented_run(box, units=8)
    _plant_odd_records(box)
    if backend == "local":
        url, env = str(box.path), cli_env()
    else:
        url = f"s3://{request.getfixturevalue('s3_bucket')}/run"
        env = cli_env(AWS_ENDPOINT_URL=request.getfixturevalue("s3_endpoint"))
    result = run_cli("status", "--json", url, env=env)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    doc = _strict(result.stdout)
    assert {record["key"] for record in doc["unreadable"]} == ODD_KEYS
    problems = {record["key"]: record["problem"] for record in doc["unreadable"]}
    assert "nested deeper than" in problems["units/nested.json"]
    assert "not a unix time" in problems["progress/node-A.json"]
    assert "NaN is not JSON" in problems["progress/node-B.json"]
    assert doc["units_claimed"] == 12  # unreadable claims still count: their units are taken
    rows = {row["learner"]: row for row in doc["learners"]}
    assert rows["?"]["units"] == 3 and rows["node-Z"]["units"] == 1
    assert rows["node-C"]["samples_per_s"] is None  # 1e18 samples in 1e-300 s: not a rate
    assert rows["node-D"]["samples_per_s"] == pytest.approx(2.0, rel=0.01)


@pytest.mark.slow
def test_status_table_of_odd_records_prints_one_line_notes(tmp_path):
    from gradientmail import LocalMailbox

    box = LocalMailbox(tmp_path / "run")
    write_documented_run(box, units=8)
    _plant_odd_records(box)
    result = run_cli("status", str(tmp_path / "run"), env=cli_env(COLUMNS="400"))
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    notes = [
        line.strip()
        for line in result.stdout.splitlines()
        if "'units/" in line or "'progress/" in line or "'leases/" in line
    ]
    assert len(notes) == 5, result.stdout  # the first five, one line each
    assert "6 unreadable record(s) skipped" in result.stdout
    assert "... and 1 more (--json lists all)" in result.stdout


@pytest.mark.slow
def test_status_of_a_run_with_only_an_unreadable_run_record(tmp_path):
    from gradientmail import LocalMailbox

    box = LocalMailbox(tmp_path / "run")
    box.put_if_absent("run.json", b'{"units": -3, "created": NaN}')
    result = run_cli("status", "--json", str(tmp_path / "run"))
    assert result.returncode == 0, result.stderr
    doc = _strict(result.stdout)
    assert doc["units_total"] is None and [r["key"] for r in doc["unreadable"]] == ["run.json"]
    empty = LocalMailbox(tmp_path / "empty")
    empty.put("other/file", b"x")
    with pytest.raises(RunNotFoundError, match="no run in"):  # still: nothing is no run
        require_run(read_run(empty))


def test_a_reader_keeps_listing_an_unreadable_claim_on_later_reads(memory_mailbox):
    """Claim bodies are fetched once (they are permanent); their problems stay listed."""
    from gradientmail.status import RunReader

    memory_mailbox.put_if_absent("units/a", b"{")
    reader = RunReader(memory_mailbox, threads=1)
    first, second = reader.read(), reader.read()
    assert [r.key for r in first.unreadable] == [r.key for r in second.unreadable] == ["units/a"]
    assert read_run(memory_mailbox).to_dict()["unreadable"][0]["problem"].startswith("claim 'units/a'")


STRAY_BYTES = 2**30
"""A stray file's size: sparse (``truncate``), so it costs no disk, but reading it costs 1 GiB."""

PEAK_LIMIT = 300 * 2**20
"""``status`` of a small run stays far below this (about 60 MB); reading one stray: above 1 GiB."""


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="max RSS in KiB and sparse files as on Linux")
def test_status_lists_huge_stray_files_as_unreadable_without_reading_them(tmp_path):
    """A 1 GiB file under ``progress/`` (and under ``units/`` and ``leases/``) is refused after
    reading at most a record's bound of it: the command's peak memory stays far below the file."""
    from gradientmail import LocalMailbox

    box = LocalMailbox(tmp_path / "run")
    write_documented_run(box, units=8)
    strays = ["progress/stray.json", "units/stray.json", "leases/stray.json"]
    for key in strays:
        (tmp_path / "run" / key).parent.mkdir(exist_ok=True)
        with open(tmp_path / "run" / key, "wb") as file:
            os.truncate(file.fileno(), STRAY_BYTES)
    result, peak = run_cli_measured("status", "--json", str(tmp_path / "run"))
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    doc = _strict(result.stdout)
    problems = {record["key"]: record["problem"] for record in doc["unreadable"]}
    assert sorted(problems) == sorted(strays)
    assert "'progress/stray.json': 1,073,741,824 bytes, more than a record may hold" in problems["progress/stray.json"]
    assert doc["units_claimed"] == 9  # the stray claim counts: its unit is taken, by nobody known
    # The stray lease names a learner "stray" (as any unusable lease does), with no lease state.
    assert {row["learner"] for row in doc["learners"]} == {"node-A", "node-B", "node-C", "node-D", "?", "stray"}
    assert peak < PEAK_LIMIT, f"status peaked at {peak / 2**20:.0f} MiB reading {len(strays)} stray 1 GiB files"


def test_a_reader_lists_a_record_too_large_to_read(memory_mailbox):
    """Over the record bound, a record is refused at the read: listed with its size, like any
    other unusable record, and a claim so refused still counts as claimed."""
    from gradientmail.records import MAX_RECORD_BYTES

    huge = b" " * (MAX_RECORD_BYTES + 1)
    for key in ("run.json", "units/a", "progress/p.json", "leases/l.json"):
        memory_mailbox.put(key, huge)
    run = read_run(memory_mailbox)
    assert {record.key: record.problem for record in run.unreadable} == {
        "run.json": "run record 'run.json': 65,537 bytes, more than a record may hold (65,536 bytes)",
        "units/a": "claim 'units/a': 65,537 bytes, more than a record may hold (65,536 bytes)",
        "progress/p.json": "progress record 'progress/p.json': 65,537 bytes, more than a record may hold (65,536 bytes)",
        "leases/l.json": "lease 'leases/l.json': 65,537 bytes, more than a record may hold (65,536 bytes)",
    }
    assert run.units_claimed == 1 and run.claims[0].learner == "?"
    assert run.learner("l") is not None and run.learner("l").lease is None  # judged as no lease
