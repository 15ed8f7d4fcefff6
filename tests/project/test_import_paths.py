"""Every old public import path still works and gives the same object as its new home."""

from __future__ import annotations

import importlib

import pytest


def _same(old_module: str, new_module: str, names: list[str]) -> None:
    old, new = importlib.import_module(old_module), importlib.import_module(new_module)
    for name in names:
        assert getattr(old, name) is getattr(new, name), f"{old_module}.{name} is not {new_module}.{name}"


# -- the CLI application: gradientmail/cli/ (was cli.py, demo.py, demo_node.py) -----------------
CLI_MOVES = [
    ("gradientmail.cli", "gradientmail.cli.main", ["main"]),
    ("gradientmail.cli", "gradientmail.cli.parser", ["build_parser"]),
    (
        "gradientmail.cli",
        "gradientmail.cli.common",
        ["open_cli_mailbox", "describe_error", "json_document", "PROG", "S3_READ_OPTIONS", "USER_ERRORS"],
    ),
    ("gradientmail.cli", "gradientmail.cli.commands", ["status_table", "unreadable_notes", "cmd_status", "cmd_plot"]),
    ("gradientmail.cli", "gradientmail.errors", ["UsageError"]),
    ("gradientmail.demo", "gradientmail.cli.demo", ["run_demo", "READY_TIMEOUT", "START_DELAY"]),
    (
        "gradientmail.demo",
        "gradientmail.cli.demo_plan",
        ["Plan", "simulate", "makespan", "make_plan", "node_names", "DEFAULT_SPEEDS"],
    ),
    ("gradientmail.demo", "gradientmail.cli.demo_views", ["NodeState"]),
    ("gradientmail.demo", "gradientmail.errors", ["DemoError"]),
    (
        "gradientmail.demo_node",
        "gradientmail.cli.demo_node",
        ["NodeConfig", "run_node", "node_process", "consensus_process", "make_model", "synthetic_batch", "BATCH"],
    ),
    ("gradientmail.data.cli", "gradientmail.cli.tokens", ["add_tokens_command"]),
    ("gradientmail.status", "gradientmail.errors", ["RunNotFoundError"]),
]


@pytest.mark.parametrize(("old", "new", "names"), CLI_MOVES, ids=lambda value: str(value))
def test_cli_old_paths(old, new, names):
    _same(old, new, names)


def test_cli_console_script_target():
    from gradientmail.cli import main
    from gradientmail.data.cli import main as tokens_main

    assert callable(main) and callable(tokens_main)


# -- the session: gradientmail/session/ (core.py split into core.py + exchange.py) ---------------
SESSION_MOVES = [
    ("gradientmail.session.mail", "gradientmail.errors", ["UnusableStateError"]),
    ("gradientmail", "gradientmail.session.core", ["Session"]),
    ("gradientmail", "gradientmail.session.merge", ["consensus"]),
    (
        "gradientmail.session",
        "gradientmail.session.core",
        ["Session", "DEFAULT_EVERY", "DEFAULT_MAX_STALENESS", "DEFAULT_TIMEOUT", "ENV_EVERY"],
    ),
    ("gradientmail.session", "gradientmail.session.core", ["ENV_EVERY_STEPS", "ENV_MAX_STALENESS", "ENV_TIMEOUT"]),
    ("gradientmail.session", "gradientmail.session.core", ["ENV_OUTER"]),
    ("gradientmail.session", "gradientmail.session.merge", ["consensus"]),
    ("gradientmail.session", "gradientmail.session.outer", ["Average", "DelayedNesterov", "OuterOptimizer"]),
    (
        "gradientmail.session.core",
        "gradientmail.session.options",
        ["DEFAULT_EVERY", "DEFAULT_MAX_STALENESS", "DEFAULT_TIMEOUT", "ENV_EVERY", "ENV_EVERY_STEPS"],
    ),
    ("gradientmail.session.core", "gradientmail.session.options", ["ENV_MAX_STALENESS", "ENV_TIMEOUT", "ENV_OUTER"]),
]


@pytest.mark.parametrize(("old", "new", "names"), SESSION_MOVES, ids=lambda value: str(value))
def test_session_old_paths(old, new, names):
    _same(old, new, names)


