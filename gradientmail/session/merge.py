"""``consensus``: the run's model, read from the mailbox on any machine, during or after a run."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from gradientmail.layout import SESSION_PREFIX
from gradientmail.mailbox.base import Mailbox, describe
from gradientmail.session.chain import read_newest
from gradientmail.session.mail import accumulation_dtype, float_state, spec_of


def load_into(model: torch.nn.Module, tensors: Mapping[str, Tensor]) -> None:
    """Copy ``tensors`` into the model's live floating-point entries (in their own dtype/device)."""
    live = float_state(model)
    with torch.no_grad():
        for name, value in tensors.items():
            live[name].copy_(value)


def consensus(mailbox: Mailbox, model: torch.nn.Module) -> dict[str, int]:
    """Load the run's model into ``model``: its base plus every learner's folded progress.

    The newest version of the run's state holds every contribution folded in so far, so this is
    the whole run's model (the run so far, during a run), on any machine. Integer buffers keep
    the model's values.

    Args:
        mailbox: the run's store.
        model: a module of the run's architecture; its floating-point entries are overwritten.

    Returns:
        ``{learner: samples}``: the samples of every learner whose progress it holds.

    Raises:
        LookupError: the mailbox holds no state of a run.
        MailRejectedError: the state does not match ``model`` (names, shapes) or is corrupt, or
            the mailbox holds mail of another format; ``model`` is not modified.

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
    # Any floating dtype is accepted: a run may store its state in bfloat16 (wire_dtype).
    spec = {name: (shape, None) for name, (shape, _) in spec_of(float_state(model)).items()}
    state, _ = read_newest(mailbox, spec)
    if state is None:
        raise LookupError(
            f"{describe(mailbox)}: no run state under {SESSION_PREFIX!r}; did any node run a "
            "Session on this mailbox (and this run prefix)?"
        )
    load_into(model, state.tensors)
    return {learner: entry.samples for learner, entry in sorted(state.header.learners.items())}


__all__ = ["accumulation_dtype", "consensus", "load_into"]
