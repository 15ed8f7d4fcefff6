"""GradientMail: train one model on machines of unequal speed through a shared mailbox.

Nodes never talk to each other: they claim work units and exchange parameters through a
``Mailbox`` (a local directory, S3, or any fsspec store that can create atomically).
Heavy pieces (torch, boto3, fsspec) are imported only when their names are first used.
See README.md to start, and docs/ for each part.
"""

from __future__ import annotations

import logging
from typing import Any

from gradientmail.errors import (
    DuplicateLearnerError,
    GradientMailError,
    GroupError,
    InvalidKeyError,
    KeyConflictError,
    LeaseLostError,
    LoaderError,
    MailboxError,
    MailRejectedError,
    MailSkippedWarning,
    MissingExtraError,
    RecordError,
    RecordSkippedWarning,
    RunMismatchError,
    SessionError,
    UnfinishedUnitsWarning,
    UnsafeStoreError,
    UntrackedClaimsError,
    ValueTooLargeError,
    WrongProcessError,
)
from gradientmail.learner_id import default_learner_id
from gradientmail.mailbox import (
    LocalMailbox,
    Mailbox,
    MemoryMailbox,
    open_mailbox,
    verify_mailbox,
)

__version__ = "0.1.0"

# A library logs and never configures handlers: its records reach the application's own setup
# (logging.basicConfig, ...), and nothing is printed when there is none.
logging.getLogger("gradientmail").addHandler(logging.NullHandler())

_LAZY = {
    "S3Mailbox": "gradientmail.mailbox.s3",
    "FsspecMailbox": "gradientmail.mailbox.filesystem",
    "Session": "gradientmail.session",
    "consensus": "gradientmail.session",
    "SharedQueueDataset": "gradientmail.queue.dataset",
    "shared_queue": "gradientmail.queue.context",
    "units_claimed_by": "gradientmail.queue.claim_counter",
    "Unit": "gradientmail.queue.units",
    "unit_grid": "gradientmail.queue.units",
    "rotated_order": "gradientmail.queue.units",
}

__all__ = [
    "DuplicateLearnerError",
    "GradientMailError",
    "GroupError",
    "InvalidKeyError",
    "KeyConflictError",
    "LeaseLostError",
    "LoaderError",
    "LocalMailbox",
    "MailRejectedError",
    "MailSkippedWarning",
    "Mailbox",
    "MailboxError",
    "MemoryMailbox",
    "MissingExtraError",
    "RecordError",
    "RecordSkippedWarning",
    "RunMismatchError",
    "SessionError",
    "UnfinishedUnitsWarning",
    "UnsafeStoreError",
    "UntrackedClaimsError",
    "ValueTooLargeError",
    "WrongProcessError",
    "default_learner_id",
    "open_mailbox",
    "verify_mailbox",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    """Import ``Session``, ``shared_queue``, ``S3Mailbox``, ... (torch, boto3) on first use."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'gradientmail' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