# -- the mailbox: gradientmail/mailbox/ (base class, scheme registry, shared S3 helpers) -------
MAILBOX_MOVES = [
    ("gradientmail.mailbox.s3_listing", "gradientmail.mailbox.s3_common", ["list_keys", "LIST_PAGE"]),
    ("gradientmail.mailbox.wrappers", "gradientmail.mailbox.base", ["LIST_PAGE"]),
    ("gradientmail.mailbox.s3_common", "gradientmail.mailbox.base", ["LIST_PAGE"]),
    (
        "gradientmail.mailbox",
        "gradientmail.mailbox.base",
        ["Mailbox", "VersionedMailbox", "BaseMailbox", "describe", "require_replace_if", "verify_mailbox"],
    ),
    ("gradientmail.mailbox", "gradientmail.mailbox.url", ["open_mailbox"]),
    ("gradientmail", "gradientmail.mailbox.url", ["open_mailbox"]),
    ("gradientmail.mailbox.local_paths", "gradientmail.errors", ["UnsafeEntry", "ParentIsKey"]),
]
MAILBOX_S3_MOVES = [  # need boto3 (s3) or fsspec (filesystem)
    ("gradientmail.mailbox.s3", "gradientmail.mailbox.s3_common", ["TOKEN_METADATA", "LIST_PAGE"]),
    ("gradientmail.mailbox.filesystem", "gradientmail.mailbox.s3_common", ["TOKEN_METADATA", "LIST_PAGE"]),
    ("gradientmail.mailbox", "gradientmail.mailbox.s3", ["S3Mailbox"]),
    ("gradientmail.mailbox", "gradientmail.mailbox.filesystem", ["FsspecMailbox"]),
]


@pytest.mark.parametrize(("old", "new", "names"), MAILBOX_MOVES, ids=lambda value: str(value))
def test_mailbox_old_paths(old, new, names):
    _same(old, new, names)


@pytest.mark.parametrize(("old", "new", "names"), MAILBOX_S3_MOVES, ids=lambda value: str(value))
def test_mailbox_s3_old_paths(old, new, names):
    pytest.importorskip("boto3")
    pytest.importorskip("s3fs")
    _same(old, new, names)


def test_mailbox_wrapper_base_is_public():
    from gradientmail.mailbox import wrappers

    assert set(wrappers.__all__) >= {"CountingMailbox", "DelayedMailbox", "FaultyMailbox", "MailboxWrapper"}


# -- the shared queue itself: gradientmail/queue/ (was patterns/shared_queue.py) -----------------
SHARED_QUEUE_MOVES = [
    ("gradientmail.patterns.shared_queue", "gradientmail.queue.shared_queue", ["shared_queue", "QueueContext"]),
    ("gradientmail.patterns.shared_queue", "gradientmail.queue.shared_queue", ["WITH_HINT", "log"]),
    ("gradientmail.patterns.shared_queue", "gradientmail.queue.dataset", ["SharedQueueDataset", "prepare_mailbox"]),
    ("gradientmail.patterns.shared_queue", "gradientmail.queue.counter", ["units_claimed_by"]),
    ("gradientmail.patterns.shared_queue", "gradientmail.queue.batch_checks", ["Batch"]),
    ("gradientmail.patterns.shared_queue", "gradientmail.errors", ["InProcessMailboxError", "UnpicklableError"]),
    ("gradientmail", "gradientmail.queue.shared_queue", ["shared_queue"]),
    ("gradientmail", "gradientmail.queue.dataset", ["SharedQueueDataset"]),
    (
        "gradientmail.queue",
        "gradientmail.patterns.shared_queue",
        ["shared_queue", "SharedQueueDataset", "prepare_mailbox", "units_claimed_by", "QueueContext"],
    ),
]


@pytest.mark.parametrize(("old", "new", "names"), SHARED_QUEUE_MOVES, ids=lambda value: str(value))
def test_shared_queue_old_paths(old, new, names):
    _same(old, new, names)


def test_shared_queue_old_module_lists_its_names():
    from gradientmail.patterns import shared_queue as old

    assert set(old.__all__) >= {"shared_queue", "SharedQueueDataset", "units_claimed_by", "WITH_HINT"}


