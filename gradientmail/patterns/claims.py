"""The claim protocol: which learner owns a work unit, decided by one atomic create.

Ownership of unit ``identifier`` lives at ``units/{identifier}`` (``layout.claim_key``). To claim
it, a learner creates that key with ``put_if_absent`` and a JSON body holding a fresh random
token, reads the key back, and owns the unit only if the token it reads is its own. Exactly one
creator wins because the store's create is atomic (``verify_mailbox`` refuses stores where it is
not); the read-back means a claimer never acts on a write it cannot see. Claims are permanent
for a run: a learner that dies keeps its units.

Tokens come from ``uuid4`` (``os.urandom``), never from ``random``: after ``torch.manual_seed(0)``
every node and every DataLoader worker draws the same ``random`` numbers, and two workers of one
node, or a node restarted under the same ``learner_id``, must never mistake each other's claim
for their own.

``Claimer`` walks one learner's preference order and claims the next free unit while keeping
mailbox requests per claimed unit about constant however long the run, and below the seed's
three (list, create, read back) where nodes prefer different units (see its docstring).
"""

from __future__ import annotations

import bisect
import functools
import itertools
import json
import logging
import os
import socket
import time
import uuid
import zlib
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from gradientmail.errors import InvalidKeyError, UnsafeStoreError
from gradientmail.layout import CLAIMS_PREFIX, claim_key
from gradientmail.mailbox.base import Mailbox, describe
from gradientmail.mailbox.keys import validate_key
from gradientmail.mailbox.wrappers import LIST_PAGE
from gradientmail.records import CLAIM, RecordError
from gradientmail.records import parse as parse_record

_log = logging.getLogger("gradientmail.queue")

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

SPREAD = 64
"""After a lost create, a claimer takes one of its next 16 free units (doubling with each loss
in a row, up to ``SPREAD``) rather than the first: claimers that lost the same race list at the
same moment, and would otherwise all create the same next unit again and go on losing together."""

CROWD_LIMIT = 0.9
"""``adaptive`` treats a claimer as walking in a crowd (nodes preferring the same next units, as
in the mapping's order) when more than this share of its recent listings (about the last
``CROWD_MEMORY``) found its candidate already taken: it then jumps ahead (see ``STRETCH``)."""

CROWD_MEMORY = 10
"""Roughly how many recent listings the crowd estimate remembers."""

STRETCH = 16
"""In a crowd, a claimer whose candidate was taken jumps ``STRETCH`` units past the start of
the first run of at least ``2 * STRETCH`` free units ahead in its order, then creates the units
after it blindly, up to ``STRETCH`` per listing: every jump lands at least that far past the
last claim its claimer saw, so a claimer walking its stretch does not meet one that jumped
after it started. One listing then serves about ``STRETCH`` claims instead of one."""

JUMP_WINDOW = 4096
"""How far along its order (in units) a claimer looks for a free run to jump to."""
_STEP_CLASSES = 4096  # distinct steps remembered; beyond that, new steps use the overall rate


class KeyTypeError(InvalidKeyError, TypeError):
    """A unit identifier or learner id that is not a ``str`` (also a ``TypeError``)."""


def validate_identifier(identifier: object) -> str:
    """Return ``identifier`` if ``units/{identifier}`` is a valid mailbox key, else raise.

    Raises ``KeyTypeError`` (an ``InvalidKeyError`` and a ``TypeError``) for a non-``str`` and
    ``InvalidKeyError`` for an unsafe one, naming the identifier either way.
    """
    if not isinstance(identifier, str):
        raise KeyTypeError(f"unit identifiers must be str, not {type(identifier).__name__} ({identifier!r})")
    try:
        validate_key(claim_key(identifier))
    except InvalidKeyError as exc:
        raise InvalidKeyError(f"unit identifier {identifier!r} is not a safe mailbox key: {exc}") from None
    return identifier


def validate_identifiers(identifiers: Iterable[object]) -> list[str]:
    """Validate every identifier, and refuse one that is a folder of another (``a``, ``a/b``).

    On a filesystem mailbox ``units/a`` and ``units/a/b`` cannot both exist, so such a pair could
    never both be claimed.
    """
    checked = [validate_identifier(identifier) for identifier in identifiers]
    nested = [identifier for identifier in checked if "/" in identifier]
    if nested:
        present = set(checked)
        for identifier in nested:
            parts = identifier.split("/")
            for end in range(1, len(parts)):
                parent = "/".join(parts[:end])
                if parent in present:
                    raise InvalidKeyError(
                        f"unit identifier {parent!r} is a folder of unit {identifier!r}; "
                        "on a directory mailbox both claims cannot exist, rename one"
                    )
    return checked


