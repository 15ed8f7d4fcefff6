"""Which unit a learner tries next, and when it lists claims first (``Claimer``).

The claim itself is ``queue.claims.try_claim``; this module only decides where to try, keeping
mailbox requests per claimed unit about constant however long the run. Details: docs/queue.md.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import zlib
from array import array
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from gradientmail.layout import CLAIMS_PREFIX, SUMMARIES_PREFIX, SUMMARY_BODY, parse_summary_key
from gradientmail.mailbox.base import LIST_PAGE, Mailbox
from gradientmail.queue.claim_index import ClaimIndex, PositionOrder
from gradientmail.queue.claims import new_token, try_claim
from gradientmail.queue.crowd import CROWD_LIMIT, CROWD_MEMORY, STRETCH, Settled, free_run, jump_target, spread
from gradientmail.queue.order_runs import OrderRuns

__all__ = [
    "Claimer",
    "DEFAULT_LISTING",
    "LISTING_POLICIES",
    "Pick",
]


LISTING_POLICIES = ("adaptive", "always", "conflict", "never")
"""When ``Claimer`` lists claims before an attempt (see ``Claimer``); ``adaptive`` is the default."""

DEFAULT_LISTING = "adaptive"

NEAR = 3
"""``adaptive`` lists first when one of the next ``NEAR`` units in the claimer's order is known
to be claimed by someone else: it is catching up with another claimer. Where its walk goes on
past the candidate, only ``NEAR_WALK`` of them count (``Claimer._near_others``); measured with
that rule at 64 nodes: 2 lets 0.009 more creates a claim lose, 4 lists 0.05 more a claim."""

NEAR_WALK = 1
"""How many of the next units ``adaptive`` looks at (for ``NEAR``) while the claimer's walk goes
on by the same step past its candidate (measured: 2 there lists for the third unit of each
block of 4 in a lane, almost never finding it taken, 0.1 requests a claim at 64 nodes)."""

RISK_LIMIT = 0.1
"""``adaptive`` lists first when more than this share of recent candidates reached by the same
step through the claimer's order had been taken by someone else since it last looked."""

RISK_MEMORY = 32
"""Roughly how many recent candidates (per step) the ``adaptive`` estimate remembers."""

UNSEEN_RISK = 0.5
"""The risk ``adaptive`` assumes for a step it has not seen yet, once it has seen another
claimer's claims (alone, it uses its overall rate): it lists first, then learns."""

_STEP_CLASSES = 4096  # distinct steps remembered; beyond that, new steps use the overall rate

REACH_RUNS = 8
"""How many runs of its order ahead a listing tries to settle (``Claimer._reach``)."""

REACH_PAGES = 1

REACH_UNITS = 500
"""How many units of its order ahead (in at most ``REACH_RUNS`` runs) a listing tries to settle:
further ahead, the pages it would add are seldom needed before they go stale (measured: 1,000
costs 0.05 requests a claim at 256 nodes, 250 costs 0.03 at 512 and 1,024)."""
"""How far (in pages) either side of its candidate a listing tries to settle the next units."""

SUMMARY_SPAN = 2048
"""Sorted claim positions per "all claimed" summary (``layout.summary_key``): a claimer that sees
every unit of a span claimed may create the span's summary, and one listing of ``claimed/`` then
tells every other claimer that the whole span is claimed, instead of pages of claims each."""

SUMMARY_RECHECK = 8
"""Claim listings a claimer makes before it lists the summaries again for the same span."""

SUMMARY_BEHIND = 1
"""A claimer lists the summaries before listing claims only for a span at least this many spans
behind the span of the highest claim it has seen: spans near the frontier are not complete yet."""

SUMMARY_WRITERS = 16
"""About one claimer in this many creates a given span's summary when it sees the span complete
(chosen by a hash of the span and the claimer): every claimer creating every summary would cost
a create per span per node, most of them lost."""

SUMMARY_WANTED = 4
"""About one in this many when the claimer looked for that summary and found it missing."""

