"""Joining a run: the unit set's fingerprint, and the check of ``run.json`` every node makes.

``prepare_mailbox`` records the run if this node is first and checks it otherwise; the first node
also refuses a store that cannot create keys atomically (``UnsafeStoreError``).

A prefix holds one run of one unit set: the record carries the set's ``fingerprint``, and a node
whose units differ is refused (``RunMismatchError``) before it claims anything. See docs/queue.md.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from gradientmail.errors import RecordError, RunMismatchError, UnsafeStoreError
from gradientmail.layout import RUN_KEY
from gradientmail.mailbox.base import Mailbox, describe, verify_mailbox
from gradientmail.records import RunRecord, get_record

__all__ = ["check_run_record", "prepare_mailbox", "unit_fingerprint"]


def unit_fingerprint(identifiers: Iterable[str]) -> str:
    """``"sha256:<64 hex>"`` of the sorted unit identifiers: the same set, the same fingerprint.

    Only identifiers count, not unit values (those may differ between machines).

    Example:
        >>> unit_fingerprint(["b", "a"]) == unit_fingerprint(["a", "b"])
        True
        >>> unit_fingerprint(["a"])[:7]
        'sha256:'
    """
    digest = hashlib.sha256()
    for identifier in sorted(identifiers):
        digest.update(identifier.encode("utf-8", "surrogatepass"))
        digest.update(b"\0")  # identifiers are keys: no NUL inside one
    return f"sha256:{digest.hexdigest()}"


def check_run_record(data: bytes | RecordError, units: int, fingerprint: str | None, store: str) -> RunRecord:
    """Check the existing ``run.json`` against this node's units.

    Args:
        data: the body of the existing ``run.json``, or the ``RecordError`` it was refused with
            unread (``records.get_record``: too large to be a record).
        units: how many units this node has (for the message).
        fingerprint: this node's ``unit_fingerprint``; None (units unknown) checks only that
            ``data`` is a run record, as does a record without one (an older version's).
        store: the store's description, for the message.

    Returns:
        The parsed record.

    Raises:
        RunMismatchError: ``data`` is no run record, or records another unit set.
    """
    try:
        if isinstance(data, RecordError):
            raise data  # refused unread: the same refusal as a body that is no run record
        record = RunRecord.from_bytes(data, RUN_KEY)
    except RecordError as exc:
        raise RunMismatchError(
            f"{store}: {exc}; this prefix does not hold a run this version can join: use a fresh prefix"
        ) from None
    recorded = record.fingerprint
    if fingerprint is None or recorded is None or recorded == fingerprint:
        return record
    total = record.units
    theirs = f"{total} units" if total is not None else "other units"
    raise RunMismatchError(
        f"{store} holds a run of another unit set ({theirs}, {recorded[:19]}...) than this node's "
        f"({units} units, {fingerprint[:19]}...): claims are per unit identifier, so joining would "
        "mix the two runs; use a fresh prefix for these units, or start this node with the run's "
        "units"
    )


def prepare_mailbox(mailbox: Mailbox, units: int, identifiers: Iterable[str] | None = None) -> None:
    """Record the run (``run.json``) if new, and refuse a store without atomic creation.

    Only the node that creates ``run.json`` runs the full ``verify_mailbox``; the others read
    it back (two requests instead of five; ``docs/queue.md`` explains why that suffices).

    Raises:
        UnsafeStoreError: the store does not create keys atomically, or lies about it.
        RunMismatchError: ``identifiers`` differ from the run's unit set.

    Example:
        >>> from gradientmail.mailbox import MemoryMailbox
        >>> prepare_mailbox(MemoryMailbox("doctest-prepare"), 2, ["a", "b"])
    """
    fingerprint = unit_fingerprint(identifiers) if identifiers is not None else None
    if mailbox.put_if_absent(RUN_KEY, RunRecord.new(units, fingerprint).to_bytes()):
        verify_mailbox(mailbox)
        return
    try:
        existing: bytes | RecordError | None = get_record(mailbox, RUN_KEY, RunRecord.KIND)
    except RecordError as exc:
        existing = exc
    if existing is None:
        store = describe(mailbox)
        raise UnsafeStoreError(
            f"{store}: creating {RUN_KEY!r} reported that it already existed, but it cannot be "
            "read; put_if_absent does not report creation truthfully",
            operation="verify",
            key=RUN_KEY,
            store=store,
        )
    check_run_record(existing, units, fingerprint, describe(mailbox))
