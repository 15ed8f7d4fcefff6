"""The optional compare-and-swap capability (``get_versioned`` / ``replace_if``) on every backend.

Backends that offer it (local, memory, S3) must behave alike; the others (fsspec) must say
they do not, so that leases and resume refuse them with a clear error. Wrappers forward it.
"""

from __future__ import annotations

import multiprocessing
import queue
import threading

import pytest
from mailbox_race_workers import replace_if_process

from gradientmail import UnsafeStoreError
from gradientmail.mailbox import require_replace_if, supports_replace_if
from gradientmail.mailbox.wrappers import CountingMailbox, DelayedMailbox, FaultyMailbox

CAS_BACKENDS = {"local", "memory", "s3", "s3-seaweedfs", "s3-radosgw"}

REAL_S3 = ["s3-seaweedfs", "s3-radosgw"]
"""The real S3 implementations, whose compare-and-swap is atomic (moto's is check-then-write)."""


def test_capability_is_declared_truthfully(any_mailbox, mailbox_backend):
    assert supports_replace_if(any_mailbox) is (mailbox_backend in CAS_BACKENDS)
    if mailbox_backend not in CAS_BACKENDS:
        with pytest.raises(UnsafeStoreError, match="replace_if") as caught:
            require_replace_if(any_mailbox, "lease=")
        assert "lease=" in str(caught.value) and caught.value.store
        with pytest.raises(NotImplementedError):
            CountingMailbox(any_mailbox).replace_if("k", b"v", "x")
        assert not supports_replace_if(CountingMailbox(any_mailbox))


def test_replace_if_compares_and_swaps(any_mailbox, mailbox_backend):
    if mailbox_backend not in CAS_BACKENDS:
        pytest.skip(f"{mailbox_backend} has no compare-and-swap")
    box = any_mailbox
    assert box.get_versioned("units/a") is None
    assert box.replace_if("units/a", b"x", "anything") is False  # never creates
    assert box.get("units/a") is None
    assert box.put_if_absent("units/a", b"one")
    value, version = box.get_versioned("units/a")
    assert value == b"one" and isinstance(version, str) and version
    assert box.replace_if("units/a", b"two", version) is True
    assert box.get("units/a") == b"two"
    assert box.replace_if("units/a", b"three", version) is False  # stale version
    assert box.get("units/a") == b"two"
    value, newer = box.get_versioned("units/a")
    assert value == b"two" and newer != version
    box.put("units/a", b"four")  # any write changes the version
    assert box.replace_if("units/a", b"five", newer) is False
    assert box.get("units/a") == b"four"
    box.delete("units/a")
    assert box.replace_if("units/a", b"six", box_version(b"four", box)) is False
    assert box.get("units/a") is None
    assert list(box.list()) == []  # no lock or temporary file shows up


def box_version(data: bytes, box) -> str:
    """The version ``box`` would give ``data`` (write it elsewhere and read the version)."""
    box.put("scratch", data)
    version = box.get_versioned("scratch")[1]
    box.delete("scratch")
    return version


@pytest.mark.parametrize(
    "wrap",
    [
        CountingMailbox,
        lambda inner: DelayedMailbox(inner, 0.0),
        lambda inner: FaultyMailbox(inner, lambda operation, key: None),
    ],
)
def test_wrappers_forward_replace_if(local_mailbox, wrap):
    box = wrap(local_mailbox)
    assert supports_replace_if(box)
    box.put("k", b"v")
    value, version = box.get_versioned("k")
    assert box.replace_if("k", b"w", version) and local_mailbox.get("k") == b"w"
    if isinstance(box, CountingMailbox):
        assert box.counts["get_versioned"] == 1 and box.counts["replace_if"] == 1


def test_faulty_mailbox_injects_into_replace_if(local_mailbox):
    box = FaultyMailbox(local_mailbox, lambda op, key: OSError("boom") if op == "replace_if" else None)
    box.put("k", b"v")
    with pytest.raises(OSError, match="boom"):
        box.replace_if("k", b"w", box.get_versioned("k")[1])
    assert local_mailbox.get("k") == b"v"


