"""The training loop is never slowed or blocked by the exchange, and a failure in the
background is raised at a defined point: the next step or the exit.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from session_toys import (  # tests/helpers/ is on sys.path (tests/conftest.py)
    GatedMailbox,
    exchange,
    linear,
    scalar,
    session,
    stored_spec,
    value,
)

from gradientmail import MailboxError, SessionError
from gradientmail.layout import state_key
from gradientmail.mailbox.wrappers import CountingMailbox, DelayedMailbox, FaultyMailbox
from gradientmail.session.chain import FragmentChain
from gradientmail.session.mail import decode

pytestmark = pytest.mark.timeout(60)


def test_step_returns_while_the_exchange_is_in_flight(memory_mailbox):
    gated = GatedMailbox(memory_mailbox)
    counting = CountingMailbox(gated)
    with session(linear(), counting, every_steps=1) as s:
        gated.armed.set()
        s.step(samples=1)
        assert gated.waiting.wait(10)
        requests = counting.requests
        for _ in range(200):  # every one would be due; none may wait or start another exchange
            s.step(samples=1)
        assert s.in_flight and s.exchanges == 0 and counting.requests == requests
        gated.open()
        s.wait()
        assert s.exchanges == 1 and s.steps == 201


def test_steps_between_exchanges_make_no_requests(memory_mailbox):
    counting = CountingMailbox(memory_mailbox)
    with session(linear(), counting, every_steps=50) as s:
        before = counting.requests
        for _ in range(49):
            s.step(samples=1)
        assert counting.requests == before and not s.in_flight
        s.step(samples=1)
        assert s.in_flight
        s.wait()


@pytest.mark.slow
def test_delayed_mailbox_exchange_runs_behind_the_training_loop(memory_mailbox):
    slow = DelayedMailbox(memory_mailbox, latency=0.25)
    model, peer_model = scalar(), scalar()
    with session(peer_model, memory_mailbox, "peer") as peer, session(model, slow, every_steps=1) as s:
        exchange(peer, peer_model, 4.0)  # run: 2
        s.step(samples=10)
        s.step(samples=10)  # its listing alone takes 0.25 s: still in flight, and this step returned
        assert s.in_flight and s.exchanges == 0
        s.wait()
        assert value(model) == 2.0


def test_background_failure_is_raised_at_next_step_wrapped_in_session_error(memory_mailbox):
    broken = threading.Event()

    def fault(operation, key):
        failing = broken.is_set() and operation == "put_if_absent" and key.startswith("session/")
        return OSError("disk full") if failing else None

    with session(linear(), FaultyMailbox(memory_mailbox, fault), every_steps=1) as s:
        broken.set()
        s.step(samples=1)
        s.wait(timedelta(seconds=10), apply=False)  # failed in the background: raised at the step
        with pytest.raises(SessionError, match="disk full") as info:
            s.step(samples=1)
        assert isinstance(info.value.__cause__, OSError)
        s.step(samples=1)  # starts the next exchange, which fails the same way
        with pytest.raises(SessionError):
            s.wait()
        # ... and exit raises it too instead of losing it
        s.step(samples=1)
        with pytest.raises(SessionError, match="disk full"):
            s.__exit__(None, None, None)


def test_gradientmail_errors_from_the_background_are_raised_as_themselves(memory_mailbox):
    def fault(operation, key):
        return MailboxError("throttled", operation=operation, key=key) if operation == "list" else None

    s = session(linear(), FaultyMailbox(memory_mailbox, fault), catch_up=False)
    with pytest.raises(MailboxError, match="throttled"):
        with s:
            pass  # enter lists the run's state


def test_exit_raises_background_failure_of_the_last_exchange(memory_mailbox):
    broken = threading.Event()

    def fault(operation, key):
        return OSError("gone") if broken.is_set() and operation == "get" else None

    peer_model = scalar()
    with session(peer_model, memory_mailbox, "peer") as peer:
        with pytest.raises(SessionError, match="gone"):
            with session(scalar(), FaultyMailbox(memory_mailbox, fault)) as s:
                exchange(peer, peer_model, 1.0)  # a newer version to read
                broken.set()
                s.step(samples=1)  # the exchange fails reading it; exit must say so
        header = decode(memory_mailbox.get(state_key(1)), key="k", spec=stored_spec(peer_model)).header
        assert "me" not in header.learners  # nothing of "me" was folded
        assert FragmentChain(memory_mailbox, 0, 1, {}).list_versions()[-1] == 1


def test_body_exception_propagates_unmasked_and_no_final_mail_is_sent(memory_mailbox):
    broken = threading.Event()

    def fault(operation, key):
        failing = broken.is_set() and operation == "put_if_absent" and key.startswith("session/")
        return OSError("store down") if failing else None

    before = set(threading.enumerate())
    with pytest.raises(KeyError, match="from the body") as info:
        with session(linear(), FaultyMailbox(memory_mailbox, fault)) as s:
            broken.set()
            s.step(samples=1)
            raise KeyError("from the body")
    assert any("store down" in note for note in getattr(info.value, "__notes__", []))
    assert list(memory_mailbox.list("session/")) == [state_key(0)]  # the base; nothing folded
    assert not [t for t in threading.enumerate() if t not in before and t.name.startswith("gradientmail-session-")]


@pytest.mark.timeout(30)
def test_a_store_that_never_answers_fails_exit_within_the_timeout(memory_mailbox):
    gated = GatedMailbox(memory_mailbox)
    s = session(linear(), gated, timeout=timedelta(seconds=0.2))
    try:
        with pytest.raises(SessionError, match="not answering"):
            with s:
                gated.armed.set()
                s.step(samples=1)
                assert gated.waiting.wait(10)
    finally:
        gated.open()


@pytest.mark.timeout(30)
def test_overlapped_requests_on_one_lane_run_in_order_and_return():
    from gradientmail.session.overlap import parallel

    seen: list[int] = []
    assert parallel(lambda item: seen.append(item) or item * 2, [1, 2, 3], lanes=1) == [2, 4, 6]
    assert seen == [1, 2, 3]
    assert parallel(lambda item: item + 1, range(10), lanes=4) == list(range(1, 11))
