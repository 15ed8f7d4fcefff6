"""Asynchronous exchange of training progress through a mailbox: ``Session`` and ``consensus``.

Nodes that train on different units would drift into different models; a ``Session`` keeps
them one model without ever making a fast node wait for a slow one::

    with Session(model, mailbox=box, learner_id=f"node-{rank}") as session:
        for batch in batches:
            ...
            optimizer.step()
            session.step(samples=len(batch))

    consensus(box, model)  # the result of the run, on any machine, during or afterwards

The rule: exchange progress, not positions
------------------------------------------
The run's model lives in the mailbox as a chain of versions, ``session/state/{version}``; the
first node to enter writes version 0 (its initial model, so every node starts from one base).
When an exchange is due (``every`` or ``every_steps``), a node's *progress* is how far its own
optimizer moved it since it last took the run's state (a pseudo-gradient). In the background it
reads the newest version, adds ``progress / N`` (``N``: learners in the run) and creates the next
version with ``put_if_absent``. Exactly one writer wins each version, so every learner's
progress is folded in exactly once; a writer that loses folds again onto the winner's version.
At the next ``step()`` the node moves to the version it wrote, keeping whatever local progress
it made while the exchange was in flight::

    theta += state_written - snapshot

Dividing by ``N`` is what synchronous data parallelism does (it averages the workers'
gradients): at equal samples the run takes as many effective steps as DDP, and a fast node
contributes more simply because it makes more progress. ``N`` comes from member keys
(``session/members/{learner}.{joined}``), one listing per exchange; a member that has neither
joined nor folded within ``max_staleness`` stops counting, so the rule needs no fixed ``N``.

Cost: one listing, one state read (none when nobody else folded meanwhile) and one state write
per exchange, whatever the number of learners; a node holds about three copies of the model.
``outer=`` chooses how progress becomes a contribution (``gradientmail.session.outer``):
``"delayed_nesterov"`` (default, measured best: ``progress / N`` plus a Nesterov momentum step
once every 4 folds, after Liu et al. 2024) or ``"average"`` (``progress / N`` alone). ``wire_dtype=torch.bfloat16``
stores the state in half the bytes, stochastically rounded.

Enter and exit
--------------
Entering loads the newest state (``catch_up=False`` keeps the model's own parameters until its
first exchange) and writes a member key; a restarted learner (same ``learner_id``) continues
its sequence and totals, which the state records per learner. Leaving waits for the exchange in
flight, applies it, folds the remaining progress (marked final) and moves the model to that
version, deletes its member key and writes a final progress record. If the body raised, nothing
more is folded (progress up to the last exchange stays in the run) and the body's exception
propagates, with a note if the background had failed too.

The state is data, never code
------------------------------
Safetensors bytes with a bounded metadata header (``format``, ``version``, the writer and a
table of every learner's ``seq``, ``step``, ``samples``, ``time``, ``final``). Nothing is
unpickled. A state of another model, another ``format`` (mail of the first Session format
included), or corrupt bytes is refused with ``MailRejectedError`` naming what it found.

Errors
------
Failures of the background thread are recorded and raised on the training thread at the next
``step()`` or at exit: ``GradientMailError`` subclasses (``MailRejectedError``,
``MailboxError``) as themselves, anything else wrapped in ``SessionError``. Every wait on the
thread is bounded by ``timeout``; past it a ``SessionError`` says the mailbox is not answering.
"""

from __future__ import annotations

from gradientmail.session.core import (
    DEFAULT_EVERY,
    DEFAULT_MAX_STALENESS,
    DEFAULT_TIMEOUT,
    ENV_EVERY,
    ENV_EVERY_STEPS,
    ENV_MAX_STALENESS,
    ENV_OUTER,
    ENV_TIMEOUT,
    KEEP_MAIL,
    Session,
)
from gradientmail.session.merge import consensus
from gradientmail.session.outer import Average, DelayedNesterov, OuterOptimizer

__all__ = [
    "DEFAULT_EVERY",
    "DEFAULT_MAX_STALENESS",
    "DEFAULT_TIMEOUT",
    "ENV_EVERY",
    "ENV_EVERY_STEPS",
    "ENV_MAX_STALENESS",
    "ENV_OUTER",
    "ENV_TIMEOUT",
    "KEEP_MAIL",
    "Average",
    "DelayedNesterov",
    "OuterOptimizer",
    "Session",
    "consensus",
]