# -- the rest of the queue: gradientmail/queue/ (was patterns/claims.py, elastic.py, ...) --------
QUEUE_MOVES = [
    (
        "gradientmail.patterns.claims",
        "gradientmail.queue.claims",
        ["try_claim", "read_claim", "parse_claim", "claim_body", "claim_fields", "validate_identifier"],
    ),
    ("gradientmail.patterns.claims", "gradientmail.queue.claims", ["validate_identifiers", "validate_learner_id"]),
    (
        "gradientmail.patterns.claims",
        "gradientmail.queue.claimer",
        ["Claimer", "Pick", "LISTING_POLICIES", "DEFAULT_LISTING", "NEAR", "RISK_LIMIT", "RISK_MEMORY", "UNSEEN_RISK"],
    ),
    ("gradientmail.patterns.claims", "gradientmail.queue.claim_index", ["ClaimIndex", "PositionOrder"]),
    (
        "gradientmail.patterns.claims",
        "gradientmail.queue.crowd",
        ["SPREAD", "CROWD_LIMIT", "CROWD_MEMORY", "STRETCH", "JUMP_WINDOW"],
    ),
    ("gradientmail.patterns.claims", "gradientmail.errors", ["KeyTypeError"]),
    (
        "gradientmail.patterns.elastic",
        "gradientmail.queue.reclaim",
        ["ElasticClaimer", "ElasticOptions", "check_elastic"],
    ),
    (
        "gradientmail.patterns.elastic",
        "gradientmail.queue.takeover",
        ["Assignment", "take_over", "recorded_step", "recorded_progress"],
    ),
    (
        "gradientmail.patterns.elastic",
        "gradientmail.queue.leases",
        [
            "LeaseWatch",
            "lease_body",
            "lease_seconds",
            "work_body",
            "ACTIVE",
            "RELEASED",
            "RUNNING",
            "STOPPED",
            "POLL_S",
        ],
    ),
    (
        "gradientmail.patterns.elastic",
        "gradientmail.queue.progress",
        ["ProgressTracker", "Consumption", "consume_inline", "tagged_items", "Tagged", "BATCH", "END"],
    ),
    (
        "gradientmail.patterns.units",
        "gradientmail.queue.units",
        ["Unit", "unit_grid", "rotated_order", "DEFAULT_BLOCK"],
    ),
    (
        "gradientmail.patterns.claim_ahead",
        "gradientmail.queue.claim_ahead",
        ["ClaimAhead", "BufferGauge", "DepthGauge", "DEFAULT_CLAIM_AHEAD", "TIED_S", "SMOOTHING"],
    ),
    ("gradientmail.patterns.presence", "gradientmail.queue.presence", ["Presence", "presence_renew_s", "RENEW_S"]),
    (
        "gradientmail.patterns.batches",
        "gradientmail.queue.batches",
        ["map_tensors", "to_device", "first_non_tensor", "MAX_DEPTH", "TensorTree"],
    ),
    ("gradientmail.patterns.inline", "gradientmail.queue.inline", ["inline", "Inline", "INLINE_BYTES"]),
    ("gradientmail.patterns.progress_display", "gradientmail.queue.progress_display", ["ProgressDisplay", "log"]),
    (
        "gradientmail.patterns.unit_timing",
        "gradientmail.queue.unit_timing",
        ["BatchWatch", "UnitTimes", "unit_times", "spans_record", "KEEP_UNITS"],
    ),
    (
        "gradientmail.patterns.simulate",
        "gradientmail.queue.simulate",
        ["simulate", "fixed_split_makespan", "rotated_positions", "SimulationResult", "main", "ORDERS"],
    ),
    ("gradientmail.queue", "gradientmail.queue.claims", ["try_claim", "read_claim"]),
    ("gradientmail.queue", "gradientmail.queue.claimer", ["Claimer"]),
    ("gradientmail.queue", "gradientmail.queue.units", ["Unit", "unit_grid", "rotated_order"]),
]


@pytest.mark.parametrize(("old", "new", "names"), QUEUE_MOVES, ids=lambda value: str(value))
def test_queue_old_paths(old, new, names):
    _same(old, new, names)


def test_queue_old_modules_list_every_name_they_had():
    from gradientmail.patterns import claims, elastic

    assert {"Claimer", "ClaimIndex", "try_claim", "KeyTypeError", "SPREAD"} <= set(claims.__all__)
    assert {"ElasticClaimer", "ProgressTracker", "take_over", "tagged_items", "BATCH"} <= set(elastic.__all__)


def test_old_simulate_module_still_runs():
    import subprocess
    import sys

    argv = [
        sys.executable,
        "-m",
        "gradientmail.patterns.simulate",
        "--units",
        "40",
        "--learners",
        "4",
        "--orders",
        "default",
    ]
    out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=120).stdout
    assert out.splitlines()[1].split()[:4] == ["40", "4", "default", "adaptive"]
