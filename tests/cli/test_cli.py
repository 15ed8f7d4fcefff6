"""``gradientmail status`` / ``plot`` and every bad input, driven as a user would (subprocess).

Runs are written by hand in the documented on-store formats, so these tests pin the formats the
CLI reads as much as the CLI itself. The demo has its own file (``test_cli_demo.py``).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from cli_helpers import (
    PNG_SIGNATURE,
    assert_user_error,
    cli_env,
    run_cli,
    write_documented_run,
)

from gradientmail import LocalMailbox

STATUS_KEYS = {
    "mailbox",
    "read_at",
    "created",
    "units_total",
    "units_claimed",
    "learners",
    # added by the elastic queue; None / [] for the design note's queue
    "elastic",
    "units_done",
    "units_in_progress",
    "units_released",
    "units_orphaned",
    "orphaned",
    # records skipped as unusable, [] when none
    "unreadable",
    # learner -> units claimed and not finished ({} when none)
    "unfinished",
}
LEARNER_KEYS = {
    "learner",
    "units",
    "samples",
    # of those, the samples the run's state holds (a Session's learners)
    "samples_in_run",
    "samples_per_s",
    "steps",
    "started",
    "last_seen",
    "finished",
    "done",
    "in_progress",
    "orphaned",
    "lease",
    # a learner's presence record judged, when it was last known alive, and whether it may be dead
    "presence",
    "seen_alive",
    "may_be_dead",
    # units claimed under it and not finished (0 when none)
    "unfinished",
}


@pytest.fixture
def documented_run(tmp_path):
    mailbox = LocalMailbox(tmp_path / "run")
    counts = write_documented_run(mailbox)
    return tmp_path / "run", counts


def _assert_png(path) -> None:
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE)
    import matplotlib.image

    pixels = matplotlib.image.imread(path)
    assert pixels.ndim == 3 and pixels.shape[0] > 50 and pixels.shape[1] > 100


# -- status ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_status_json_reports_the_documented_schedule(documented_run):
    path, counts = documented_run
    result = run_cli("status", "--json", str(path))
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert set(doc) == STATUS_KEYS
    assert doc["units_total"] == 24 and doc["units_claimed"] == 24
    assert doc["created"] == 1_700_000_000.0
    assert [row["learner"] for row in doc["learners"]] == sorted(counts)
    for row in doc["learners"]:
        assert set(row) == LEARNER_KEYS
        assert row["units"] == counts[row["learner"]]
        assert row["samples"] == 640 * counts[row["learner"]]
        assert row["finished"] is True
    assert {row["learner"]: row["units"] for row in doc["learners"]} == {
        "node-A": 11,
        "node-B": 5,
        "node-C": 5,
        "node-D": 3,
    }


def test_a_reader_that_leaves_the_pipe_early_is_not_a_store_error(documented_run):
    """``gradientmail status --json | true``: the reader closed the pipe before the output was
    written; that is the shell's business, not "is the endpoint URL right"."""
    path, _ = documented_run
    read, write = os.pipe()
    os.close(read)  # the reader is gone before anything is written
    try:
        result = subprocess.run(
            [sys.executable, "-m", "gradientmail", "status", "--json", str(path)],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
            env=cli_env(),
        )
    finally:
        os.close(write)
    assert result.stderr == "", result.stderr
    assert result.returncode == 141


@pytest.mark.slow
def test_status_table_shows_learners_and_claimed_of_total(documented_run):
    path, _ = documented_run
    result = run_cli("status", str(path), env=cli_env(COLUMNS="120"))
    assert result.returncode == 0, result.stderr
    assert "24/24" in result.stdout
    for learner, units in {"node-A": 11, "node-B": 5, "node-D": 3}.items():
        line = next(line for line in result.stdout.splitlines() if learner in line)
        assert f" {units} " in line and "finished" in line


@pytest.mark.slow
def test_status_without_run_json_or_progress(tmp_path):
    """Claims alone are a run: the total is unknown and progress fields are null."""
    mailbox = LocalMailbox(tmp_path / "run")
    write_documented_run(mailbox, run_json=False, progress=False)
    mailbox.put_if_absent("units/000099-0.json", b"not json at all\nreally")
    mailbox.put("progress/node-E.json", json.dumps({"learner": "node-E", "samples": 7}).encode())
    result = run_cli("status", "--json", str(tmp_path / "run"))
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["units_total"] is None and doc["units_claimed"] == 25
    rows = {row["learner"]: row for row in doc["learners"]}
    assert rows["?"]["units"] == 1  # an unreadable claim still counts, under "?"
    assert rows["node-E"] == {**dict.fromkeys(LEARNER_KEYS), "learner": "node-E", "units": 0, "samples": 7}
    assert rows["node-A"]["samples"] is None and rows["node-A"]["units"] == 11
    table = run_cli("status", str(tmp_path / "run"))
    assert table.returncode == 0 and "total unknown" in table.stdout