def _replace_if_rounds(mailbox, target, context, writers: int, rounds: int) -> None:
    """Rounds of ``writers`` processes replacing the same version of ``cas/key`` at once."""
    mailbox.put("cas/key", b"start")
    for round_ in range(rounds):
        version = mailbox.get_versioned("cas/key")[1]
        barrier = context.Barrier(writers)
        results = context.Queue()
        processes = [
            context.Process(
                target=replace_if_process, args=(target, f"round {round_} writer {w}", w, version, barrier, results)
            )
            for w in range(writers)
        ]
        for process in processes:
            process.start()
        try:
            outcome = dict(results.get(timeout=60) for _ in range(writers))
        except queue.Empty:
            pytest.fail("a replace_if process died or hung")
        finally:
            for process in processes:
                process.join(timeout=30)
        winners = [w for w, won in outcome.items() if won]
        assert len(winners) == 1, outcome
        assert mailbox.get("cas/key") == f"round {round_} writer {winners[0]}".encode()


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_exactly_one_process_wins_replace_if(tmp_path):
    """Real processes replace the same version at the same moment: exactly one wins, 5 rounds."""
    from gradientmail import LocalMailbox

    mailbox = LocalMailbox(tmp_path / "box")
    _replace_if_rounds(mailbox, str(mailbox.path), multiprocessing.get_context("fork"), 6, 5)


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize("backend", REAL_S3)
def test_exactly_one_process_wins_replace_if_on_real_s3(mailbox_factory, backend):
    """The same on a real S3 implementation (If-Match), whose compare-and-swap is atomic (moto's
    is check-then-write, so exactly one winner is not something moto promises)."""
    mailbox = mailbox_factory(backend)
    _replace_if_rounds(mailbox, mailbox, multiprocessing.get_context("spawn"), 6, 2)


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize("backend", REAL_S3)
def test_sixteen_threads_race_replace_if_on_one_key_on_real_s3(mailbox_factory, backend):
    """The race that once seemed to hang: 16 threads, one key, each looping read-then-replace
    until its own increment lands. SeaweedFS answers every loser 412 (never 409 or 500), but
    serialises conditional writes to one key through a filer lock that it polls once a second:
    simultaneous losers wait up to about writers / 2 seconds. radosgw answers most losers 412
    and some 500 (ECANCELED: two writes met at the head object); the 500 is retried, and the
    412 that follows is settled by the call's token read back. Every increment lands once."""
    mailbox = mailbox_factory(backend)
    mailbox.put("cas/counter", b"0")
    writers = 16
    barrier = threading.Barrier(writers)
    failures: list[BaseException] = []

    def increment() -> None:
        try:
            barrier.wait(timeout=30)
            while True:
                value, version = mailbox.get_versioned("cas/counter")
                if mailbox.replace_if("cas/counter", str(int(value) + 1).encode(), version):
                    return
        except BaseException as exc:  # reported below, in the test's thread
            failures.append(exc)

    threads = [threading.Thread(target=increment) for _ in range(writers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=80)
    assert not any(thread.is_alive() for thread in threads), "a compare-and-swap never returned"
    assert failures == []
    assert mailbox.get("cas/counter") == str(writers).encode()


# -- S3: If-Match, with faults injected at the HTTP layer (see test_s3.py) -------------
@pytest.fixture
def s3_box(s3_bucket, s3_endpoint):
    from test_s3 import make

    return make(s3_bucket, s3_endpoint, botocore_attempts=1)


def _faults(box, script):
    from test_s3 import Faults

    return Faults(box, "PutObject", script)


def test_s3_replace_if_retries_a_409_conflict(s3_box):
    s3_box.put("units/a", b"one")
    version = s3_box.get_versioned("units/a")[1]
    faults = _faults(s3_box, [(409, "ConditionalRequestConflict")])
    assert s3_box.replace_if("units/a", b"two", version) is True
    assert faults.sent == 2 and s3_box.get("units/a") == b"two"


def test_s3_replace_if_that_landed_but_lost_its_answer_is_true(s3_box):
    """The write lands, the answer is a 500; the retry gets 412 against our own write."""
    s3_box.put("units/a", b"one")
    version = s3_box.get_versioned("units/a")[1]
    faults = _faults(s3_box, [("landed", 500, "InternalError")])
    assert s3_box.replace_if("units/a", b"two", version) is True
    assert faults.sent == 2 and s3_box.get("units/a") == b"two"


def test_s3_replace_if_lost_to_a_rival_after_an_ambiguous_error_is_false(s3_box, s3_bucket, s3_endpoint):
    from test_s3 import make

    rival = make(s3_bucket, s3_endpoint)
    s3_box.put("units/a", b"one")
    version = s3_box.get_versioned("units/a")[1]

    class RivalFirst:
        """A 500 that never arrived, and the rival's replace lands before our retry."""

        sent = 0

        def __call__(self, request, **_):
            from test_s3 import fake_response

            self.sent += 1
            if self.sent == 1:
                assert rival.replace_if("units/a", b"rival", version)
                return fake_response(request, 500, "InternalError")
            return None

    hook = RivalFirst()
    s3_box.client.meta.events.register("before-send.s3.PutObject", hook)
    assert s3_box.replace_if("units/a", b"mine", version) is False
    assert s3_box.get("units/a") == b"rival"


def test_s3_if_match_unsupported_is_refused(s3_box):
    s3_box.put("units/a", b"one")
    version = s3_box.get_versioned("units/a")[1]
    _faults(s3_box, [(501, "NotImplemented")])
    with pytest.raises(UnsafeStoreError, match="If-Match"):
        s3_box.replace_if("units/a", b"two", version)
