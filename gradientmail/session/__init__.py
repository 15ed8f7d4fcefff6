"""Asynchronous parameter exchange through a mailbox: ``Session`` and ``consensus``.

Nodes that train on different units would drift into different models; a ``Session`` keeps
them one model without ever making a fast node wait for a slow one::

    with Session(model, mailbox=box, learner_id=f"node-{rank}") as session:
        for batch in batches:
            ...
            optimizer.step()
            session.step(samples=len(batch))

    consensus(box, model)  # the result of the run, on any machine, afterwards

The exchange
------------
``step(samples=n)`` counts steps and samples. When an exchange is due (``every`` since the
previous one began, or ``every_steps`` steps, whichever comes first) and none is in flight, it
copies the model's floating-point entries to the CPU (the snapshot) and hands them to the
session's one background thread, which

1. mails the snapshot to ``session/{learner}/{seq:012d}.safetensors`` (``put``) and deletes
   this learner's older mail, keeping the newest ``KEEP_MAIL`` (2) so that a peer that listed
   the previous mail can still read it;
2. writes ``progress/{learner}.json`` (see ``gradientmail.layout``);
3. lists ``session/``, downloads each peer's newest mail that is new to this node, checks it
   and computes the merge.

A later ``step()`` applies the merge on the training thread, so it never races
``optimizer.step()``. When nothing is due and nothing has finished, ``step()`` is a counter
update, an ``Event`` check and a clock read.

The merge rule
--------------
Plain sample-weighted parameter averaging, no outer momentum (outer momentum on stale updates
hurts asynchronous Local-SGD; Liu et al. 2024). With ``theta_s`` the snapshot and ``w_s`` the
samples this node processed since its own previous mail, and for every counted peer ``p`` its
mailed parameters ``theta_p`` with ``w_p`` = the samples it processed since *its* previous
mail::

    theta_merged = (w_s * theta_s + sum_p w_p * theta_p) / (w_s + sum_p w_p)
    theta_now   += theta_merged - theta_snapshot        # applied as a delta

so the local progress made while the exchange was in flight is kept. A peer's mail counts once,
only if it is newer than the mail already read from that peer, younger than ``max_staleness``
(by the sender's clock at its snapshot) and carries samples; stale, silent or dead peers simply
stop counting. With no counted peer nothing is applied. Floating-point ``state_dict`` entries
(parameters and float buffers, each storage once for tied weights) are averaged, in float32 for
half-precision models; integer buffers stay local.

Mail is data, never code
------------------------
Safetensors bytes with the sender's ``learner``, ``seq``, ``step``, ``samples_total``,
``samples_since_previous``, ``time`` and ``format`` in the metadata header. Nothing is
unpickled. Mail with other tensor names, shapes or dtypes, another format, or corrupt or
truncated bytes is rejected with ``MailRejectedError`` naming the learner, the key and the first
difference, and the model is not touched. A rejected peer mail is raised at the next ``step()``
(once per mail): a different model in one run is a configuration error to fix, not to skip.

Enter and exit
--------------
Entering loads the ``samples_total``-weighted average of every learner's newest mail (a late or
restarted node joins the consensus; ``catch_up=False`` skips this); a restarted learner
(same ``learner_id``) continues its sequence numbers and totals. Leaving waits for the exchange
in flight, applies it, mails the final state to ``session/{learner}/final.safetensors``,
deletes the numbered mail and writes a final progress record (``"finished": true``). If the
body raised, nothing more is mailed and the body's exception propagates (with a note if the
background had failed too).

Errors
------
Failures of the background thread are recorded and raised on the training thread at the next
``step()`` or at exit: ``GradientMailError`` subclasses (``MailRejectedError``,
``MailboxError``) as themselves, anything else wrapped in ``SessionError``. Every wait on the
thread is bounded by ``timeout``; past it a ``SessionError`` says the mailbox is not answering.

``consensus(mailbox, model)`` loads the ``samples_total``-weighted average of every learner's
final state (its newest mail if it never finished) into ``model``.
"""

from __future__ import annotations

from gradientmail.session.core import (
    DEFAULT_EVERY,
    DEFAULT_MAX_STALENESS,
    DEFAULT_TIMEOUT,
    ENV_EVERY,
    ENV_EVERY_STEPS,
    ENV_MAX_STALENESS,
    ENV_TIMEOUT,
    KEEP_MAIL,
    Session,
)
from gradientmail.session.merge import consensus

__all__ = [
    "DEFAULT_EVERY",
    "DEFAULT_MAX_STALENESS",
    "DEFAULT_TIMEOUT",
    "ENV_EVERY",
    "ENV_EVERY_STEPS",
    "ENV_MAX_STALENESS",
    "ENV_TIMEOUT",
    "KEEP_MAIL",
    "Session",
    "consensus",
]