_log = logging.getLogger("gradientmail.queue")


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
    has seen), ``"always"`` (the design note's list, create, read back), ``"conflict"`` (after a lost
    create) or ``"never"``. The policies in full: docs/queue.md.

    Args:
        mailbox: The shared store.
        order: This learner's preference order of unit identifiers.
        learner_id: Who claims.
        worker: The DataLoader worker claiming, if any.
        listing: One of ``LISTING_POLICIES``.
        page: Keys per listing page.
        index: A ``ClaimIndex`` of the same units to share (built from ``order`` if None).
        summary_span: Units per "all claimed" summary (``SUMMARY_SPAN``); 0: neither read nor
            write summaries. Every claimer of a run must use the same (a summary of another
            size is ignored, not misread).
        crowd_limit: ``CROWD_LIMIT``, or ``SHARED_CROWD_LIMIT`` when every node walks this order.

    Raises:
        ValueError: an unknown policy, ``page < 1``, a ``summary_span`` or ``crowd_limit`` out of
            range, or ``order`` not the index's units.

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
        summary_span: int = SUMMARY_SPAN,
        crowd_limit: float = CROWD_LIMIT,
    ) -> None:
        if listing not in LISTING_POLICIES:
            raise ValueError(f"listing must be one of {LISTING_POLICIES}, not {listing!r}")
        if page < 1:
            raise ValueError(f"page must be >= 1, not {page}")
        if isinstance(summary_span, bool) or not isinstance(summary_span, int) or summary_span < 0:
            raise ValueError(f"summary_span must be an int >= 0, not {summary_span!r}")
        if isinstance(crowd_limit, bool) or not isinstance(crowd_limit, (int, float)) or not 0 < crowd_limit <= 1:
            raise ValueError(f"crowd_limit must be a share in (0, 1], not {crowd_limit!r}")
        self.mailbox = mailbox
        self.learner_id = learner_id
        self.worker = worker
        self.listing = listing
        self.crowd_limit = crowd_limit
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
        # "All claimed" summaries: which spans' summaries exist, when each was last looked for,
        # and the attempts not yet settled (a span holding one is not known complete yet).
        self._span = summary_span
        self._summaries: dict[str, int] = index.summary_keys(summary_span) if summary_span else {}
        self._summary_names = {span: key for key, span in self._summaries.items()}
        self._summarised = bytearray(len(self._summaries))
        self._looked = array("q", [-SUMMARY_RECHECK]) * len(self._summaries)
        self._wanted = bytearray(len(self._summaries))  # 1: looked for and missing
        self._pending: set[int] = set()
        self._outbox: list[int] = []  # spans whose summary is due (written by ``settle``)
        self._top = -1  # the highest sorted position a listing showed claimed
        self._warned = False

    def claim_next(self) -> str | None:
        """Claim and return the next free identifier in preference order, or None when none is."""
        while True:
            pick = self.pick()
            if pick is None:
                return None
            identifier = self.settle(pick, self.attempt(pick))
            if identifier is not None:
                return identifier

    def unclaimed(self) -> int:
        """Units not known to be claimed: at least the units really left (claims made since the
        last listing are unknown), exact right after a listing that covered the run."""
        return len(self._known) - self._known.count(1)

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
            elif stale and adaptive and self._crowd > self.crowd_limit:
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
        self._pending.add(position)
        self._advance_low()
        token, self._token = self._token or new_token(), None
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
        self._pending.discard(pick.position)  # its claim exists now, whoever won it
        if self._span:
            self._summarise(pick.position, pick.position)  # it may have been its span's last
            self._write_summaries()
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
        """Whether one of the next ``NEAR`` units in order is known claimed by someone else.

        Only the next one while the walk goes on by the same step (``NEAR_WALK``): beyond it
        lies more of the same walk, whose claims say who walks towards this claimer only once
        they reach the next unit. Where the walk ends at the candidate, the next units begin
        another walk (a lane's block, then the lanes it helps), and claims there say others
        are walking in from the far end of the one ending here: then ``NEAR`` of them count.
        """
        order = self._order
        known = self._known
        mine = self._mine
        index = self._next
        end = min(len(order), index + 1 + NEAR)
        if 0 < index < len(order) - 1 and order[index + 1] - order[index] == order[index] - order[index - 1]:
            end = index + 1 + NEAR_WALK
        for index in range(self._next + 1, end):
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
            self._token = new_token()
        if self._span and self._summarised_span(position):
            return
        floor, reach = self._reach(position)
        start = max(self._low, min(position, floor, reach - self.page + 1))
        if start < position:
            start = self._known.find(0, start, position + 1)  # what it knows needs no listing
        after = self._keys[start - 1] if start > 0 else None
        target = self._keys[reach]
        page = self.page
        last: str | None = None
        listed = start  # the last unit the listing showed claimed
        complete = True
        pages = self._pages(after)
        try:
            for chunk in pages:
                # A page at a time: the next page is another request, made only while the
                # candidate is not yet covered.
                if self._claim_index.mark(chunk, self._known):
                    self._others = True  # new to this claimer, hence not its own
                if len(chunk):
                    listed = self._claim_index.positions.get(chunk[-1], listed)
                    if listed > self._top:
                        self._top = listed
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
        if self._span:
            self._summarise(start, listed)

    def _reach(self, position: int) -> tuple[int, int]:
        """The lowest and highest positions within a page either side of ``position`` that the
        claimer's next ``REACH_UNITS`` units in order (``REACH_RUNS`` runs at most) ask about.

        A listing that spans them settles the walk's next units too; one that ends at
        ``position`` leaves them unsettled, and a claimer helping a lane (``rotated_order``: a
        group's units up from its own, then the group's start, then the group below) would list
        again for nearly every unit it passes.
        """
        order = self._order
        starts = self._runs.starts
        index = self._next
        end = len(order)
        width = REACH_PAGES * self.page
        limit = position + width - 1
        bottom = position - width + 1
        floor = reach = position
        run = bisect.bisect_right(starts, index) - 1
        budget = REACH_UNITS
        for _ in range(REACH_RUNS):
            if index >= end or budget <= 0:
                break
            stop = starts[run + 1] if run + 1 < len(starts) else end
            stop = min(stop, index + budget)
            a, b = order[index], order[stop - 1]
            low, high = (a, b) if a <= b else (b, a)
            if low <= limit and high >= reach:
                reach = min(high, limit)
            if high >= bottom and low < floor:
                floor = max(low, bottom)
            budget -= stop - index
            index = stop
            run += 1
        return floor, min(reach, len(self._keys) - 1)

    # -- "all claimed" summaries -----------------------------------------------------------
    def _summarised_span(self, position: int) -> bool:
        """Before listing claims for ``position``: list the summaries first when its span may
        have one (it lies behind the highest claim seen, and this claimer has not looked for it
        in its last ``SUMMARY_RECHECK`` claim listings), and before the claimer's first listing
        (a node that joins a run late skips what is done). True when a summary settled ``position``
        (its whole span is claimed): no claim listing then."""
        span = position // self._span
        listings = self.stats["listings"]
        if len(self._summarised) <= SUMMARY_BEHIND + 1:
            return False  # too few spans: none is ever far enough behind to be read
        if self._listed and (
            span + SUMMARY_BEHIND >= self._top // self._span or listings - self._looked[span] < SUMMARY_RECHECK
        ):
            return False
        self._looked[span] = listings
        self._read_summaries()
        if not self._summarised[span]:
            self._wanted[span] = 1  # missing: whoever finds it complete now writes it
            return False
        first = span * self._span
        self.stats["summarised"] += 1
        self._listed = True
        self._fresh = True
        self._settled = Settled(first, min(len(self._keys), first + self._span) - 1)
        return True

    def _read_summaries(self) -> None:
        """List ``claimed/`` and flag every unit of each span summarised there as claimed.

        Only keys this run's spans would have (``ClaimIndex.summary_keys``) count; any other key
        there is ignored (with one warning): a summary of another unit set or span size, or a
        garbled key. A summary's body is never read.
        """
        self.stats["summary_listings"] += 1
        known = self._known
        summarised = self._summarised
        size = self._span
        fresh = False
        try:
            keys = list(self.mailbox.list(SUMMARIES_PREFIX))
        except Exception as exc:
            self._summaries_off(exc, "listing")
            keys = []
        for key in keys:
            span = self._summaries.get(key)
            if span is None:
                self.stats["foreign_summaries"] += 1
                if not self._warned:
                    self._warned = True
                    what = "a summary of another unit set or span size" if parse_summary_key(key) else "not a summary"
                    _log.warning("%s: ignoring %r under %r: %s", self.learner_id, key, SUMMARIES_PREFIX, what)
                continue
            if summarised[span]:
                continue
            summarised[span] = 1
            first = span * size
            end = min(len(known), first + size)
            if known.count(1, first, end) != end - first:
                known[first:end] = b"\x01" * (end - first)
                fresh = True
        if fresh:
            self._others = True
            self._advance_low()

    def _summarise(self, first: int, last: int) -> None:
        """Queue the summary of each span from ``first`` to ``last`` that is now known complete:
        every unit known claimed from a listing, a summary or a settled attempt (not one still
        in flight: its create may yet fail)."""
        size = self._span
        known = self._known
        for span in range(first // size, last // size + 1):
            if self._summarised[span]:
                continue
            if zlib.crc32(span.to_bytes(4, "little"), self._seat) % (
                SUMMARY_WANTED if self._wanted[span] else SUMMARY_WRITERS
            ):
                continue  # not among the span's writers: spares a create that others make
            start = span * size
            end = min(len(known), start + size)
            if known.count(1, start, end) != end - start:
                continue
            if any(start <= position < end for position in self._pending):
                continue
            self._summarised[span] = 1
            self._outbox.append(span)

    def _write_summaries(self) -> None:
        """Create the summaries ``_summarise`` found due, after an attempt settles: never
        between a listing and the create that relies on it."""
        while self._outbox:
            span = self._outbox.pop()
            try:
                created = self.mailbox.put_if_absent(self._summary_names[span], SUMMARY_BODY)
            except Exception as exc:
                self._summaries_off(exc, "writing")
                return
            self.stats["summaries_written" if created else "summaries_lost"] += 1

    def _summaries_off(self, exc: Exception, doing: str) -> None:
        """Summaries are an optimisation: one that fails (a store refusing writes under
        ``claimed/``, a stray object named ``claimed``) is turned off for this claimer, with one
        warning, and never stops the claim that was being settled or the node."""
        self._span = 0
        self._outbox.clear()
        self.stats["summary_failures"] += 1
        _log.warning(
            "%s: %s claim summaries under %r failed (%s: %s); this claimer goes on without them "
            "(they only save listings)",
            self.learner_id,
            doing,
            SUMMARIES_PREFIX,
            type(exc).__name__,
            exc,
        )

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
