"""A version's header stays small however many learners a run has, and folds stay exactly once.

A version carries only the lines of learners absorbed since its ledger; every other learner's
line lives in the fragment's ledger, read once per ledger. These tests fold far more learners
than a version carries, through ledgers, with contributions left pending and never deleted
(their absorber stopped first), and check that each is counted once.
"""

from __future__ import annotations

import time
import warnings

import pytest
import torch

from gradientmail import MailSkippedWarning
from gradientmail.errors import SessionError
from gradientmail.layout import ledger_key, pending_key
from gradientmail.mailbox.wrappers import MailboxWrapper
from gradientmail.session.chain import FragmentChain
from gradientmail.session.mail import RECENT_LINES, Contribution, PendingHeader, StateHeader, encode, metadata_of

pytestmark = pytest.mark.timeout(120)

SPEC = {"weight": ((2,), torch.float32)}


class KeepsPending(MailboxWrapper):
    """Writers that stop after their create, before deleting what they absorbed."""

    def delete(self, key: str) -> None:
        if "/pending/" not in key:
            self.inner.delete(key)


def fold(chain: FragmentChain, learner: str, seq: int, amount: float = 1.0) -> int | None:
    view = chain.view(absorb=None, me=learner)
    entry = Contribution(seq, seq + 1, seq + 1, time.time())
    return chain.fold(view, learner, {"weight": torch.full((2,), amount)}, entry).version


def leave_pending(mailbox, learner: str, seq: int, amount: float = 1.0) -> None:
    """A contribution left pending, as a learner that lost its race leaves it."""
    header = PendingHeader(learner, Contribution(seq, seq + 1, seq + 1, time.time()), 0, 1)
    mailbox.put(pending_key(0, learner, seq), encode({"weight": torch.full((2,), amount)}, header))


def header_lines(mailbox, version: int) -> StateHeader:
    key = f"session/fragments/0000/versions/{version:012d}.safetensors"
    return StateHeader.from_metadata(metadata_of(mailbox.get(key), key), key=key)


def test_a_version_carries_a_bounded_number_of_lines_however_many_learners_fold(memory_mailbox):
    chain = FragmentChain(memory_mailbox, 0, 1, SPEC)
    chain.create_base({"weight": torch.zeros(2)}, "first")
    learners = 3 * RECENT_LINES
    for index in range(learners):
        assert fold(chain, f"n{index:03d}", 0) == index + 1
    most = max(len(header_lines(memory_mailbox, version).learners) for version in range(1, learners + 1))
    assert most <= RECENT_LINES + 1
    assert header_lines(memory_mailbox, learners).ledger is not None
    # A fresh reader (as consensus) sees every learner's line and every contribution once.
    view = FragmentChain(memory_mailbox, 0, 1, SPEC).view(exact=True)
    assert len(view.learners) == learners and all(line.seq == 0 for line in view.learners.values())
    assert view.base.tensors["weight"].tolist() == [float(learners)] * 2
    # Only the ledgers that versions still kept may name stay.
    ledgers = list(memory_mailbox.list("session/fragments/0000/ledgers/"))
    assert 1 <= len(ledgers) <= 2


def test_contributions_left_behind_are_absorbed_once_across_ledgers(memory_mailbox):
    box = KeepsPending(memory_mailbox)
    chain = FragmentChain(box, 0, 1, SPEC)
    chain.create_base({"weight": torch.zeros(2)}, "first")
    for index in range(8):  # eight learners' contributions wait, then are absorbed, never deleted
        leave_pending(box, f"slow{index}", 0)
    fold(chain, "absorber", 0)
    assert len(list(box.list("session/fragments/0000/pending/"))) == 8  # still there: garbage now
    for index in range(2 * RECENT_LINES):  # enough others that the slow ones' lines go to a ledger
        fold(chain, f"n{index:03d}", 0)
    newest = chain.list_versions()[-1]
    assert not {f"slow{index}" for index in range(8)} & set(header_lines(box, newest).learners)
    for index in range(4):  # and some of them contribute again, after their garbage
        leave_pending(box, f"slow{index}", 1)
    fold(FragmentChain(box, 0, 1, SPEC), "last", 0)  # a fresh writer: knows nothing but the store
    total = 8 + 1 + 2 * RECENT_LINES + 4 + 1
    view = FragmentChain(box, 0, 1, SPEC).view(exact=True)
    assert view.base.tensors["weight"].tolist() == [float(total)] * 2
    assert [view.seq_of(f"slow{index}") for index in range(8)] == [1] * 4 + [0] * 4


def test_a_missing_or_hostile_ledger_is_refused_with_a_clear_error(memory_mailbox):
    chain = FragmentChain(memory_mailbox, 0, 1, SPEC)
    chain.create_base({"weight": torch.zeros(2)}, "first")
    for index in range(RECENT_LINES + 8):
        fold(chain, f"n{index:03d}", 0)
    newest = chain.list_versions()[-1]
    ref = header_lines(memory_mailbox, newest).ledger
    assert ref is not None
    key = ledger_key(0, ref.version, ref.learner)
    memory_mailbox.put(key, b'{"format": "gradientmail.session/4", "kind": "ledger", "learners": [1]}')
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", MailSkippedWarning)
        view = FragmentChain(memory_mailbox, 0, 1, SPEC).view()
    assert view is not None and view.base.header.version < ref.version  # walked back past it
    assert any("ledger" in str(warning.message) for warning in caught)
    memory_mailbox.delete(key)  # deleted under the versions that name it: they cannot be read
    with pytest.raises(SessionError, match="kept vanishing"):
        FragmentChain(memory_mailbox, 0, 1, SPEC).view(exact=True)
