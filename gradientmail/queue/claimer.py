"""Which unit a learner tries next, and when it lists claims first (``Claimer``).

The claim itself is ``queue.claims.try_claim``; this module only decides where to try, keeping
mailbox requests per claimed unit about constant however long the run. Details: docs/queue.md.
"""

from __future__ import annotations

import bisect
import itertools
import uuid
import zlib
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from gradientmail.layout import CLAIMS_PREFIX
from gradientmail.mailbox.base import LIST_PAGE, Mailbox
from gradientmail.queue.claim_index import ClaimIndex, PositionOrder
from gradientmail.queue.claims import try_claim
from gradientmail.queue.crowd import CROWD_LIMIT, CROWD_MEMORY, STRETCH, Settled, free_run, jump_target, spread
from gradientmail.queue.order_runs import OrderRuns

__all__ = [
    "DEFAULT_LISTING",
    "LISTING_POLICIES",
    "NEAR",
    "RISK_LIMIT",
    "RISK_MEMORY",
    "UNSEEN_RISK",
    "Claimer",
    "Pick",
]

LISTING_POLICIES = ("adaptive", "always", "conflict", "never")
"""When ``Claimer`` lists claims before an attempt (see ``Claimer``); ``adaptive`` is the default."""

DEFAULT_LISTING = "adaptive"

NEAR = 2
"""``adaptive`` lists first when one of the next ``NEAR`` units in the claimer's order is known
to be claimed by someone else: it is catching up with another claimer."""

RISK_LIMIT = 0.1
"""``adaptive`` lists first when more than this share of recent candidates reached by the same
step through the claimer's order had been taken by someone else since it last looked."""

RISK_MEMORY = 32
"""Roughly how many recent candidates (per step) the ``adaptive`` estimate remembers."""

UNSEEN_RISK = 0.5
"""The risk ``adaptive`` assumes for a step it has not seen yet, once it has seen another
claimer's claims (alone, it uses its overall rate): it lists first, then learns."""

_STEP_CLASSES = 4096  # distinct steps remembered; beyond that, new steps use the overall rate


@dataclass(frozen=True)
class Pick:
    """A candidate ``Claimer.pick`` chose: its sorted position, identifier, and how it was chosen."""

    position: int
    identifier: str
    step: int | None  # distance in sorted order from the previous unit of the order
    blind: bool  # attempted without a listing covering it
    token: str  # the attempt's claim token, unique to it
    stretch: bool = False  # a unit of a stretch walked after a jump


