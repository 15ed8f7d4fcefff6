"""A fragment chain stays readable by readers far from the store and despite a faulty peer.

A peer whose uploads reach the store truncated keeps winning versions: each is unusable, and
every reader walks back past them to the newest good one. Tombstoning ``KEEP`` versions behind
its own write, such a peer used to retire that good version after ``KEEP`` wins in a row, and
every reader then raised "the run cannot continue from this prefix". A writer now retires only
versions older than the newest it downloaded and found usable.

A reader 50 ms from the store, while a peer writes a version every few milliseconds, used to
find the version it listed already tombstoned at every try and give up. A version is now
retired only once a newer one has existed for ``MIN_AGE_S`` by the retiring node's clock.
"""

from __future__ import annotations

import threading
import warnings

import pytest
from test_session_fragments import exchange, session, values, vector

from gradientmail import MailSkippedWarning
from gradientmail.layout import state_key
from gradientmail.mailbox.wrappers import DelayedMailbox, MailboxWrapper
from gradientmail.session import consensus
from gradientmail.session.chain import KEEP, TOMBSTONE, FragmentChain

pytestmark = pytest.mark.timeout(60)


class TruncatedVersions(MailboxWrapper):
    """A peer whose version uploads arrive cut in half (its other requests are intact)."""

    def put_if_absent(self, key: str, data: bytes) -> bool:
        if "/versions/" in key:
            data = data[: len(data) // 2]
        return self.inner.put_if_absent(key, data)


def test_a_peer_whose_uploads_arrive_truncated_never_retires_the_last_good_version(memory_mailbox):
    good = vector(4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MailSkippedWarning)  # each truncated version, as read
        with session(good, memory_mailbox, "good", fragments=1) as a:
            exchange(a, good, 1.0)
            last_good = FragmentChain(memory_mailbox, 0, 1, {}).list_versions()[-1]
            broken = vector(4)
            with session(broken, TruncatedVersions(memory_mailbox), "broken", fragments=1) as b:
                for _ in range(2 * KEEP):  # wins every race: nobody else writes meanwhile
                    exchange(b, broken, 10.0)
                chain = FragmentChain(memory_mailbox, 0, 1, {})
                assert chain.list_versions()[-1] >= last_good + 2 * KEEP
                assert memory_mailbox.get(state_key(last_good, 0)) not in (None, TOMBSTONE)
                exchange(a, good, 1.0)  # the good peer builds on it
            assert values(good) == [1.5] * 4  # 1 alone, then 1 / N with the broken peer a member
        result = vector(4)
        samples = consensus(memory_mailbox, result)
    assert samples["good"] == 2
    assert values(result) == [1.5] * 4  # the broken peer's progress never reached the store intact


def test_a_reader_far_from_the_store_reads_a_chain_that_moves_fast(memory_mailbox):
    model = vector(4)
    stop, folds = threading.Event(), []
    with session(model, memory_mailbox, "fast", fragments=1) as s:

        def write() -> None:  # the only thread using the session while it runs
            while not stop.is_set() or len(folds) < 2 * KEEP:
                exchange(s, model, 1.0)
                folds.append(1)

        writer = threading.Thread(target=write)
        writer.start()
        try:
            far = DelayedMailbox(memory_mailbox, latency=0.05)
            samples = consensus(far, vector(4))  # lists, then reads what it listed: 50 ms each
        finally:
            stop.set()
            writer.join(30)
    assert samples["fast"] >= 1  # no SessionError ("kept vanishing while being read")


@pytest.mark.parametrize("value", ["soon", "-1", "inf", "nan"])
def test_a_malformed_retire_after_is_refused_when_the_session_is_made(memory_mailbox, monkeypatch, value):
    monkeypatch.setenv("GRADIENTMAIL_SESSION_RETIRE_AFTER_S", value)
    with pytest.raises(ValueError, match="GRADIENTMAIL_SESSION_RETIRE_AFTER_S"):
        session(vector(2), memory_mailbox, "a")
