"""Asynchronous exchange of training progress through a mailbox: ``Session`` and ``consensus``.

Nodes that train on different units stay one model without a fast node ever waiting for a slow
one: each folds its progress (``/ N``) into the run's state in the mailbox, in the background.
The rule, costs, failure handling and trust model: ``docs/session.md``.

Modules: ``core`` (``Session``, the training-thread side), ``exchange`` (its background thread),
``fragments`` (how the state is cut), ``shards`` (cut along FSDP2's shards), ``chain`` (one
fragment on the store: versions and pending contributions), ``members`` (who counts in ``N``), ``overlap`` (requests in parallel), ``mail``
(the bytes and keys), ``outer`` (how progress becomes a contribution),
``merge`` (``consensus``).

Example:
    >>> import torch
    >>> from gradientmail import MemoryMailbox
    >>> box, model = MemoryMailbox("doctest-session-package"), torch.nn.Linear(2, 1)
    >>> box.clear()
    >>> with Session(model, mailbox=box, learner_id="node-0") as session:
    ...     session.step(samples=16)  # after each optimizer.step()
    >>> consensus(box, model)  # the run's model, on any machine, during or afterwards
    {'node-0': 16}
"""

from __future__ import annotations

from gradientmail.session.core import Session
from gradientmail.session.merge import consensus
from gradientmail.session.options import (
    DEFAULT_EVERY,
    DEFAULT_MAX_STALENESS,
    DEFAULT_TIMEOUT,
    ENV_EVERY,
    ENV_EVERY_STEPS,
    ENV_FRAGMENTS,
    ENV_MAX_STALENESS,
    ENV_OUTER,
    ENV_TIMEOUT,
)
from gradientmail.session.outer import Average, DelayedNesterov, OuterOptimizer

__all__ = [
    "DEFAULT_EVERY",
    "DEFAULT_MAX_STALENESS",
    "DEFAULT_TIMEOUT",
    "ENV_EVERY",
    "ENV_EVERY_STEPS",
    "ENV_FRAGMENTS",
    "ENV_MAX_STALENESS",
    "ENV_OUTER",
    "ENV_TIMEOUT",
    "Average",
    "DelayedNesterov",
    "OuterOptimizer",
    "Session",
    "consensus",
]
