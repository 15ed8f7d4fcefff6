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
mailbox requests per claimed unit about constant however long the run (see its docstring).
"""

from __future__ import annotations

import bisect
import json
import os
import socket
import time
import uuid
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from gradientmail.errors import InvalidKeyError, UnsafeStoreError
from gradientmail.layout import CLAIMS_PREFIX, claim_key
from gradientmail.mailbox.base import Mailbox, describe
from gradientmail.mailbox.keys import validate_key
from gradientmail.mailbox.wrappers import LIST_PAGE

LISTING_POLICIES = ("adaptive", "always", "conflict", "never")
"""When ``Claimer`` lists claims before an attempt (see ``Claimer``); ``adaptive`` is the default."""

DEFAULT_LISTING = "adaptive"

QUIET_LISTINGS = 4
"""``adaptive`` stops listing after this many listings in a row revealed nobody else's claims."""


class KeyTypeError(InvalidKeyError, TypeError):
    """A unit identifier or learner id that is not a ``str`` (also a ``TypeError``)."""


def validate_identifier(identifier: object) -> str:
    """Return ``identifier`` if ``units/{identifier}`` is a valid mailbox key, else raise.

    Raises ``KeyTypeError`` (an ``InvalidKeyError`` and a ``TypeError``) for a non-``str`` and
    ``InvalidKeyError`` for an unsafe one, naming the identifier either way.
    """
    if not isinstance(identifier, str):
        raise KeyTypeError(
            f"unit identifiers must be str, not {type(identifier).__name__} ({identifier!r})"
        )
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
            "(each learner gets its own mailbox prefix), e.g. f\"node-{rank}\""
        )
    try:
        validate_key(learner_id)
    except InvalidKeyError as exc:
        raise InvalidKeyError(f"learner_id {learner_id!r} is not a safe mailbox key segment: {exc}") from None
    return learner_id


def claim_body(learner_id: str, token: str, worker: int | None = None) -> bytes:
    """The JSON body of a claim (fields documented in ``gradientmail.layout``)."""
    return json.dumps(
        {
            "learner": learner_id,
            "token": token,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "worker": worker,
            "claimed_at": time.time(),
        },
        separators=(",", ":"),
    ).encode()


def parse_claim(data: bytes | None) -> dict[str, Any] | None:
    """A claim body as a dict, or None when missing or not a claim written by GradientMail."""
    if data is None:
        return None
    try:
        claim = json.loads(data)
    except (UnicodeDecodeError, ValueError):
        return None
    return claim if isinstance(claim, dict) else None


def read_claim(mailbox: Mailbox, identifier: str) -> dict[str, Any] | None:
    """The claim on unit ``identifier``, or None when it is unclaimed (one ``get``)."""
    return parse_claim(mailbox.get(claim_key(validate_identifier(identifier))))


def try_claim(mailbox: Mailbox, identifier: str, learner_id: str, *, worker: int | None = None) -> bool:
    """Claim one unit: create its key, read it back, and report whether the token is ours.

    False means another claimer owns it. Two requests when the create succeeds, one otherwise.
    """
    key = claim_key(identifier)
    token = uuid.uuid4().hex
    if not mailbox.put_if_absent(key, claim_body(learner_id, token, worker)):
        return False
    data = mailbox.get(key)
    if data is None:
        store = describe(mailbox)
        raise UnsafeStoreError(
            f"{store}: the claim {key!r} was created but cannot be read back; "
            "this store does not show a write to the next read, so claims are unsafe here",
            operation="get", key=key, store=store,
        )
    claim = parse_claim(data)
    return claim is not None and claim.get("token") == token