def validate_learner_id(learner_id: object) -> str:
    """A learner id is a non-empty ``str`` usable as one key segment (no ``/``)."""
    if not isinstance(learner_id, str):
        raise KeyTypeError(f"learner_id must be a str, not {type(learner_id).__name__} ({learner_id!r})")
    if not learner_id or "/" in learner_id:
        raise InvalidKeyError(
            f"learner_id {learner_id!r} must be a non-empty key segment without '/' "
            '(each learner gets its own mailbox prefix), e.g. f"node-{rank}"'
        )
    try:
        validate_key(learner_id)
    except InvalidKeyError as exc:
        raise InvalidKeyError(f"learner_id {learner_id!r} is not a safe mailbox key segment: {exc}") from None
    return learner_id


@functools.cache
def _hostname() -> str:
    return socket.gethostname()  # a system call: once per process, not between list and create


def claim_fields(learner_id: str, token: str, worker: int | None, **extra: Any) -> dict[str, Any]:
    """The seed's claim fields plus ``extra`` (see ``gradientmail.layout``)."""
    return {
        "learner": learner_id,
        "token": token,
        "host": _hostname(),
        "pid": os.getpid(),
        "worker": worker,
        "claimed_at": time.time(),
        **extra,
    }


def claim_body(learner_id: str, token: str, worker: int | None = None, **extra: Any) -> bytes:
    """The JSON body of a claim (fields documented in ``gradientmail.layout``)."""
    return json.dumps(claim_fields(learner_id, token, worker, **extra), separators=(",", ":")).encode()


def parse_claim(data: bytes | None) -> dict[str, Any] | None:
    """A claim body as a dict, or None when missing or not a valid claim: bounded and every
    known field checked (``records.CLAIM``; the learner is one key segment)."""
    if data is None:
        return None
    try:
        return parse_record(CLAIM, data)
    except RecordError:
        return None


def read_claim(mailbox: Mailbox, identifier: str) -> dict[str, Any] | None:
    """The claim on unit ``identifier``, or None when it is unclaimed (one ``get``)."""
    return parse_claim(mailbox.get(claim_key(validate_identifier(identifier))))


def try_claim(
    mailbox: Mailbox,
    identifier: str,
    learner_id: str,
    *,
    worker: int | None = None,
    token: str | None = None,
    **extra: Any,
) -> bool:
    """Claim one unit: create its key, read it back, and report whether the token is ours.

    False means another claimer owns it. Two requests when the create succeeds, one otherwise.
    ``token`` (default: a fresh ``uuid4``) must be unique to this attempt; ``extra`` fields
    go into the claim's body beside the seed's (the elastic queue's incarnation and state).
    """
    key = claim_key(identifier)
    if token is None:
        token = uuid.uuid4().hex
    if not mailbox.put_if_absent(key, claim_body(learner_id, token, worker, **extra)):
        return False
    data = mailbox.get(key)
    if data is None:
        store = describe(mailbox)
        raise UnsafeStoreError(
            f"{store}: the claim {key!r} was created but cannot be read back; "
            "this store does not show a write to the next read, so claims are unsafe here",
            operation="get",
            key=key,
            store=store,
        )
    claim = parse_claim(data)
    won = claim is not None and claim.get("token") == token
    if won:
        _log.debug("%s claimed unit %s%s", learner_id, identifier, "" if worker is None else f" (worker {worker})")
    return won


class ClaimIndex:
    """The claim keys of one set of units in the store's sorted order, and each key's position.

    Building it sorts every key; claimers of the same units (the nodes of a simulation, or the
    workers of one node) can share one.
    """

    def __init__(self, identifiers: Iterable[str]) -> None:
        named = sorted((claim_key(identifier), identifier) for identifier in identifiers)
        self.keys: list[str] = [key for key, _ in named]
        self.positions: dict[str, int] = {key: position for position, key in enumerate(self.keys)}
        self._by_identifier = {identifier: position for position, (_, identifier) in enumerate(named)}
        if len(self.positions) != len(self.keys):
            raise ValueError("unit identifiers must be unique")

    def __len__(self) -> int:
        return len(self.keys)

    def order(self, identifiers: Iterable[str]) -> Sequence[int]:
        """The sorted positions of ``identifiers``, in their order.

        A ``PositionOrder`` over this index gives its positions as they are: no lookup per unit
        (the simulator's thousand nodes each pass one).
        """
        if isinstance(identifiers, PositionOrder) and identifiers.index is self:
            return identifiers.positions
        return list(map(self._by_identifier.__getitem__, identifiers))


