"""Who is in the run, and what counts as ``N``: member keys, signs of life, and old mail refused.

A learner writes ``session/members/{learner}.{joined}`` on entering and deletes it on leaving; a
member counts in ``N`` while it shows a sign of life (joining, or a recent contribution) within
``max_staleness``. A crashed node's key stays behind and simply stops counting.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field

from gradientmail.errors import MailRejectedError, MailSkippedWarning, UnusableStateError
from gradientmail.layout import FRAGMENTS_PREFIX, MEMBERS_PREFIX, SESSION_PREFIX, is_old_mail_key, parse_member_key
from gradientmail.mailbox.base import Mailbox
from gradientmail.session.mail import Contribution, format_refusal, read_format, skipped

MAX_CLOCK_SKEW_S = 300.0
"""How far in the future (by this node's clock) a peer's time may lie and still count as a sign
of life. Beyond it the time is not trusted: a member dated in the year 3000 stops counting."""


@dataclass(frozen=True)
class Members:
    """Who is in the run: each learner's newest member key (``joined``) and all its keys."""

    joined: dict[str, float] = field(default_factory=dict)
    keys: dict[str, list[str]] = field(default_factory=dict)

    def add(self, key: str) -> bool:
        member = parse_member_key(key)
        if member is None:
            return False
        learner, joined = member
        self.joined[learner] = max(joined, self.joined.get(learner, joined))
        self.keys.setdefault(learner, []).append(key)
        return True


def list_members(mailbox: Mailbox) -> Members:
    members = Members()
    for key in mailbox.list(MEMBERS_PREFIX):
        members.add(key)
    return members


def check_prefix(mailbox: Mailbox) -> Members:
    """The members, after refusing mail of an earlier Session format with a clear error.

    Everything under ``session/`` is listed except the fragments (whose tombstones can be many).
    """
    members = Members()
    before = mailbox.list(SESSION_PREFIX)
    after = mailbox.list(SESSION_PREFIX, start_after=FRAGMENTS_PREFIX[:-1] + "0")  # past "fragments/"
    for keys in (before, after):
        for key in keys:
            if keys is before and key >= FRAGMENTS_PREFIX:
                break
            if members.add(key) or not is_old_mail_key(key):
                continue
            data = mailbox.get(key)
            found = read_format(data) if data is not None else None
            if found is None:  # not safetensors with a format at all: junk, not another format
                skipped(
                    UnusableStateError(f"{key!r} under {SESSION_PREFIX!r} is not readable mail of any format; ignored")
                )
                continue
            raise MailRejectedError(format_refusal(key, found))
    return members


def active_learners(
    members: Members,
    learners: Mapping[str, Contribution],
    me: str,
    now: float,
    max_staleness: float,
    since: float | None = None,
    seen: Mapping[str, float] | None = None,
) -> set[str]:
    """Who counts in ``N``: this learner, and every member that joined or folded recently.

    A member whose last sign of life (joining, or its newest contribution by its own clock) is
    older than ``max_staleness`` has stopped counting: a crashed node leaves its member key
    behind. A time more than ``MAX_CLOCK_SKEW_S`` ahead of ``now`` is no sign of life (a broken
    clock or a forged date would otherwise count forever). A learner that finished still counts
    for progress made before it left: when its final contribution is dated after ``since`` (the
    start of the progress being scaled), however late the fold runs.

    ``seen`` holds, by this node's own clock, when each learner's contributions were last seen
    to advance: a learner seen advancing within ``max_staleness`` counts whatever its own clock
    says, so a machine whose clock is minutes off neither drops its peers from ``N`` nor drops
    out of theirs once they have watched it contribute.
    """
    active = {me}
    if since is not None:
        active |= {
            learner
            for learner, entry in learners.items()
            if entry.final and since <= entry.time <= now + MAX_CLOCK_SKEW_S
        }
    for learner, joined in members.joined.items():
        entry = learners.get(learner)
        if entry is not None and entry.final and entry.time >= joined:
            continue
        if seen is not None and now - seen.get(learner, -math.inf) <= max_staleness:
            active.add(learner)
            continue
        signs = [joined] if entry is None else [joined, entry.time]
        trusted = [t for t in signs if t <= now + MAX_CLOCK_SKEW_S]
        if len(trusted) < len(signs):
            _warn_clock(learner, max(signs) - now)
        if trusted and now - max(trusted) <= max_staleness:
            active.add(learner)
    return active


_CLOCKS_WARNED: set[str] = set()


def _warn_clock(learner: str, ahead: float) -> None:
    if learner in _CLOCKS_WARNED:
        return
    _CLOCKS_WARNED.add(learner)
    warnings.warn(
        f"learner {learner!r} dates its mail {ahead:.0f} s in the future (more than "
        f"{MAX_CLOCK_SKEW_S:.0f} s of clock skew): its times are not trusted as signs of life, so it "
        "does not count in N; fix that machine's clock (NTP)",
        MailSkippedWarning,
        stacklevel=4,
    )
