"""The run record (``run.json``): written once per run, checked by every node that joins it.

A prefix holds one run, and a run is one set of units: claims are keyed by unit identifier, so a
node started with a different unit set in a used prefix would train only the identifiers nobody
claimed yet, and ``gradientmail status`` would count claims of two sets against one total
(``60/40 (150%)``). The record therefore carries the unit set's ``fingerprint``, and a node
whose units differ is refused (``RunMismatchError``) before it claims anything.

The fingerprint covers the identifiers only (sorted, so each node's preference order does not
matter), not the unit values: those are whatever ``load`` accepts, may differ between machines
(a path under each machine's own mount point) and need not have a stable ``repr``. Records
written before fingerprints existed have none and are accepted as they are.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterable
from typing import Any

from gradientmail.errors import RunMismatchError
from gradientmail.layout import RUN_KEY
from gradientmail.records import RUN, RecordError, parse

__all__ = ["RunMismatchError", "check_run_record", "run_record", "unit_fingerprint"]


def unit_fingerprint(identifiers: Iterable[str]) -> str:
    """``"sha256:<64 hex>"`` of the sorted unit identifiers: the same set, the same fingerprint."""
    digest = hashlib.sha256()
    for identifier in sorted(identifiers):
        digest.update(identifier.encode("utf-8", "surrogatepass"))
        digest.update(b"\0")  # identifiers are keys: no NUL inside one
    return f"sha256:{digest.hexdigest()}"


def run_record(units: int, fingerprint: str | None) -> bytes:
    """The body of a new ``run.json`` (fields documented in ``gradientmail.layout``)."""
    record: dict[str, Any] = {"units": units, "created": time.time()}
    if fingerprint is not None:
        record["fingerprint"] = fingerprint
    return json.dumps(record).encode()


def check_run_record(data: bytes, units: int, fingerprint: str | None, store: str) -> dict[str, Any]:
    """The existing run record, or ``RunMismatchError`` when it is not one or names other units.

    ``fingerprint`` None (a caller that does not know its units) checks only that it is a run
    record; so does a record without a fingerprint (written by an older version).
    """
    try:
        record = parse(RUN, data, RUN_KEY)
    except RecordError as exc:
        raise RunMismatchError(
            f"{store}: {exc}; this prefix does not hold a run this version can join: use a fresh prefix"
        ) from None
    recorded = record.get("fingerprint")
    if fingerprint is None or recorded is None or recorded == fingerprint:
        return record
    total = record.get("units")
    theirs = f"{total} units" if isinstance(total, int) else "other units"
    raise RunMismatchError(
        f"{store} holds a run of another unit set ({theirs}, {recorded[:19]}...) than this node's "
        f"({units} units, {fingerprint[:19]}...): claims are per unit identifier, so joining would "
        "mix the two runs; use a fresh prefix for these units, or start this node with the run's "
        "units"
    )
