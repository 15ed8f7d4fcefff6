"""Mailbox backends: where every node leaves and reads its mail.

``base`` holds the protocol and the base class, ``url`` the URL schemes and ``open_mailbox``, one module per
backend. ``S3Mailbox`` and ``FsspecMailbox`` load lazily: ``import gradientmail`` pulls neither
boto3 nor fsspec.
"""

from __future__ import annotations

from typing import Any

from gradientmail.mailbox.base import (
    BaseMailbox,
    BaseVersionedMailbox,
    Mailbox,
    VersionedMailbox,
    describe,
    require_replace_if,
    supports_replace_if,
    verify_mailbox,
)
from gradientmail.mailbox.keys import is_valid_key, validate_key, validate_prefix
from gradientmail.mailbox.local import LocalMailbox
from gradientmail.mailbox.memory import MemoryMailbox
from gradientmail.mailbox.schemes import Backend, register_backend
from gradientmail.mailbox.url import open_mailbox

__all__ = [
    "Backend",
    "BaseMailbox",
    "BaseVersionedMailbox",
    "FsspecMailbox",
    "LocalMailbox",
    "Mailbox",
    "MemoryMailbox",
    "S3Mailbox",
    "VersionedMailbox",
    "describe",
    "is_valid_key",
    "open_mailbox",
    "register_backend",
    "require_replace_if",
    "supports_replace_if",
    "validate_key",
    "validate_prefix",
    "verify_mailbox",
]


def __getattr__(name: str) -> Any:
    if name == "S3Mailbox":
        from gradientmail.mailbox.s3 import S3Mailbox

        return S3Mailbox
    if name == "FsspecMailbox":
        from gradientmail.mailbox.filesystem import FsspecMailbox

        return FsspecMailbox
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
