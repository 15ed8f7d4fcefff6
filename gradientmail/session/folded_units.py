"""Where a unit continues after its learner died: the batches the run's state already holds.

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
"""

from __future__ import annotations

from gradientmail.fold_gate import UnitMark, held_everywhere
from gradientmail.mailbox.base import Mailbox
from gradientmail.session.chain import FragmentChain, run_fragments
from gradientmail.session.marks_store import lines_marks
from gradientmail.session.overlap import parallel

__all__ = ["folded_mark"]


def folded_mark(mailbox: Mailbox, learner: str, unit: str, token: str) -> UnitMark | None:
    """The last batch of ``unit``, trained by ``learner`` under the claim ``token``, whose
    progress every fragment of the run's state holds, as the learner's unit marks say.

    None when the run has no state, or some fragment holds no mark of that claim (then the
    learner's consumption record is at least as far: it was written before that fold).

    Raises:
        SessionError, MailRejectedError: as ``consensus`` (the state cannot be read).
    """
    count = run_fragments(mailbox)
    if count is None:
        return None
    chains = [FragmentChain(mailbox, index, count, None) for index in range(count)]
    views = parallel(lambda chain: chain.view(exact=True, absorb=0, me=learner), chains, lanes=4)
    lines = [None if view is None else view.learners.get(learner) for view in views]
    if None in lines:
        return None
    return held_everywhere(lines_marks(mailbox, learner, lines), unit, token)
