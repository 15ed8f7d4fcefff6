"""Where each kind of mail lives in a mailbox: the keys every node, ``status`` and ``plot`` share.

The keys and the fields of their records are the on-store contract: add fields freely, never
rename or remove one. Records are read through ``gradientmail.records`` (bounded, fields
checked). The record formats are in docs/queue.md ("On-store layout").

Example:
    >>> claim_key("000003-1")
    'units/000003-1'
    >>> work_key("node-a", "000003-1"), lease_key("node-a")
    ('work/node-a/000003-1', 'leases/node-a.json')
"""

from __future__ import annotations

RUN_KEY = "run.json"
"""Created once per run: ``{"units", "created", "fingerprint"}`` (``gradientmail.run_record``)."""
CLAIMS_PREFIX = "units/"
PROGRESS_PREFIX = "progress/"
SESSION_PREFIX = "session/"
WORK_PREFIX = "work/"
DONE_PREFIX = "done/"
LEASES_PREFIX = "leases/"
LEARNERS_PREFIX = "learners/"


def claim_key(identifier: str) -> str:
    """A unit's claim, created once (replaced, never deleted, by elastic queues' takeovers)."""
    return f"{CLAIMS_PREFIX}{identifier}"


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