@pytest.mark.slow
def test_status_watch_refreshes_until_ctrl_c(documented_run):
    path, _ = documented_run
    process = subprocess.Popen(
        [sys.executable, "-m", "gradientmail", "status", "--watch", "--json", "--interval", "0.1", str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=cli_env(),
        # Ctrl-C as at a terminal, even when the suite runs in the background (a shell starts
        # background commands with SIGINT ignored, and the child would inherit that).
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        first = json.loads(process.stdout.readline())
        LocalMailbox(path).put_if_absent(
            "units/000099-0.json", json.dumps({"learner": "node-Z", "claimed_at": time.time()}).encode()
        )
        for _ in range(100):  # bounded: the new claim shows up within a few refreshes
            doc = json.loads(process.stdout.readline())
            if doc["units_claimed"] == 25:
                break
        assert first["units_claimed"] == 24 and doc["units_claimed"] == 25
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, stderr
    assert "Traceback" not in stderr


# -- plot -----------------------------------------------------------------------------------
@pytest.mark.slow
def test_plot_writes_a_png(documented_run, tmp_path):
    path, _ = documented_run
    output = tmp_path / "charts" / "gantt.png"
    result = run_cli("plot", str(path), "-o", str(output))
    assert result.returncode == 0, result.stderr
    assert str(output) in result.stdout
    _assert_png(output)


def test_plot_spans_follow_claims_and_progress(tmp_path):
    """In-process: bars end at the next claim of the same thread, the last at last_seen."""
    from gradientmail.plot import spans_from_run
    from gradientmail.status import read_run

    mailbox = LocalMailbox(tmp_path / "run")
    write_documented_run(mailbox, t0=0.0)
    spans = spans_from_run(read_run(mailbox))
    assert len(spans) == 24 and not any(span.estimated for span in spans)
    assert max(span.end for span in spans) == 12.0
    by_learner = {}
    for span in spans:
        by_learner.setdefault(span.learner, []).append(span.end - span.start)
    assert by_learner["node-A"] == [1.0] * 11
    assert by_learner["node-D"] == [4.0] * 3


# -- bad input ------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("command", ["status", "plot"])
def test_nonexistent_mailbox_is_an_error_and_is_not_created(command, tmp_path):
    missing = tmp_path / "no" / "such" / "mailbox"
    result = run_cli(command, str(missing), cwd=tmp_path)
    assert_user_error(result, "no mailbox", str(missing))
    assert not (tmp_path / "no").exists()
    assert not (tmp_path / "gantt.png").exists()


@pytest.mark.slow
@pytest.mark.parametrize("command", ["status", "plot"])
def test_empty_run_is_an_error(command, tmp_path):
    (tmp_path / "empty").mkdir()
    result = run_cli(command, str(tmp_path / "empty"), cwd=tmp_path)
    assert_user_error(result, "no run in")
    assert not (tmp_path / "gantt.png").exists()


@pytest.mark.slow
@pytest.mark.parametrize(
    "url, fragment",
    [
        ("nosuchscheme://bucket/run", "unknown mailbox URL scheme"),
        ("memory://run", "one Python process"),
        ("s3://", "names a bucket"),
    ],
)
@pytest.mark.parametrize("command", ["status", "plot"])
def test_unusable_urls_are_errors(command, url, fragment, tmp_path):
    assert_user_error(run_cli(command, url, cwd=tmp_path), fragment)


@pytest.mark.slow
def test_file_url_works_like_a_path(documented_run):
    path, _ = documented_run
    result = run_cli("status", "--json", path.as_uri())
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["units_claimed"] == 24


@pytest.mark.slow
def test_debug_shows_the_traceback(tmp_path):
    result = run_cli("--debug", "status", str(tmp_path / "missing"))
    assert result.returncode != 0 and "Traceback" in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    "args",
    [
        [],
        ["status"],
        ["plot"],
        ["frobnicate"],
        ["status", "--interval", "0", "x"],
        ["demo", "--nodes", "0"],
        ["demo", "--speeds", "1:fast"],
        ["demo", "--slowdown", "A"],
        ["demo", "--batch-time", "-1"],
    ],
)
def test_argument_errors_exit_2(args):
    result = run_cli(*args)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr


def test_import_stays_light():
    code = (
        "import sys, gradientmail, gradientmail.cli, gradientmail.cli.demo, gradientmail.status, gradientmail.plot; "
        "heavy = {'rich', 'matplotlib', 'torch', 'boto3'} & set(sys.modules); "
        "assert not heavy, heavy"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=cli_env())
    assert result.returncode == 0, result.stderr


# -- S3 (moto's server) ---------------------------------------------------------------------
def _s3_env(endpoint: str, **extra: str) -> dict[str, str]:
    return cli_env(AWS_ENDPOINT_URL=endpoint, **extra)


@pytest.mark.slow
def test_status_json_on_s3(s3_endpoint, s3_bucket):
    from gradientmail import open_mailbox

    mailbox = open_mailbox(f"s3://{s3_bucket}/runs/documented", endpoint_url=s3_endpoint)
    counts = write_documented_run(mailbox)
    result = run_cli("status", "--json", f"s3://{s3_bucket}/runs/documented", env=_s3_env(s3_endpoint))
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["units_total"] == 24 and doc["units_claimed"] == 24
    assert {row["learner"]: row["units"] for row in doc["learners"]} == counts
    # --endpoint-url works as well as AWS_ENDPOINT_URL
    env = cli_env()
    env.pop("AWS_ENDPOINT_URL", None)
    flagged = run_cli("status", "--json", "--endpoint-url", s3_endpoint, f"s3://{s3_bucket}/runs/documented", env=env)
    assert flagged.returncode == 0, flagged.stderr
    assert json.loads(flagged.stdout)["units_claimed"] == 24


@pytest.mark.slow
def test_plot_on_s3(s3_endpoint, s3_bucket, tmp_path):
    from gradientmail import open_mailbox

    write_documented_run(open_mailbox(f"s3://{s3_bucket}/run", endpoint_url=s3_endpoint))
    output = tmp_path / "s3.png"
    result = run_cli("plot", f"s3://{s3_bucket}/run", "-o", str(output), env=_s3_env(s3_endpoint))
    assert result.returncode == 0, result.stderr
    _assert_png(output)


@pytest.mark.slow
def test_empty_s3_prefix_is_an_error(s3_endpoint, s3_bucket):
    result = run_cli("status", f"s3://{s3_bucket}/nothing-here", env=_s3_env(s3_endpoint))
    assert_user_error(result, "no run in")


@pytest.mark.slow
def test_missing_s3_bucket_is_an_error(s3_endpoint):
    result = run_cli("status", "s3://gm-no-such-bucket-4711/run", env=_s3_env(s3_endpoint))
    assert_user_error(result)


@pytest.mark.slow
def test_missing_credentials_is_an_error(s3_endpoint, s3_bucket, tmp_path):
    env = _s3_env(
        s3_endpoint,
        AWS_CONFIG_FILE=str(tmp_path / "none"),
        AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"),
        AWS_EC2_METADATA_DISABLED="true",
    )
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        env.pop(name, None)
    result = run_cli("status", f"s3://{s3_bucket}/run", env=env)
    assert_user_error(result, "credentials")


@pytest.mark.slow
def test_unreachable_s3_endpoint_is_an_error(s3_endpoint):
    with socket.socket() as sock:  # a port nobody listens on once closed
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    result = run_cli(
        "status",
        "s3://bucket/run",
        env=_s3_env(f"http://127.0.0.1:{port}", AWS_MAX_ATTEMPTS="1", AWS_RETRY_MODE="standard"),
    )
    assert_user_error(result)


@pytest.mark.slow
def test_bucket_creates_once_and_is_safe_to_run_again(s3_endpoint):
    """The recipe's "once" bucket command runs a second time without a traceback
    (``BucketAlreadyOwnedByYou``): ``gradientmail bucket`` is idempotent."""
    import uuid

    url = f"s3://gm-bucket-{uuid.uuid4().hex[:8]}/runs/x"
    first = run_cli("bucket", url, "--endpoint-url", s3_endpoint)
    assert first.returncode == 0, first.stderr
    assert "created bucket" in first.stdout and s3_endpoint in first.stdout
    again = run_cli("bucket", url, env=_s3_env(s3_endpoint))
    assert again.returncode == 0, again.stderr
    assert "already there" in again.stdout
    assert_user_error(run_cli("bucket", "runs/local"), "expected s3://bucket")
