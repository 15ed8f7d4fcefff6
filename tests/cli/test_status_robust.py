"""Issue 12, items 3 and 10: ``gradientmail status`` on odd records never tracebacks.

Odd records (a progress ``last_seen`` of -1e300, a nested JSON claim, fields of the wrong type,
NaN) are listed as unreadable, one line each; ``--json`` is strict JSON (no NaN or Infinity).
Runs the real command in a fresh process, on a directory and on S3 through moto's server.
"""

from __future__ import annotations

import json
import time

import pytest
from cli_helpers import cli_env, run_cli, write_seed_run

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
    write_seed_run(box, units=8)
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
    write_seed_run(box, units=8)
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