class Claimer:
    """Claims one learner's next free unit in its preference order, cheaply.

    Claims are permanent, so it remembers every unit known claimed and lists ``units/`` only
    where it has not looked yet, a page at a time. ``listing`` says when a listing comes before
    a create: ``"adaptive"`` (default: when the candidate is likely taken, judged from what it
    has seen), ``"always"`` (the seed's list, create, read back), ``"conflict"`` (after a lost
    create) or ``"never"``. The policies in full: docs/queue.md.

    Args:
        mailbox: The shared store.
        order: This learner's preference order of unit identifiers.
        learner_id: Who claims.
        worker: The DataLoader worker claiming, if any.
        listing: One of ``LISTING_POLICIES``.
        page: Keys per listing page.
        index: A ``ClaimIndex`` of the same units to share (built from ``order`` if None).

    Raises:
        ValueError: an unknown policy, ``page < 1``, or ``order`` not the index's units.

    Example:
        >>> from gradientmail.mailbox.memory import MemoryMailbox
        >>> claimer = Claimer(MemoryMailbox("doctest-claimer"), ["a", "b"], "node-0")
        >>> claimer.claim_next(), claimer.claim_next(), claimer.claim_next()
        ('a', 'b', None)
        >>> claimer.stats["claims"]
        2
    """

    def __init__(
        self,
        mailbox: Mailbox,
        order: Sequence[str],
        learner_id: str,
        *,
        worker: int | None = None,
        listing: str = DEFAULT_LISTING,
        page: int = LIST_PAGE,
        index: ClaimIndex | None = None,
    ) -> None:
        if listing not in LISTING_POLICIES:
            raise ValueError(f"listing must be one of {LISTING_POLICIES}, not {listing!r}")
        if page < 1:
            raise ValueError(f"page must be >= 1, not {page}")
        self.mailbox = mailbox
        self.learner_id = learner_id
        self.worker = worker
        self.listing = listing
        self.page = page
        if index is None:
            index = ClaimIndex(order)
        self._keys = index.keys
        self._claim_index = index
        self._order = index.order(order)
        if len(self._order) != len(self._keys):
            raise ValueError("order must hold every unit of the claim index exactly once")
        starts = order.run_starts if isinstance(order, PositionOrder) and order.index is index else None
        self._runs = OrderRuns(self._order, starts)  # skips known claims a run at a time
        self._next = 0  # position in _order of the next candidate
        self._known = bytearray(len(self._keys))  # 1: known to be claimed (by anyone)
        self._mine = bytearray(len(self._keys))  # 1: claimed by this claimer
        self._low = 0  # first sorted position not known to be claimed
        self._settled = Settled(0, -1)  # the sorted positions the latest listing settled...
        self._fresh = False  # ...which holds until the next attempt
        self._listed = False
        self._conflicted = False
        self._token: str | None = None  # the next attempt's, drawn before a listing
        # The adaptive estimate: decayed (seen, taken) counts of candidates examined without a
        # current listing, per step through the order and overall.
        self._steps: dict[int | None, tuple[float, float]] = {}
        self._seen = 0.0
        self._taken = 0.0
        self._others = False  # a listing has shown a claim that is not this claimer's
        self._losses = 0  # creates lost in a row
        self._cursor: int | None = None
        self._budget = 0
        self._crowd = 0.0
        self._seat = zlib.crc32(f"{learner_id}/{worker}".encode())  # spreads claimers after a loss
        self.stats: Counter[str] = Counter()

    def claim_next(self) -> str | None:
        """Claim and return the next free identifier in preference order, or None when none is."""
        while True:
            pick = self.pick()
            if pick is None:
                return None
            identifier = self.settle(pick, self.attempt(pick))
            if identifier is not None:
                return identifier

    # -- the three steps of a claim: several attempts may be in flight between pick and settle ----
    def pick(self) -> Pick | None:
        """Choose the next candidate (listing first if the policy says so), or None when none is.

        The candidate counts as known-claimed from here on, whoever wins it, so concurrent
        attempts (``claim_ahead.ClaimAhead``, which calls ``pick`` and ``settle`` under one
        lock and ``attempt`` outside it) never try the same unit twice.
        """
        order = self._order
        known = self._known
        adaptive = self.listing == "adaptive"
        end = len(order)
        stale = False
        while True:
            stretched = self._stretch_pick()
            if stretched is not None:
                return stretched
            index = self._runs.next_free(self._next, known)  # claimed ones: never looked at again
            self._next = index
            if index == end:
                return None
            position = order[index]
            step = position - order[index - 1] if index else None
            blind = False
            if not (self._fresh and position in self._settled):  # no listing since the last attempt settled it
                near = adaptive and self._listed and self._near_others()
                if near or self._should_list(step):
                    self._refresh(position)
                    taken = bool(known[position])
                    self._crowd += ((1.0 if taken else 0.0) - self._crowd) / CROWD_MEMORY
                    if not near:
                        self._observe(step, taken)
                    if taken:
                        self.stats["stale"] += 1
                        stale = True
                        self._next += 1
                        continue
                else:
                    self.stats["blind"] += 1
                    blind = True
            if self._losses and not blind:
                index = spread(order, known, self._settled, index, self._losses, self._seat)
                position = order[index]
                step = position - order[index - 1] if index else None
            elif stale and adaptive and self._crowd > CROWD_LIMIT:
                target = jump_target(order, known, self._settled, index)
                if target != index:
                    self.stats["jumps"] += 1
                    index = target
                    position = order[index]
                    step = position - order[index - 1] if index else None
                    self._cursor = index + 1
                    self._budget = STRETCH - 1
            return self._take(index, step, blind)

    def _take(self, index: int, step: int | None, blind: bool, stretch: bool = False) -> Pick:
        """The attempt on ``order[index]``: it counts as known-claimed from now, whoever wins."""
        if index == self._next:
            self._next += 1
        position = self._order[index]
        self.stats["attempts"] += 1
        self._fresh = False
        self._known[position] = 1
        self._advance_low()
        token, self._token = self._token or uuid.uuid4().hex, None
        return Pick(position, self._keys[position][len(CLAIMS_PREFIX) :], step, blind, token, stretch)

    def _stretch_pick(self) -> Pick | None:
        """The next unit of the stretch after a jump, listing first once per ``STRETCH`` of them.

        None when there is no stretch or it ended (a unit known claimed, a lost create, or a
        listing that found the next unit taken): ``pick`` then goes on from ``_next``.
        """
        cursor = self._cursor
        if cursor is None:
            return None
        order = self._order
        known = self._known
        if self._losses or cursor >= len(order) or known[order[cursor]]:
            self._cursor = None
            return None
        position = order[cursor]
        blind = not (self._fresh and position in self._settled)
        if blind and self._budget <= 0:
            self._refresh(position)
            if known[position]:
                self._cursor = None
                return None
            self._budget = min(STRETCH, free_run(order, known, self._settled, cursor, STRETCH))
            blind = False
        if blind:
            self.stats["blind"] += 1
            self._budget -= 1
        self._cursor = cursor + 1
        return self._take(cursor, position - order[cursor - 1] if cursor else None, blind, stretch=True)

    def attempt(self, pick: Pick) -> bool:
        """The requests of one claim (create, read back): whether this claimer won ``pick``.

        Touches no claimer state, so several may run at once.
        """
        return try_claim(self.mailbox, pick.identifier, self.learner_id, worker=self.worker, token=pick.token)

    def settle(self, pick: Pick, won: bool) -> str | None:
        """Record the outcome of an attempt; the identifier if it was won."""
        self._conflicted = not won
        self._losses = self._losses + 1 if not won else 0
        if not won:
            self.stats["conflicts"] += 1
        if not won:
            self._cursor = None
        if pick.blind and not pick.stretch:
            self._observe(pick.step, not won)
        if not won:
            return None
        self.stats["claims"] += 1
        self._mine[pick.position] = 1
        return pick.identifier

    def risk(self, step: int | None = None) -> float:
        """The estimated chance that a candidate reached by ``step`` (None: any) is taken."""
        overall = (self._taken + 0.5) / (self._seen + 1.0)
        if step is None:
            return overall
        seen, taken = self._steps.get(step, (0.0, 0.0))
        prior = max(overall, UNSEEN_RISK) if self._others else overall
        return (taken + prior) / (seen + 1.0)

    # -- internals ---------------------------------------------------------------------------
    def _should_list(self, step: int | None) -> bool:
        if self.listing == "never":
            return False
        if not self._listed or self.listing == "always" or self._conflicted:
            return True
        if self.listing == "conflict":
            return False
        return self.risk(step) > RISK_LIMIT

    def _near_others(self) -> bool:
        """Whether one of the next ``NEAR`` units in order is known claimed by someone else."""
        order = self._order
        known = self._known
        mine = self._mine
        for index in range(self._next + 1, min(len(order), self._next + 1 + NEAR)):
            position = order[index]
            if known[position] and not mine[position]:
                return True
        return False

    def _observe(self, step: int | None, taken: bool) -> None:
        keep = 1.0 - 1.0 / RISK_MEMORY
        hit = 1.0 if taken else 0.0
        self._seen = self._seen * keep + 1.0
        self._taken = self._taken * keep + hit
        counts = self._steps.get(step)
        if counts is None and len(self._steps) >= _STEP_CLASSES:
            return
        seen, took = counts or (0.0, 0.0)
        self._steps[step] = (seen * keep + 1.0, took * keep + hit)

    def _advance_low(self) -> None:
        low = self._known.find(0, self._low)
        self._low = len(self._known) if low < 0 else low

    def _refresh(self, position: int) -> None:
        if self._token is None:
            # Drawn now (os.urandom is a system call) so that nothing slow runs between what
            # the listing shows and the create that relies on it: the shorter that gap, the
            # fewer claimers that listed at the same moment create the same unit.
            self._token = uuid.uuid4().hex
        start = max(self._low, position - self.page)
        after = self._keys[start - 1] if start > 0 else None
        target = self._keys[position]
        page = self.page
        last: str | None = None
        complete = True
        pages = self._pages(after)
        try:
            for chunk in pages:
                # A page at a time: the next page is another request, made only while the
                # candidate is not yet covered.
                if self._claim_index.mark(chunk, self._known):
                    self._others = True  # new to this claimer, hence not its own
                if len(chunk) < page:
                    break
                last = chunk[-1]
                if last >= target:
                    complete = False
                    break
        finally:
            close = getattr(pages, "close", None)
            if close is not None:
                close()
        self.stats["listings"] += 1
        self._listed = True
        self._fresh = True
        if complete or last is None:
            covered = len(self._keys) - 1
        else:
            covered = self._claim_index.positions.get(last)
            if covered is None:  # not a unit's claim
                covered = bisect.bisect_right(self._keys, last) - 1
        self._settled = Settled(start, covered)
        self._advance_low()

    def _pages(self, after: str | None) -> Iterator[Sequence[str]]:
        """The claims after ``after``, ``page`` keys at a time, fetched as they are asked for.

        A mailbox that hands out its own pages of ``LIST_PAGE`` keys (``list_pages``: the
        simulator's, whose pages also say which units they name, see ``IndexedPage``) gives
        them as they are; any other's listing is cut into pages here.
        """
        list_pages = getattr(self.mailbox, "list_pages", None)
        if list_pages is not None and self.page == LIST_PAGE:
            return list_pages(CLAIMS_PREFIX, after)
        return self._chunks(after)

    def _chunks(self, after: str | None) -> Iterator[list[str]]:
        listing = self.mailbox.list(CLAIMS_PREFIX, after)
        try:
            iterator = iter(listing)
            while True:
                chunk = list(itertools.islice(iterator, self.page))
                yield chunk
                if len(chunk) < self.page:
                    return
        finally:
            close = getattr(listing, "close", None)
            if close is not None:
                close()
