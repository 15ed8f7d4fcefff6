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
        ["Session", "KEEP_MAIL", "DEFAULT_EVERY", "DEFAULT_MAX_STALENESS", "DEFAULT_TIMEOUT", "ENV_EVERY"],
    ),
    ("gradientmail.session", "gradientmail.session.core", ["ENV_EVERY_STEPS", "ENV_MAX_STALENESS", "ENV_TIMEOUT"]),
    ("gradientmail.session", "gradientmail.session.core", ["ENV_OUTER"]),
    ("gradientmail.session", "gradientmail.session.merge", ["consensus"]),
    ("gradientmail.session", "gradientmail.session.outer", ["Average", "DelayedNesterov", "OuterOptimizer"]),
    ("gradientmail.session.merge", "gradientmail.session.mail", ["accumulation_dtype"]),
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
