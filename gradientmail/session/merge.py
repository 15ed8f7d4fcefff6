"""``consensus``: the run's model, read from the mailbox on any machine, during or after a run."""

from __future__ import annotations

import torch

from gradientmail.layout import SESSION_PREFIX
from gradientmail.mailbox.base import Mailbox, describe
from gradientmail.session.chain import FragmentChain, run_cut
from gradientmail.session.exchange import logical
from gradientmail.session.members import check_prefix
from gradientmail.session.overlap import parallel
from gradientmail.session.shards import plan_for_run


def consensus(mailbox: Mailbox, model: torch.nn.Module) -> dict[str, int]:
    """Load the run's model into ``model``: its base plus every learner's folded progress.

    Each fragment's logical state (its newest version plus the contributions pending beside it)
    holds every contribution made so far, so this is the whole run's model (the run so far,
    during a run), on any machine. Integer buffers keep the model's values. A model sharded
    with FSDP2 loads this rank's shard only (each rank calls it, reading its own fragments); a
    plain model loads the whole state, however the run sharded it.

    Args:
        mailbox: the run's store.
        model: a module of the run's architecture; its floating-point entries are overwritten.

    Returns:
        ``{learner: samples}``: the samples of every learner whose progress every fragment holds
        (every fragment this rank loaded, for a sharded model).

    Raises:
        LookupError: the mailbox holds no state of a run.
        MailRejectedError: the state does not match ``model`` (names, shapes, fragments) or is
            corrupt, or the mailbox holds mail of another format; ``model`` is not modified.

    Example:
        >>> import torch
        >>> from gradientmail import MemoryMailbox, Session
        >>> box = MemoryMailbox("doctest-consensus")
        >>> box.clear()
        >>> for name, samples in [("a", 8), ("b", 4)]:
        ...     with Session(torch.nn.Linear(2, 1), mailbox=box, learner_id=name) as session:
        ...         session.step(samples=samples)
        >>> consensus(box, torch.nn.Linear(2, 1))
        {'a': 8, 'b': 4}
    """
    check_prefix(mailbox)
    run = run_cut(mailbox)
    if run is None:
        raise LookupError(
            f"{describe(mailbox)}: no run state under {SESSION_PREFIX!r}; did any node run a "
            "Session on this mailbox (and this run prefix)?"
        )
    plan = plan_for_run(model, run)
    # Any floating dtype is accepted: a run may store its state in bfloat16 (wire_dtype).
    chains = [FragmentChain(mailbox, f.index, plan.run_count, f.spec, shards=plan.shards) for f in plan.fragments]
    views = parallel(lambda chain: chain.view(exact=True), chains, lanes=4)
    if any(view is None for view in views):
        raise LookupError(
            f"{describe(mailbox)}: no run state under {SESSION_PREFIX!r}; did any node run a "
            "Session on this mailbox (and this run prefix)?"
        )
    for fragment, view in zip(plan.fragments, views):
        fragment.load_into(model, logical(view))
    tables = [view.learners for view in views]
    learners = sorted(set().union(*tables))
    return {name: min(table[name].samples if name in table else 0 for table in tables) for name in learners}
