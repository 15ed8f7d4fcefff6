"""Where each kind of mail lives in a mailbox: every key of the queue and the Session, in one place.

The keys and the fields of their records are the on-store contract: add fields freely, never
rename or remove one. Records are read through ``gradientmail.records`` (bounded, fields
checked); the Session's state through ``gradientmail.session.mail``. The record formats are in
docs/queue.md ("On-store layout") and docs/session.md.

Example:
    >>> claim_key("000003-1")
    'units/000003-1'
    >>> work_key("node-a", "000003-1"), lease_key("node-a")
    ('work/node-a/000003-1', 'leases/node-a.json')
"""

from __future__ import annotations

import re

RUN_KEY = "run.json"
"""Created once per run: ``{"units", "created", "fingerprint"}`` (``records.RunRecord``)."""
CLAIMS_PREFIX = "units/"
PROGRESS_PREFIX = "progress/"
SESSION_PREFIX = "session/"
WORK_PREFIX = "work/"
DONE_PREFIX = "done/"
LEASES_PREFIX = "leases/"
LEARNERS_PREFIX = "learners/"
SUMMARIES_PREFIX = "claimed/"
"""Per-span "every claim exists" records (``summary_key``): never under ``units/`` or ``done/``."""

SUMMARY_BODY = b"{}"
"""A summary's body, never read (its key says everything): not empty, because a store reached
through s3fs cannot create an empty object conditionally."""


def claim_key(identifier: str) -> str:
    """A unit's claim, created once (replaced, never deleted, by elastic queues' takeovers)."""
    return f"{CLAIMS_PREFIX}{identifier}"


def summary_key(span: int, check: int) -> str:
    """``claimed/{span:08d}.{check:08x}``: every unit of span ``span`` (``size`` consecutive claim
    keys in sorted order) is claimed. Created once (``SUMMARY_BODY``, never read), never removed: claims
    are permanent, so it stays true. ``check`` names the span's units (``ClaimIndex.summary_keys``),
    so a node of another unit set or span size never mistakes it for one of its own spans.

    Example:
        >>> summary_key(12, 0xBEEF)
        'claimed/00000012.0000beef'
    """
    return f"{SUMMARIES_PREFIX}{span:08d}.{check:08x}"


_SUMMARY = re.compile(r"^claimed/(\d{8})\.([0-9a-f]{8})$")


def parse_summary_key(key: str) -> tuple[int, int] | None:
    """``(span, check)`` of a summary key, else None (a key of no format this code writes)."""
    match = _SUMMARY.match(key)
    return None if match is None else (int(match[1]), int(match[2], 16))


def progress_key(learner_id: str) -> str:
    """A node's totals, overwritten by its ``Session``."""
    return f"{PROGRESS_PREFIX}{learner_id}.json"


def work_prefix(learner_id: str) -> str:
    """Where an elastic learner's unfinished units are: one listing finds them after a restart."""
    return f"{WORK_PREFIX}{learner_id}/"


def work_key(learner_id: str, identifier: str) -> str:
    """A unit this elastic learner claimed and has not finished; deleted when done or released."""
    return f"{WORK_PREFIX}{learner_id}/{identifier}"


def done_key(identifier: str) -> str:
    """An elastic unit whose last batch was consumed; created once, never removed."""
    return f"{DONE_PREFIX}{identifier}"


def lease_key(learner_id: str) -> str:
    """A node's heartbeat under ``lease=``."""
    return f"{LEASES_PREFIX}{learner_id}.json"


def learner_key(learner_id: str) -> str:
    """Which process runs this learner; a live one refuses a second process under its id."""
    return f"{LEARNERS_PREFIX}{learner_id}.json"


# -- the Session's keys: fragments of the run's state, pending contributions, members ----------
SUFFIX = ".safetensors"
SEQ_DIGITS = 12
"""Zero-padded width of a version or sequence number in a key, so that keys sort by number."""
FRAGMENT_DIGITS = 4

FRAGMENTS_PREFIX = f"{SESSION_PREFIX}fragments/"
MEMBERS_PREFIX = f"{SESSION_PREFIX}members/"
MARKS_PREFIX = f"{SESSION_PREFIX}marks/"
"""Unit marks too many for a learner's line of the run's state, one object per snapshot."""
OLD_STATE_PREFIX = f"{SESSION_PREFIX}state/"
"""Where format 2 kept its one chain; only used to recognise and refuse old runs."""


def marks_prefix(learner_id: str) -> str:
    return f"{MARKS_PREFIX}{learner_id}/"


