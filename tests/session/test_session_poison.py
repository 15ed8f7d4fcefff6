"""Mail that could poison the run: non-finite tensors, corrupt files, forged dates and counts.

Anyone who can write the prefix is a peer, so these cases must cost at most the bad mail itself:
it is skipped with a ``MailSkippedWarning`` naming what was wrong, the chain goes on from the
newest usable version, and no node's model (nor ``consensus``) ever takes in a NaN.
"""

from __future__ import annotations

import time
import warnings

import pytest
import torch
from session_toys import scalar, value  # tests/helpers/ is on sys.path (tests/conftest.py)

from gradientmail import MailRejectedError, MailSkippedWarning, SessionError
from gradientmail.layout import state_key
from gradientmail.session import Session, consensus
from gradientmail.session.chain import FragmentChain
from gradientmail.session.mail import Contribution, StateHeader, encode

pytestmark = pytest.mark.timeout(60)


def session(model, mailbox, learner: str) -> Session:
    return Session(model, mailbox=mailbox, learner_id=learner, every=None, every_steps=1, outer="average")


def exchange(s: Session, model: torch.nn.Module, amount: float) -> None:
    with torch.no_grad():
        model.weight.add_(amount)
    s.step(samples=1)
    s.wait()


def newest_version(mailbox) -> int:
    return FragmentChain(mailbox, 0, 1, {}).list_versions()[-1]


def forge(
    mailbox, version: int, weight: float, *, learner: str = "mallory", learners: dict[str, Contribution] | None = None
) -> None:
    """Write a version of the run's state as a hostile or broken peer would."""
    header = StateHeader(
        version=version,
        learner=learner,
        time=time.time(),
        learners=learners or {learner: Contribution(1, 1, 1, time.time())},
    )
    mailbox.put(state_key(version), encode({"weight": torch.full((1,), weight)}, header))


@pytest.mark.parametrize("poison", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
def test_a_non_finite_version_is_skipped_and_the_chain_goes_on(memory_mailbox, poison):
    model = scalar()
    with session(model, memory_mailbox, "honest") as s:
        exchange(s, model, 2.0)  # the run: 0 -> 2 (one learner)
        bad = newest_version(memory_mailbox) + 1
        forge(memory_mailbox, bad, poison)
        with pytest.warns(MailSkippedWarning, match=r"'mallory'.*tensor 'weight'.*non-finite"):
            exchange(s, model, 1.0)
        assert value(model) == 3.0  # its own progress on top of the last finite version
        assert s.version == bad + 1  # written after the skipped one: the chain goes on
    result = scalar(-5.0)
    consensus(memory_mailbox, result)
    assert value(result) == 3.0


def test_consensus_and_catch_up_skip_a_corrupt_newest_version(memory_mailbox):
    model = scalar()
    with session(model, memory_mailbox, "a") as s:
        exchange(s, model, 4.0)
    memory_mailbox.put(state_key(newest_version(memory_mailbox) + 1), b"\x00garbage, not safetensors")
    result = scalar(-1.0)
    with pytest.warns(MailSkippedWarning, match="truncated or corrupt"):
        consensus(memory_mailbox, result)
    assert value(result) == 4.0
    late = scalar(-1.0)
    with pytest.warns(MailSkippedWarning):
        with session(late, memory_mailbox, "b") as s:
            assert value(late) == 4.0  # caught up from the newest usable version
            exchange(s, late, 2.0)
    consensus(memory_mailbox, result)
    assert value(result) == 6.0  # b's progress, N = 1 (a had left)


def test_junk_files_under_the_session_prefix_block_nobody(memory_mailbox):
    model = scalar()
    memory_mailbox.put("session/someone/000000000001.safetensors", b"not mail at all")
    with pytest.warns(MailSkippedWarning, match="not readable mail"):
        with session(model, memory_mailbox, "a") as s:
            exchange(s, model, 1.0)
    result = scalar()
    with pytest.warns(MailSkippedWarning, match="not readable mail"):
        consensus(memory_mailbox, result)
    assert value(result) == 1.0


def test_well_formed_mail_of_another_model_still_raises(memory_mailbox):
    with session(scalar(), memory_mailbox, "a"):
        pass
    header = StateHeader(version=newest_version(memory_mailbox) + 1, learner="other", time=time.time())
    memory_mailbox.put(state_key(header.version), encode({"weight": torch.zeros(2, 2)}, header))
    with pytest.raises(MailRejectedError, match=r"'other'.*tensor 'weight' has shape \(2, 2\)"):
        consensus(memory_mailbox, scalar())


def test_when_every_kept_version_is_unusable_the_error_says_so(memory_mailbox):
    model = scalar()
    with session(model, memory_mailbox, "a") as s:
        exchange(s, model, 1.0)
    for version in range(newest_version(memory_mailbox) + 1):
        memory_mailbox.put(state_key(version), b"corrupt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MailSkippedWarning)
        with pytest.raises(MailRejectedError, match="no usable version"):
            consensus(memory_mailbox, scalar())


def test_a_node_whose_training_diverged_folds_nothing_and_says_so(memory_mailbox):
    model = scalar()
    with pytest.raises(SessionError, match=r"'me'.*NaN or Inf in 'weight'.*diverged"):
        with session(model, memory_mailbox, "me") as s:
            exchange(s, model, 1.0)
            written = newest_version(memory_mailbox)
            with torch.no_grad():
                model.weight.fill_(float("nan"))
            s.step(samples=1)
            s.wait()
    assert newest_version(memory_mailbox) == written  # the run's state stays finite
    result = scalar()
    consensus(memory_mailbox, result)
    assert value(result) == 1.0


def test_forged_counts_do_not_weigh_in_the_merge(memory_mailbox):
    a, b = scalar(), scalar()
    with session(a, memory_mailbox, "a") as sa, session(b, memory_mailbox, "b") as sb:
        exchange(sa, a, 2.0)
        exchange(sb, b, 2.0)
        version = newest_version(memory_mailbox) + 1
        huge = {
            "a": Contribution(10**18, 10**18, 10**18, time.time()),
            "mallory": Contribution(1, 1, 10**18, time.time()),
        }
        forge(memory_mailbox, version, value(b), learners=huge)
        exchange(sa, a, 2.0)
    result = scalar()
    consensus(memory_mailbox, result)
    # Every contribution is progress / N, whatever a header claims: 2/2 + 2/2 + 2/2 (+ exits).
    assert value(result) == pytest.approx(3.0)


def test_a_reader_skips_a_bounded_number_of_bad_versions(memory_mailbox):
    from gradientmail.session.chain import MAX_WALK_BACK

    model = scalar()
    with session(model, memory_mailbox, "a") as s:
        exchange(s, model, 1.0)
    first_bad = newest_version(memory_mailbox) + 1
    for version in range(first_bad, first_bad + MAX_WALK_BACK + 2):
        memory_mailbox.put(state_key(version), b"corrupt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MailSkippedWarning)
        with pytest.raises(MailRejectedError, match=f"at most {MAX_WALK_BACK} are skipped"):
            consensus(memory_mailbox, scalar())
