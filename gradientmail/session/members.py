"""Who is in the run, and what counts as ``N``: member keys, signs of life, and old mail refused.

A learner writes ``session/members/{learner}.{joined}`` on entering and deletes it on leaving; a
member counts in ``N`` while this learner has watched it show a sign of life (a new member key,
a contribution) within ``max_staleness``, on this learner's own clock. A crashed node's key stays
behind and simply stops counting.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from gradientmail.errors import MailRejectedError, UnusableStateError
from gradientmail.layout import FRAGMENTS_PREFIX, MEMBERS_PREFIX, SESSION_PREFIX, is_old_mail_key, parse_member_key
from gradientmail.mailbox.base import Mailbox
from gradientmail.session.mail import Contribution, format_refusal, read_format, skipped


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


class SignsOfLife:
    """Who counts in ``N``, judged only by what this learner watches change in the store, on its
    own clock.

    A sign of life is a member key this learner had not listed before (so every key of its first
    listing) or a learner's line in a fragment advancing between two of its reads (a contribution
    folded or left pending; a slot a peer closed is none). A member counts while its last sign of
    life is within ``staleness``. Peers' dates (in their member keys and lines) are never compared
    with this clock, so a machine whose clock is hours off counts exactly like any other, from the
    first fold. The price: a key nobody is behind any more (a node that crashed before this learner
    joined, a forged date) counts until this learner has watched it for ``staleness`` without a
    sign of life; meanwhile this learner's progress weighs a little less, never more.

    Example:
        >>> now = [0.0]
        >>> life = SignsOfLife("me", clock=lambda: now[0])
        >>> members = Members()
        >>> members.add("session/members/me.1000"), members.add("session/members/ghost.5")
        (True, True)
        >>> life.listed(members, life.clock())
        >>> sorted(life.counted(members, {}, staleness=300, since=0.0, now=life.clock()))
        ['ghost', 'me']
        >>> now[0] = 301.0  # watched for longer than staleness without a sign: it stops counting
        >>> life.listed(members, life.clock())
        >>> sorted(life.counted(members, {}, staleness=300, since=0.0, now=life.clock()))
        ['me']

    Args:
        me: this learner, which always counts.
        clock: this learner's clock, in seconds; only its differences matter (default
            ``time.monotonic``, so that setting the wall clock changes nothing).
    """

    def __init__(self, me: str, clock: Callable[[], float] | None = None) -> None:
        self.me = me
        self.clock = time.monotonic if clock is None else clock  # looked up now: a virtual clock may stand in
        self._keys: frozenset[str] = frozenset()  # the member keys of the previous listing
        # Per fragment, the lines as last read: the reader's own table, kept as it was handed over
        # (tables are never changed once built), so a learner holds no copy of N lines per fragment.
        self._lines: dict[int, Mapping[str, Contribution]] = {}
        self._alive: dict[str, float] = {}  # learner -> its last sign of life, on this clock
        self._advanced: dict[str, float] = {}  # learner -> when its line was last seen advancing

    def listed(self, members: Members, at: float) -> None:
        """Note the member keys listed at ``at``: a key not listed before is a sign of life."""
        for learner, keys in members.keys.items():
            if not self._keys.issuperset(keys):
                self._alive[learner] = at
        self._keys = frozenset(key for keys in members.keys.values() for key in keys)

    def read(self, fragment: int, learners: Mapping[str, Contribution], at: float) -> None:
        """Note each learner's line in ``fragment`` as read at ``at``: a line that advanced since
        this fragment was last read (or appeared in it) is a sign of life. The first read of a
        fragment only sets where the lines stand: their dates say nothing this clock can judge.
        ``learners`` is kept, not copied: it must not change afterwards (``View.table`` does not)."""
        previous = self._lines.get(fragment)
        self._lines[fragment] = learners
        if previous is None:
            return
        for learner, line in learners.items():
            before = previous.get(learner)
            if before is line:  # the same line object (a shared ledger's): nothing moved
                continue
            # A slot a peer closed advances the seq but keeps the learner's last time: no sign.
            if before is None or (line.seq > before.seq and line.time != before.time):
                self._alive[learner] = self._advanced[learner] = at

    def counted(
        self,
        members: Members,
        learners: Mapping[str, Contribution],
        *,
        staleness: float,
        since: float,
        now: float,
    ) -> set[str]:
        """The learners that count in ``N`` at ``now`` for the progress made since ``since``
        (both on this learner's clock), ``learners`` being the lines of the fragment folded.

        A member counts while its last sign of life is within ``staleness``. A learner whose line
        says it finished (after its newest member key: both dates by its own clock) counts for
        the progress made while it was still there: when this learner saw its line advance at or
        after ``since``, however late the fold runs.
        """
        counted = {self.me}
        for learner, joined in members.joined.items():
            line = learners.get(learner)
            if line is not None and line.final and line.time >= joined:
                continue  # it left, after its newest key was written
            if now - self._alive.get(learner, -math.inf) <= staleness:
                counted.add(learner)
        for learner, line in learners.items():
            if line.final and self._advanced.get(learner, -math.inf) >= since:
                counted.add(learner)
        return counted