class PositionOrder(Sequence[str]):
    """A preference order held as sorted positions in a ``ClaimIndex``: identifiers on demand.

    A list of a million identifiers costs each node tens of MB and a lookup per unit to turn
    into positions; an ``array("i")`` of positions costs 4 bytes a unit. ``positions`` must be
    a permutation of ``range(len(index))`` (not checked: the caller built it from the index).
    """

    def __init__(self, index: ClaimIndex, positions: Sequence[int]) -> None:
        if len(positions) != len(index):
            raise ValueError(f"{len(positions)} positions for an index of {len(index)} units")
        self.index = index
        self.positions = positions

    def __len__(self) -> int:
        return len(self.positions)

    def __getitem__(self, item: Any) -> Any:
        keys = self.index.keys
        if isinstance(item, slice):
            return [keys[position][len(CLAIMS_PREFIX) :] for position in self.positions[item]]
        return keys[self.positions[item]][len(CLAIMS_PREFIX) :]


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

    Claims are permanent, so the claimer remembers every unit it knows to be claimed and never
    looks at them again. It lists ``units/`` only where it has not looked yet: from ``low``, the
    first claim key (in the store's sorted order) not known to be claimed, but at most ``page``
    keys before the candidate, and only until the page that covers the candidate is consumed
    (the rest of a page already paid for is kept: free knowledge). One page holds up to 1,000
    claims, so one listing settles every unit near the candidate, holes behind it included,
    and a listing never costs more than two pages however long the run.

    A claim itself costs a create and a read-back. The question is when a listing (one more
    request) must come first: what the claimer knows goes stale while its node works on a unit,
    so a candidate that no listing since its last attempt covers may have been taken meanwhile,
    and creating it blindly then fails (a conflict: one wasted request, plus the listing it then
    needs). When to list is the ``listing`` policy:

    - ``"adaptive"`` (default): list before the first attempt, after a conflict, and before a
      candidate that is likely taken, which the claimer judges from what it has seen so far:

      * one of the next ``NEAR`` units in its order is known to be claimed by someone else: it
        is catching up with another claimer (a node helping from a lane's far end meeting the
        lane's owner, or the owner reaching the units already taken there);
      * candidates reached by the same *step* through its order (the distance, in the store's
        sorted order, from the previous unit of the order) were found taken more than
        ``RISK_LIMIT`` of the time lately (a decayed count over about ``RISK_MEMORY`` of them).
        A step not seen yet counts as ``UNSEEN_RISK`` (list first, then learn) once a listing
        has shown claims of others; a claimer that has only seen its own uses its overall
        rate (50 % before anything is known).

      Otherwise it creates blindly: two requests per claim. Where each node works through
      stretches of units no other node prefers (``rotated_order(..., block=k)``) that is most
      claims; where nodes compete for the same next units (every node in the mapping's order,
      or the seed's plain rotation) every step is found contested, and it lists first. A
      claimer whose recent listings nearly all (``CROWD_LIMIT``) found its candidate taken is
      in such a crowd: it then jumps ``STRETCH`` units into the first long enough run of free
      units ahead in its order and creates the units after it blindly, listing once per
      ``STRETCH`` of them, so crowded claimers walk stretches of their own (about 2.3 requests
      per claim instead of 3, at the price of a few conflicts and of nodes drifting further
      apart in the run: about ``2 * STRETCH`` units each). A node alone never meets anyone: two.
    After a lost create it lists (every policy but ``"never"``) and then takes one of its next
    free units that listing settled (16 of them, doubling with each loss in a row, up to
    ``SPREAD``), chosen by its learner id and worker rather than the first: claimers that lost
    the same race listed at the same moment and would otherwise keep creating the same unit
    together.

    - ``"always"``: list before every attempt that no listing since the last attempt covers
      (the seed's protocol: list, create, read back).
    - ``"conflict"``: list only before the first attempt and after a conflict.
    - ``"never"``: attempt blindly (for comparison).

    ``stats`` counts ``claims``, ``attempts``, ``conflicts`` (a create that lost, or a read-back
    that showed another token), ``listings``, ``blind`` (attempts on a candidate no current
    listing covered), ``stale`` (listings that found the candidate already taken, where a
    blind attempt would have conflicted) and ``jumps`` (stretches started ahead in a crowd).
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
        self._index = index.positions
        self._order = index.order(order)
        if len(self._order) != len(self._keys):
            raise ValueError("order must hold every unit of the claim index exactly once")
        self._next = 0  # position in _order of the next candidate
        self._known = bytearray(len(self._keys))  # 1: known to be claimed (by anyone)
        self._mine = bytearray(len(self._keys))  # 1: claimed by this claimer
        self._low = 0  # first sorted position not known to be claimed
        self._covered = -1  # last sorted position the latest listing settled...
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
            index = self._next
            while index < end and known[order[index]]:
                index += 1  # claimed by someone: never looked at again
            self._next = index
            if index == end:
                return None
            position = order[index]
            step = position - order[index - 1] if index else None
            blind = False
            if not (self._fresh and position <= self._covered):  # no listing since the last attempt settled it
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
                index = self._spread(index)
                position = order[index]
                step = position - order[index - 1] if index else None
            elif stale and adaptive and self._crowd > CROWD_LIMIT:
                target = self._jump(index)
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
        blind = not (self._fresh and position <= self._covered)
        if blind and self._budget <= 0:
            self._refresh(position)
            if known[position]:
                self._cursor = None
                return None
            self._budget = min(STRETCH, self._run(cursor, STRETCH))
            blind = False
        if blind:
            self.stats["blind"] += 1
            self._budget -= 1
        self._cursor = cursor + 1
        return self._take(cursor, position - order[cursor - 1] if cursor else None, blind, stretch=True)

    def _run(self, index: int, limit: int) -> int:
        """How many units from ``order[index]`` on (at most ``limit``) the latest listing shows free."""
        order = self._order
        known = self._known
        end = min(len(order), index + limit)
        covered = self._covered
        for later in range(index, end):
            if known[order[later]] or order[later] > covered:
                return later - index
        return end - index

    def _jump(self, index: int) -> int:
        """Where to go from free candidate ``index`` in a crowd: ``STRETCH`` units into the first
        run of ``2 * STRETCH`` units the latest listing shows free (``index`` if none is near),
        leaving the start of the run to whoever is walking into it."""
        segment = self._order[index : index + JUMP_WINDOW]
        covered = self._covered
        if covered < len(self._keys) - 1:  # the listing stopped early: nothing past it is known
            segment = segment[: next((i for i, position in enumerate(segment) if position > covered), len(segment))]
        flags = bytes(map(self._known.__getitem__, segment))  # 1: known claimed
        found = flags.find(bytes(2 * STRETCH))
        return index if found < 0 else index + found + STRETCH

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

    def _spread(self, index: int) -> int:
        """One of the first free candidates from ``index`` that the latest listing settled.

        Which one depends on the claimer (its learner id and worker) and on how many creates
        it lost in a row, so claimers that lost together part, deterministically.
        """
        order = self._order
        known = self._known
        width = min(SPREAD, 8 << self._losses)
        free = []
        for later in range(index, len(order)):
            position = order[later]
            if position > self._covered:
                break
            if not known[position]:
                free.append(later)
                if len(free) == width:
                    break
            if later - index >= 4 * width:
                break  # a run of known claims: the scan stays short
        return free[zlib.crc32(self._losses.to_bytes(4, "little"), self._seat) % len(free)]

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
        index = self._index
        known = self._known
        page = self.page
        last: str | None = None
        complete = True
        listing = self.mailbox.list(CLAIMS_PREFIX, after)
        try:
            iterator = iter(listing)
            while True:
                # A page at a time: the next page is another request, made only while the
                # candidate is not yet covered.
                chunk = list(itertools.islice(iterator, page))
                for found in map(index.get, chunk):
                    if found is not None:
                        if not known[found]:
                            self._others = True  # new to this claimer, hence not its own
                        known[found] = 1
                if len(chunk) < page:
                    break
                last = chunk[-1]
                if last >= target:
                    complete = False
                    break
        finally:
            close = getattr(listing, "close", None)
            if close is not None:
                close()
        self.stats["listings"] += 1
        self._listed = True
        self._fresh = True
        if complete or last is None:
            self._covered = len(self._keys) - 1
        else:
            self._covered = bisect.bisect_right(self._keys, last) - 1
        self._advance_low()
