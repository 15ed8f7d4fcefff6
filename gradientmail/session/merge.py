"""Sample-weighted parameter averaging over mail, and ``consensus``: the result of a run."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import Tensor

from gradientmail.layout import SESSION_PREFIX
from gradientmail.mailbox.base import Mailbox, describe
from gradientmail.session.mail import Mail, Spec, decode, float_state, parse_key, spec_of


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Sums of half-precision tensors are taken in float32; float32/float64 stay as they are."""
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def latest_keys(mailbox: Mailbox) -> dict[str, tuple[str, int | None]]:
    """Each learner's newest mail: ``{learner: (key, seq)}``; seq is None for a final mail.

    A final mail is newer than any numbered one (a learner deletes its numbered mail after
    mailing its final state, and deletes its final mail when it starts again).
    """
    latest: dict[str, tuple[str, int | None]] = {}
    for key in mailbox.list(SESSION_PREFIX):
        parsed = parse_key(key)
        if parsed is None:
            continue
        learner, seq = parsed
        current = latest.get(learner)
        if current is not None and (current[1] is None or (seq is not None and seq <= current[1])):
            continue
        latest[learner] = (key, seq)
    return latest


class WeightedSum:
    """Accumulates ``sum(w * (theta - base))`` (or ``sum(w * theta)`` with no base) per tensor.

    Used for merges (relative to the snapshot, so the result is a delta) and for averages.
    """

    def __init__(self, spec: Spec, base: Mapping[str, Tensor] | None = None) -> None:
        self.base = base
        self.total = 0.0
        self.count = 0
        self.sums = {
            name: torch.zeros(shape, dtype=accumulation_dtype(dtype)) for name, (shape, dtype) in spec.items()
        }

    def add(self, tensors: Mapping[str, Tensor], weight: float) -> None:
        for name, acc in self.sums.items():
            value = tensors[name].to(acc.dtype)
            if self.base is not None:
                value = value - self.base[name].to(acc.dtype)
            acc.add_(value, alpha=weight)
        self.total += weight
        self.count += 1

    def result(self, extra_weight: float = 0.0) -> dict[str, Tensor]:
        """The sums divided by ``total + extra_weight`` (``extra_weight``: the base's own weight)."""
        denominator = self.total + extra_weight
        return {name: acc.div_(denominator) for name, acc in self.sums.items()}


def download(mailbox: Mailbox, key: str, learner: str, spec: Spec) -> Mail | None:
    """One checked mail, or None when it vanished between listing and reading."""
    data = mailbox.get(key)
    if data is None:
        return None
    return decode(data, key=key, spec=spec, learner=learner)


def average_latest(
    mailbox: Mailbox, spec: Spec, learners: Iterable[str] | None = None
) -> tuple[dict[str, Tensor] | None, dict[str, Mail]]:
    """Sample-weighted (``samples_total``) average of every learner's newest mail.

    Returns ``(average, mails)``; ``average`` is None when there is no mail. When no mail carries
    any samples the learners count equally. Raises ``MailRejectedError`` for mail that does not
    fit ``spec``; nothing is returned partially.
    """
    wanted = None if learners is None else set(learners)
    mails: dict[str, Mail] = {}
    for learner, (key, seq) in latest_keys(mailbox).items():
        if wanted is not None and learner not in wanted:
            continue
        mail = download(mailbox, key, learner, spec)
        if mail is None and seq is not None:
            # Replaced by a newer mail (or the final one) since the listing: read that instead.
            fresh = latest_keys(mailbox).get(learner)
            mail = download(mailbox, fresh[0], learner, spec) if fresh else None
        if mail is not None:
            mails[learner] = mail
    if not mails:
        return None, mails
    weighted = sum(m.header.samples_total for m in mails.values()) > 0
    total = WeightedSum(spec)
    for mail in mails.values():
        total.add(mail.tensors, float(mail.header.samples_total) if weighted else 1.0)
    return total.result(), mails


def load_into(model: torch.nn.Module, tensors: Mapping[str, Tensor]) -> None:
    """Copy ``tensors`` into the model's live floating-point entries (in their own dtype/device)."""
    live = float_state(model)
    with torch.no_grad():
        for name, value in tensors.items():
            live[name].copy_(value)


def consensus(mailbox: Mailbox, model: torch.nn.Module) -> dict[str, int]:
    """Load the result of a run into ``model``: the sample-weighted average of every learner.

    Each learner contributes its final state (``session/{learner}/final.safetensors``), or its
    newest mail if it never finished, weighted by the samples it processed in the whole run
    (``samples_total``). Floating-point parameters and buffers are averaged; integer buffers
    keep the model's values.

    Returns:
        ``{learner: samples_total}`` of the learners that were averaged.

    Raises:
        LookupError: the mailbox holds no parameter mail.
        MailRejectedError: a mail does not match ``model`` (names, shapes, dtypes) or is corrupt;
            ``model`` is not modified.
    """
    spec = spec_of(float_state(model))
    average, mails = average_latest(mailbox, spec)
    if average is None:
        raise LookupError(
            f"{describe(mailbox)}: no parameter mail under {SESSION_PREFIX!r}; did any node run a "
            "Session on this mailbox (and this run prefix)?"
        )
    load_into(model, average)
    return {learner: mail.header.samples_total for learner, mail in sorted(mails.items())}