class Claimer:
    """Claims one learner's next free unit in its preference order, cheaply.

    Claims are permanent, so the claimer remembers every unit it knows to be claimed and never
    looks at them again. It lists ``units/`` only where it has not looked yet: from ``low``, the
    first claim key (in the store's sorted order) not known to be claimed, but at most ``page``
    keys before the candidate, and only until the page that covers the candidate is consumed
    (the rest of a page already paid for is kept: free knowledge). One page holds up to 1,000
    claims, so one listing settles every unit near the candidate, holes behind it included,
    and a listing never costs more than two pages however long the run.

    When to list is the ``listing`` policy:

    - ``"adaptive"`` (default): the seed's protocol (list, create, read back: three requests
      per claim) while other claimers are at work, that is while one of the last
      ``QUIET_LISTINGS`` listings revealed claims by others, and after a conflict. A claimer
      that sees nobody else for that long (a single node, or the last one still claiming)
      stops listing until a create loses: two requests per claim.
    - ``"always"``: list before every attempt that no listing since the last attempt covers.
    - ``"conflict"``: list only before the first attempt and after a conflict.
    - ``"never"``: attempt blindly (for comparison).

    Skipping listings while others are active does not pay: a blind create that loses costs
    the create plus the listing it then needs, and in the simulation (``simulate.py``) 75-100 %
    of the candidates that contested claimers would have tried blindly were already taken.

    ``stats`` counts ``claims``, ``attempts``, ``conflicts`` (a create that lost, or a read-back
    that showed another token), ``listings`` and ``stale`` (listings that found the candidate
    already taken, where a blind attempt would have conflicted).
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
        self._keys = sorted(claim_key(identifier) for identifier in order)
        self._index = {key: position for position, key in enumerate(self._keys)}
        self._order = [self._index[claim_key(identifier)] for identifier in order]
        self._next = 0  # position in _order of the next candidate
        self._known = bytearray(len(self._keys))  # 1: known to be claimed (by anyone)
        self._low = 0  # first sorted position not known to be claimed
        self._covered = -1  # last sorted position the latest listing settled...
        self._fresh = False  # ...which holds until the next attempt
        self._listed = False
        self._conflicted = False
        self._quiet = 0  # consecutive listings that revealed no claim by others
        self.stats: Counter[str] = Counter()

    def claim_next(self) -> str | None:
        """Claim and return the next free identifier in preference order, or None when none is."""
        while self._next < len(self._order):
            position = self._order[self._next]
            if not self._known[position] and self._should_list(position):
                self._refresh(position)
                if self._known[position]:
                    self.stats["stale"] += 1
            if self._known[position]:
                self._next += 1
                continue
            won = self._attempt(position)
            self._next += 1
            if won:
                self.stats["claims"] += 1
                return self._keys[position][len(CLAIMS_PREFIX) :]
        return None

    # -- internals ---------------------------------------------------------------------------
    def _should_list(self, position: int) -> bool:
        if self._fresh and position <= self._covered:
            return False  # a listing made since the last attempt already settled this unit
        if self.listing == "never":
            return False
        if not self._listed or self.listing == "always":
            return True
        if self.listing == "conflict":
            return self._conflicted
        return self._conflicted or self._quiet < QUIET_LISTINGS

    def _advance_low(self) -> None:
        while self._low < len(self._known) and self._known[self._low]:
            self._low += 1

    def _refresh(self, position: int) -> None:
        start = max(self._low, position - self.page)
        after = self._keys[start - 1] if start > 0 else None
        target = self._keys[position]
        others = 0
        seen = 0
        last: str | None = None
        complete = True
        listing = self.mailbox.list(CLAIMS_PREFIX, after)
        try:
            for key in listing:
                seen += 1
                last = key
                found = self._index.get(key)
                if found is not None and not self._known[found]:
                    self._known[found] = 1
                    others += 1  # new to this claimer, hence not its own
                # Stop at the end of a page (the next page is another request) once the
                # candidate is covered.
                if seen % self.page == 0 and key >= target:
                    complete = False
                    break
        finally:
            close = getattr(listing, "close", None)
            if close is not None:
                close()
        self.stats["listings"] += 1
        self._listed = True
        self._fresh = True
        self._quiet = 0 if others else self._quiet + 1
        if complete or last is None:
            self._covered = len(self._keys) - 1
        else:
            self._covered = bisect.bisect_right(self._keys, last) - 1
        self._advance_low()

    def _attempt(self, position: int) -> bool:
        identifier = self._keys[position][len(CLAIMS_PREFIX) :]
        self.stats["attempts"] += 1
        self._fresh = False
        won = try_claim(self.mailbox, identifier, self.learner_id, worker=self.worker)
        self._conflicted = not won
        if not won:
            self.stats["conflicts"] += 1
        self._known[position] = 1
        self._advance_low()
        return won
