"""A learner judged dead, in the run's state: where its units continue, and its next slots closed.

A learner's consumption records are written after the fold that puts their batches in the run
(``gradientmail.fold_gate``), so a learner killed or frozen between the two leaves records that
lag its folds, and whoever continues the unit would train those batches again. Each fold's line
in the state carries the learner's *unit marks* (the last batch of each unit whose record was
not written yet); ``folded_mark`` reads them back from every fragment's logical state without
a model (headers checked, tensors only checked to be readable and finite), and a takeover
continues after the further of the record and the mark every fragment holds.

Cost: one read of each fragment's newest version and of the learner's pending contributions,
and of the marks object their lines name when the marks were many (``session.marks_store``), on
takeovers only (and one listing when the run has no state).

Before a peer reads the marks of a learner it judged dead, it closes that learner's next pending
contribution slot in every fragment (``close_slots``): the learner may only be frozen between
the check before a fold's write and the write, and a contribution landing after the marks were
read would count batches the peer trains again. Closed, the slot refuses it (the learner's fold
then finds its lease fenced and stops); readers absorb a closed slot as nothing
(``mail.ClosedSlot``). Cost: the same reads once more and one create per fragment, once per
learner judged dead.
"""

from __future__ import annotations

from gradientmail.fold_gate import UnitMark, held_everywhere
from gradientmail.layout import pending_key
from gradientmail.mailbox.base import Mailbox
from gradientmail.mailbox.confirmed import create_confirmed
from gradientmail.session.chain import FragmentChain, View, run_fragments
from gradientmail.session.mail import ClosedSlot
from gradientmail.session.marks_store import lines_marks
from gradientmail.session.overlap import parallel

__all__ = ["close_slots", "folded_mark"]


def folded_mark(mailbox: Mailbox, learner: str, unit: str, token: str) -> UnitMark | None:
    """The last batch of ``unit``, trained by ``learner`` under the claim ``token``, whose
    progress every fragment of the run's state holds, as the learner's unit marks say.

    None when the run has no state, or some fragment holds no mark of that claim (then the
    learner's consumption record is at least as far: it was written before that fold).

    Raises:
        SessionError, MailRejectedError: as ``consensus`` (the state cannot be read).
    """
    views = _views(mailbox, learner)
    if views is None:
        return None
    lines = [None if view is None else view.learners.get(learner) for view in views]
    if None in lines:
        return None
    return held_everywhere(lines_marks(mailbox, learner, lines), unit, token)


def close_slots(mailbox: Mailbox, learner: str, by: str) -> int:
    """Close ``learner``'s next pending contribution slot in every fragment that has a state,
    for ``by``, a peer that judged it dead; how many this call closed (a slot found taken holds
    the learner's contribution, or another peer's closure: the marks read after see it).

    Raises:
        SessionError, MailRejectedError: as ``consensus`` (the state cannot be read).
    """
    views = _views(mailbox, learner)
    if views is None:
        return 0
    closed = 0
    for index, view in enumerate(views):
        if view is None:
            continue  # no version yet: a learner's first write there creates version 0
        seq = view.seq_of(learner) + 1
        slot = ClosedSlot(learner, seq, by, index, len(views))
        # Confirmed by a read-back (``mailbox.confirmed``): the learner's late contribution that
        # landed instead, on a store that told both writers they won, is a slot found taken.
        closed += create_confirmed(mailbox, pending_key(index, learner, seq), slot.to_bytes())
    return closed


def _views(mailbox: Mailbox, learner: str) -> list[View | None] | None:
    """Every fragment's logical state with all of ``learner``'s pending contributions (None: no run state)."""
    count = run_fragments(mailbox)
    if count is None:
        return None
    chains = [FragmentChain(mailbox, index, count, None, shards=None) for index in range(count)]
    return parallel(lambda chain: chain.view(exact=True, absorb=0, me=learner), chains, lanes=4)
