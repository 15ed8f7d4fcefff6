"""Where each kind of mail lives in a mailbox, in one place.

Every node, the status tool and the plot read these same keys, so their formats are part of
the on-store contract: add fields freely, never rename or remove one.

- ``run.json``: created once per run (``put_if_absent``) by the first node to start a queue:
  ``{"units": <total units>, "created": <unix time>, "fingerprint": "sha256:<hex>"}``. Lets the
  status tool show claimed/total; a node whose unit set has another fingerprint is refused
  (``gradientmail.run_record``; records without one, from older versions, are accepted).

Every record is read through ``gradientmail.records``: bounded in size and depth, its fields
checked; a record that fails is skipped with a warning (or refused, for ``run.json``).
- ``units/{identifier}``: a claim (seed protocol), JSON
  ``{"learner", "token", "host", "pid", "worker", "claimed_at"}``. Permanent for the run unless
  the queue runs with ``resume=`` or ``lease=`` (``gradientmail.patterns.elastic``): then a claim
  may be replaced with ``replace_if`` (never deleted). A takeover writes the same fields plus
  ``"incarnation"``, ``"state": "active"``, ``"step"`` and ``"position"`` (the last batch
  consumed before it, as in ``work/``, or null) and ``"taken_from"`` (the previous owner); a
  node leaving cleanly rewrites its unfinished claims with ``"state": "released"``, ``"step"``
  and ``"position"``, and any node may take those over.
- ``work/{learner_id}/{identifier}``: (elastic queues) a unit this learner claimed and has not
  finished, JSON ``{"learner", "token", "incarnation", "step", "done", "updated"}``: ``token``
  is the claim's, ``step`` the last step its training loop consumed (null: none yet) and
  ``"position"`` that batch's index in the unit's ``load()`` iteration (null: none yet; absent
  in records of older versions, which are continued by ``step``). Written at
  claim time, rewritten as batches are consumed, deleted once the unit is done or released, so
  listing ``work/{learner_id}/`` finds a restarted node's unfinished units cheaply.
- ``done/{identifier}``: (elastic queues) the unit's last batch was consumed, JSON
  ``{"learner", "token", "at"}``. Created once, never removed.
- ``leases/{learner_id}.json``: (``lease=``) a node's heartbeat, JSON ``{"learner",
  "incarnation", "beat", "consumed", "time", "lease_s", "state"}``; ``beat`` changes only when
  batches were consumed since the previous beat. Peers judge it expired when it has not changed
  for ``lease_s`` on their own clock (``time`` is informative only). ``state`` is ``"running"``
  or ``"stopped"`` (left the queue).
- ``learners/{learner_id}.json``: (every ``shared_queue``) which process runs this learner, JSON
  ``{"learner", "incarnation", "state", "beat", "time", "renew_s", "host", "boot", "pidns",
  "pid", "pid_start"}``, renewed every ``renew_s`` while it runs, ``"stopped"`` at exit; a live
  one makes a second process under the same learner_id fail (``gradientmail.patterns.presence``).
- ``progress/{learner_id}.json``: a node's totals, overwritten by its Session, JSON
  ``{"learner", "steps", "samples", "samples_per_s", "units", "started", "last_seen", "finished"}``
  and, when a ``shared_queue`` of this learner ran in the Session's process, ``"unit_spans"``:
  ``{"recent": [{"unit", "first", "last", "batches"}, ...], "older": {"units", "batches",
  "busy_s"}}`` (the last 64 units' first-batch start and last-batch end; older ones summed up).
- ``session/state/{version:012d}.safetensors``: the run's model, one version per fold, created
  with ``put_if_absent`` (format ``gradientmail.session/2``); ``session/members/{learner}.{ms}``:
  who is in the run. See ``gradientmail.session.mail``. (``session/{learner_id}/...`` held the
  per-learner mail of format 1, which is refused.)
"""

from __future__ import annotations

from typing import Any

from gradientmail.records import RecordError, loads_object

RUN_KEY = "run.json"
CLAIMS_PREFIX = "units/"
PROGRESS_PREFIX = "progress/"
SESSION_PREFIX = "session/"
WORK_PREFIX = "work/"
DONE_PREFIX = "done/"
LEASES_PREFIX = "leases/"
LEARNERS_PREFIX = "learners/"


def claim_key(identifier: str) -> str:
    return f"{CLAIMS_PREFIX}{identifier}"


def progress_key(learner_id: str) -> str:
    return f"{PROGRESS_PREFIX}{learner_id}.json"


def session_prefix(learner_id: str) -> str:
    """Where format 1 kept a learner's mail; only used to recognise and refuse old runs."""
    return f"{SESSION_PREFIX}{learner_id}/"


def work_prefix(learner_id: str) -> str:
    return f"{WORK_PREFIX}{learner_id}/"


def work_key(learner_id: str, identifier: str) -> str:
    return f"{WORK_PREFIX}{learner_id}/{identifier}"


def done_key(identifier: str) -> str:
    return f"{DONE_PREFIX}{identifier}"


def lease_key(learner_id: str) -> str:
    return f"{LEASES_PREFIX}{learner_id}.json"


def learner_key(learner_id: str) -> str:
    return f"{LEARNERS_PREFIX}{learner_id}.json"


def json_object(data: bytes | None) -> dict[str, Any] | None:
    """A record's body as a dict; None when missing, not a JSON object, or beyond the size and
    depth bounds of ``gradientmail.records`` (which also validates fields: prefer it)."""
    if data is None:
        return None
    try:
        return loads_object(data)
    except RecordError:
        return None
