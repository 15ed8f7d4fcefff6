"""A finished elastic run of many units, written with the queue's own record writers.

What ``gradientmail status`` and ``plot`` meet after a long run: one claim per unit (the
elastic queue's fields), one ``done/`` record per unit, a lease and a progress record (with
``unit_spans``) per learner, learners named ``{hostname}-{rank}`` like the default learner id.
The tests write small ones; for measuring, write a 100k-unit run once::

    python tests/helpers/big_run.py /tmp/run-100k --units 100000
    /usr/bin/time -v python -m gradientmail status /tmp/run-100k
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from gradientmail import LocalMailbox
from gradientmail.layout import claim_key, done_key, lease_key, progress_key
from gradientmail.queue.claims import claim_fields
from gradientmail.records import LeaseRecord, Record

HOST = "machine-with-a-long-hostname"
"""Long enough that the learner names (``HOST-0`` ...) cannot fit whole at 80 columns."""

T0 = 1_700_000_000.0


def learner_names(learners: int, host: str = HOST) -> list[str]:
    """``[f"{host}-0", f"{host}-1", ...]``: the default learner ids of one machine's ranks."""
    return [f"{host}-{rank}" for rank in range(learners)]


def write_big_run(mailbox, *, units: int, learners: int = 4, host: str = HOST, unit_s: float = 1.0) -> list[str]:
    """Write a finished elastic run of ``units`` units shared by ``learners`` learners.

    Learner ``r`` takes ``r + 1`` time units per unit, so the shares differ. Returns the names.
    """
    names = learner_names(learners, host)
    mailbox.put_if_absent("run.json", json.dumps({"units": units, "created": T0}).encode())
    ready = dict.fromkeys(names, T0)
    trained: dict[str, list[dict]] = {name: [] for name in names}
    for index in range(units):
        identifier = f"{index:06d}-0.json"
        name = min(names, key=lambda n: (ready[n], n))
        seconds = unit_s * (names.index(name) + 1)
        body = claim_fields(name, f"t{index}", 0, incarnation=f"i-{name}", state="active")
        body["claimed_at"] = ready[name]
        mailbox.put_if_absent(claim_key(identifier), Record(body).to_bytes())
        mailbox.put_if_absent(
            done_key(identifier), Record({"learner": name, "token": f"t{index}", "at": ready[name]}).to_bytes()
        )
        trained[name].append({"unit": identifier, "first": ready[name], "last": ready[name] + seconds, "batches": 4})
        ready[name] += seconds
    for name in names:
        recent = trained[name][-64:]
        older = trained[name][:-64]
        record = {
            "learner": name,
            "steps": 4 * len(trained[name]),
            "samples": 128 * len(trained[name]),
            "started": T0,
            "last_seen": ready[name],
            "finished": True,
            "units": len(trained[name]),
            "unit_spans": {
                "recent": recent,
                "older": {
                    "units": len(older),
                    "batches": 4 * len(older),
                    "busy_s": sum(span["last"] - span["first"] for span in older),
                },
            },
        }
        mailbox.put(progress_key(name), Record(record).to_bytes())
        mailbox.put(
            lease_key(name), LeaseRecord.new(name, f"i-{name}", 1, len(trained[name]), 30.0, "stopped").to_bytes()
        )
    return names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path, help="a directory that holds no run yet")
    parser.add_argument("--units", type=int, default=100_000)
    parser.add_argument("--learners", type=int, default=4)
    args = parser.parse_args(argv)
    began = time.perf_counter()
    write_big_run(LocalMailbox(args.path), units=args.units, learners=args.learners)
    print(f"wrote {args.units} units in {time.perf_counter() - began:.1f}s to {args.path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