def marks_key(learner_id: str, token: str) -> str:
    """``session/marks/{learner_id}/{token}.json``: the unit marks of one of its snapshots."""
    return f"{marks_prefix(learner_id)}{token}.json"


def fragment_prefix(fragment: int) -> str:
    return f"{FRAGMENTS_PREFIX}{fragment:0{FRAGMENT_DIGITS}d}/"


def versions_prefix(fragment: int) -> str:
    """Where fragment ``fragment``'s chain of versions lives."""
    return f"{fragment_prefix(fragment)}versions/"


def pending_prefix(fragment: int) -> str:
    """Where contributions to fragment ``fragment`` wait until a version absorbs them."""
    return f"{fragment_prefix(fragment)}pending/"


def state_key(version: int, fragment: int = 0) -> str:
    """``session/fragments/{fragment}/versions/{version}.safetensors``.

    Example:
        >>> state_key(7, 2)
        'session/fragments/0002/versions/000000000007.safetensors'
    """
    return f"{versions_prefix(fragment)}{version:0{SEQ_DIGITS}d}{SUFFIX}"


def parse_state_key(key: str, fragment: int = 0) -> int | None:
    """The version of a state key of ``fragment``, else None."""
    prefix = versions_prefix(fragment)
    if not key.startswith(prefix) or not key.endswith(SUFFIX):
        return None
    stem = key[len(prefix) : -len(SUFFIX)]
    if len(stem) == SEQ_DIGITS and stem.isascii() and stem.isdigit():
        return int(stem)
    return None


def fold_claim_key(fragment: int, version: int) -> str:
    """``session/fragments/{fragment}/claims/{version}``: who is folding that version now.

    Example:
        >>> fold_claim_key(1, 40)
        'session/fragments/0001/claims/000000000040'
    """
    return f"{fragment_prefix(fragment)}claims/{version:0{SEQ_DIGITS}d}"


def ledger_key(fragment: int, version: int, learner: str) -> str:
    """``session/fragments/{fragment}/ledgers/{version}.{learner}.json``: every learner's line
    as of ``version``, written by ``learner`` (who created that version, or lost the race to).

    Example:
        >>> ledger_key(1, 40, "node-1")
        'session/fragments/0001/ledgers/000000000040.node-1.json'
    """
    return f"{fragment_prefix(fragment)}ledgers/{version:0{SEQ_DIGITS}d}.{learner}.json"


def pending_key(fragment: int, learner: str, seq: int) -> str:
    """``session/fragments/{fragment}/pending/{learner}.{seq}.safetensors``: one contribution.

    Example:
        >>> pending_key(0, "node-1", 3)
        'session/fragments/0000/pending/node-1.000000000003.safetensors'
    """
    return f"{pending_prefix(fragment)}{learner}.{seq:0{SEQ_DIGITS}d}{SUFFIX}"


def parse_pending_key(key: str, fragment: int = 0) -> tuple[str, int] | None:
    """``(learner, seq)`` of a pending key of ``fragment``, else None."""
    prefix = pending_prefix(fragment)
    if not key.startswith(prefix) or not key.endswith(SUFFIX):
        return None
    learner, dot, seq = key[len(prefix) : -len(SUFFIX)].rpartition(".")
    if not dot or not learner or "/" in learner or len(seq) != SEQ_DIGITS or not (seq.isascii() and seq.isdigit()):
        return None
    return learner, int(seq)


def member_key(learner: str, joined: float) -> str:
    """``session/members/{learner}.{joined, integer milliseconds}``: a listing shows who is in."""
    return f"{MEMBERS_PREFIX}{learner}.{int(joined * 1000)}"


def parse_member_key(key: str) -> tuple[str, float] | None:
    """``(learner, joined)`` of a member key, else None."""
    if not key.startswith(MEMBERS_PREFIX):
        return None
    learner, dot, millis = key[len(MEMBERS_PREFIX) :].rpartition(".")
    if not dot or not learner or "/" in learner or not (millis.isascii() and millis.isdigit()):
        return None
    if len(millis) > 16:
        return None
    return learner, int(millis) / 1000


_OLD_MAIL = re.compile(r"^[^/]+/(\d{12}|final)\.safetensors$")


def is_old_mail_key(key: str) -> bool:
    """True for mail of an earlier Session format: ``session/{learner}/{seq}.safetensors`` (1)
    or ``session/state/{version}.safetensors`` (2)."""
    rest = key[len(SESSION_PREFIX) :] if key.startswith(SESSION_PREFIX) else ""
    if key.startswith(OLD_STATE_PREFIX):
        return True
    return bool(_OLD_MAIL.match(rest)) and not key.startswith((FRAGMENTS_PREFIX, MEMBERS_PREFIX))
