"""Where each kind of mail lives in a mailbox, in one place.

Every node, the status tool and the plot read these same keys, so their formats are part of
the on-store contract: add fields freely, never rename or remove one.

- ``run.json``: created once per run (``put_if_absent``) by the first node to start a queue:
  ``{"units": <total units>, "created": <unix time>}``. Lets the status tool show claimed/total.
- ``units/{identifier}``: a claim (seed protocol), JSON
  ``{"learner", "token", "host", "pid", "worker", "claimed_at"}``. Permanent for the run.
- ``progress/{learner_id}.json``: a node's totals, overwritten by its Session, JSON
  ``{"learner", "steps", "samples", "samples_per_s", "units", "started", "last_seen", "finished"}``.
- ``session/{learner_id}/...``: parameter mail (safetensors), see ``gradientmail.session``.
"""

from __future__ import annotations

RUN_KEY = "run.json"
CLAIMS_PREFIX = "units/"
PROGRESS_PREFIX = "progress/"
SESSION_PREFIX = "session/"


def claim_key(identifier: str) -> str:
    return f"{CLAIMS_PREFIX}{identifier}"


def progress_key(learner_id: str) -> str:
    return f"{PROGRESS_PREFIX}{learner_id}.json"


def session_prefix(learner_id: str) -> str:
    return f"{SESSION_PREFIX}{learner_id}/"
