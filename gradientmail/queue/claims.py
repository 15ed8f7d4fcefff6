"""The claim protocol: which learner owns a work unit, decided by one atomic create.

A learner claims unit ``identifier`` by creating ``units/{identifier}`` (``put_if_absent``)
with a fresh random token, reading it back, and owning the unit only if the token it reads is
its own. A takeover (the elastic queue) swaps the claim with ``replace_if`` and reads it back
the same way (``read_back``); whether a learner judged dead still owns its units is its lease's
question (``queue.lease``). Details: docs/queue.md.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import time
from collections.abc import Iterable
from typing import Any

from gradientmail.errors import InvalidKeyError, KeyTypeError, RecordError, UnsafeStoreError, short_repr
from gradientmail.layout import claim_key
from gradientmail.mailbox.base import Mailbox, describe
from gradientmail.mailbox.keys import validate_key
from gradientmail.records import ClaimRecord, get_record

__all__ = [
    "claim_body",
    "claim_fields",
    "claim_record",
    "host_name",
    "load_claim",
    "new_token",
    "parse_claim",
    "read_back",
    "read_claim",
    "try_claim",
    "validate_identifier",
    "validate_identifiers",
    "validate_learner_id",
]


_log = logging.getLogger("gradientmail.queue")


def validate_identifier(identifier: object) -> str:
    """Return ``identifier`` if ``units/{identifier}`` is a valid mailbox key.

    Raises:
        KeyTypeError: ``identifier`` is not a ``str``.
        InvalidKeyError: it is not a safe key.

    Example:
        >>> validate_identifier("shard-0")
        'shard-0'
    """
    if not isinstance(identifier, str):
        raise KeyTypeError(f"unit identifiers must be str, not {type(identifier).__name__} ({short_repr(identifier)})")
    if identifier.startswith("/"):  # units/ + "/abs/path" would read as an empty segment
        raise InvalidKeyError(
            f"unit identifier {short_repr(identifier)} is an absolute path: identifiers are key "
            "segments relative to the run (use the path relative to the dataset's root, e.g. "
            f"{short_repr(identifier.lstrip('/'))})"
        )
    try:
        validate_key(claim_key(identifier))
    except InvalidKeyError as exc:
        problem = str(exc).partition(": it ")[2] or str(exc)
        raise InvalidKeyError(
            f"unit identifier {short_repr(identifier)} is not a safe mailbox key: it {problem}"
        ) from None
    return identifier


def validate_identifiers(identifiers: Iterable[object]) -> list[str]:
    """Validate every identifier, and refuse one that is a folder of another (``a``, ``a/b``).

    On a filesystem mailbox ``units/a`` and ``units/a/b`` cannot both exist.

    Raises:
        InvalidKeyError: an unsafe identifier, or one nested in another.
    """
    checked = [validate_identifier(identifier) for identifier in identifiers]
    nested = [identifier for identifier in checked if "/" in identifier]
    if nested:
        present = set(checked)
        for identifier in nested:
            parts = identifier.split("/")
            for end in range(1, len(parts)):
                parent = "/".join(parts[:end])
                if parent in present:
                    raise InvalidKeyError(
                        f"unit identifier {parent!r} is a folder of unit {identifier!r}; "
                        "on a directory mailbox both claims cannot exist, rename one"
                    )
    return checked


def validate_learner_id(learner_id: object) -> str:
    """Return ``learner_id`` if it is a non-empty ``str`` usable as one key segment (no ``/``).

    Raises:
        KeyTypeError: not a ``str``.
        InvalidKeyError: empty, with a ``/``, or otherwise unsafe.
    """
    if not isinstance(learner_id, str):
        raise KeyTypeError(f"learner_id must be a str, not {type(learner_id).__name__} ({learner_id!r})")
    if not learner_id or "/" in learner_id:
        raise InvalidKeyError(
            f"learner_id {learner_id!r} must be a non-empty key segment without '/' "
            '(each learner gets its own mailbox prefix), e.g. f"node-{rank}"'
        )
    try:
        validate_key(learner_id)
    except InvalidKeyError as exc:
        raise InvalidKeyError(f"learner_id {learner_id!r} is not a safe mailbox key segment: {exc}") from None
    return learner_id


@functools.cache
def host_name() -> str:
    """This host's name, looked up once per process (never between a listing and a create)."""
    return socket.gethostname()


def new_token() -> str:
    """A claim attempt's token: 128 random bits from the OS as 32 hex digits (never from
    ``random`` or torch's generator, which a training script seeds alike on every node)."""
    return os.urandom(16).hex()


