"""The progress writer writes the records of different units side by side.

On a distant store a finished unit costs three round trips (its claim read, its done record, its
work record's deletion); written one unit after another they fall behind a loop that finishes a
unit every few batches, and leaving the block waits for the backlog.
"""

from __future__ import annotations

import threading

from gradientmail.layout import claim_key, done_key, work_key
from gradientmail.mailbox.wrappers import MailboxWrapper
from gradientmail.queue.elastic_options import ElasticOptions
from gradientmail.queue.progress import ProgressTracker
from gradientmail.records import ClaimRecord, WorkRecord

UNITS = [f"u{i}" for i in range(4)]


class ClaimReadsMeet(MailboxWrapper):
    """Holds each read of a claim until every unit's claim is being read at once."""

    def __init__(self, inner, parties: int) -> None:
        super().__init__(inner)
        self.meeting = threading.Barrier(parties, timeout=20)

    def get(self, key, **kwargs):
        if key.startswith("units/"):
            self.meeting.wait()  # one unit at a time: the barrier breaks and the write fails
        return self.inner.get(key, **kwargs)


def test_the_records_of_units_finished_together_are_written_side_by_side(memory_mailbox):
    options = ElasticOptions(resume=True, lease_s=None)
    for identifier in UNITS:
        memory_mailbox.put_if_absent(
            claim_key(identifier),
            ClaimRecord.from_bytes(
                b'{"learner":"me","token":"t-' + identifier.encode() + b'","worker":null}'
            ).to_bytes(),
        )
        memory_mailbox.put(
            work_key("me", identifier), WorkRecord.new("me", f"t-{identifier}", options.incarnation, 0).to_bytes()
        )
    tracker = ProgressTracker(ClaimReadsMeet(memory_mailbox, len(UNITS)), "me", options)
    for identifier in UNITS:  # finished before the writer starts: one round of writes
        tracker.finished(identifier, f"t-{identifier}")
    tracker.start()
    tracker.flush()
    tracker.check()  # the reads overlap: one at a time they would break the barrier
    tracker.close(release=False, clean=True)
    assert tracker.writes["done"] == len(UNITS)
    assert all(memory_mailbox.get(done_key(identifier)) is not None for identifier in UNITS)
    assert not list(memory_mailbox.list("work/"))