def claim_fields(learner_id: str, token: str, worker: int | None, **extra: Any) -> dict[str, Any]:
    """The design note's claim fields plus ``extra`` (see ``gradientmail.layout``)."""
    return {
        "learner": learner_id,
        "token": token,
        "host": host_name(),
        "pid": os.getpid(),
        "worker": worker,
        "claimed_at": time.time(),
        **extra,
    }


def claim_record(learner_id: str, token: str, worker: int | None = None, **extra: Any) -> ClaimRecord:
    """A new claim: the design note's fields plus ``extra`` (see ``gradientmail.layout``)."""
    return ClaimRecord(claim_fields(learner_id, token, worker, **extra))


def claim_body(learner_id: str, token: str, worker: int | None = None, **extra: Any) -> bytes:
    """The JSON body of a claim (fields documented in ``gradientmail.layout``): ``claim_record``'s bytes."""
    return ClaimRecord.encode(claim_fields(learner_id, token, worker, **extra))


def load_claim(data: bytes | None) -> ClaimRecord | None:
    """A claim body as a ``ClaimRecord``, or None when missing or invalid (bounded).

    Example:
        >>> load_claim(claim_body("node-0", "t0")).token
        't0'
        >>> load_claim(b"not json") is None
        True
    """
    if data is None:
        return None
    try:
        return ClaimRecord.from_bytes(data)
    except RecordError:
        return None


def parse_claim(data: bytes | None) -> dict[str, Any] | None:
    """A claim body as a dict, or None when missing or invalid (``load_claim`` as a dict).

    Example:
        >>> parse_claim(claim_body("node-0", "t0"))["token"]
        't0'
        >>> parse_claim(b"not json") is None
        True
    """
    record = load_claim(data)
    return None if record is None else record.to_dict()


def read_claim(mailbox: Mailbox, identifier: str) -> dict[str, Any] | None:
    """The claim on unit ``identifier``, or None when it is unclaimed (one ``get``)."""
    record = ClaimRecord.fetch(mailbox, claim_key(validate_identifier(identifier)))
    return None if record is None else record.to_dict()


def read_back(
    mailbox: Mailbox,
    key: str,
    token: str,
    *,
    action: str = "created",
    what: str = "claims",
    written: bytes | None = None,
) -> bool:
    """Read claim ``key`` back after writing it: whether it holds ``token``.

    Args:
        mailbox: The store just written.
        key: The claim key.
        token: The token the write carried.
        action: The write, for the error message ("created", "replaced").
        what: What the store is unsafe for, for the error message.
        written: The body written: read back byte for byte, it holds ``token`` without being
            parsed (the common case; parsing a claim costs more than the rest of a simulated
            claim's bookkeeping).

    Raises:
        UnsafeStoreError: the key is missing: the store does not show a write to the next read.
    """
    try:
        data = get_record(mailbox, key, ClaimRecord.KIND)
    except RecordError:
        return False  # too large to be a claim, let alone ours
    if data is None:
        store = describe(mailbox)
        raise UnsafeStoreError(
            f"{store}: the claim {key!r} was {action} but cannot be read back; "
            f"this store does not show a write to the next read, so {what} are unsafe here",
            operation="get",
            key=key,
            store=store,
        )
    if written is not None and data == written:
        return True
    claim = load_claim(data)
    return claim is not None and claim.token == token


def try_claim(
    mailbox: Mailbox,
    identifier: str,
    learner_id: str,
    *,
    worker: int | None = None,
    token: str | None = None,
    **extra: Any,
) -> bool:
    """Claim one unit: create its key, read it back, and report whether the token is ours.

    Two requests when the create succeeds, one otherwise.

    Args:
        mailbox: The shared store.
        identifier: The unit.
        learner_id: Who claims it.
        worker: The DataLoader worker claiming, if any.
        token: Unique to this attempt (default: ``new_token()``).
        **extra: More fields for the claim's body (the elastic queue's incarnation and state).

    Returns:
        True when this attempt owns the unit; False when another claimer does.

    Example:
        >>> from gradientmail.mailbox.memory import MemoryMailbox
        >>> box = MemoryMailbox("doctest-try-claim")
        >>> try_claim(box, "u0", "node-0"), try_claim(box, "u0", "node-1")
        (True, False)
    """
    key = claim_key(identifier)
    if token is None:
        token = new_token()
    body = claim_body(learner_id, token, worker, **extra)
    if not mailbox.put_if_absent(key, body):
        return False
    won = read_back(mailbox, key, token, written=body)
    if won:
        _log.debug("%s claimed unit %s%s", learner_id, identifier, "" if worker is None else f" (worker {worker})")
    return won
