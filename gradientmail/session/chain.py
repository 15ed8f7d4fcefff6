"""The run's state as a chain of versions on the store, advanced by ``put_if_absent``.

A learner folds its progress by reading the newest version ``v`` and creating ``v + 1``: exactly
one writer wins each version (compare-and-swap from the one primitive every mailbox has), and a
loser folds again onto the winner's. Old versions are tombstoned, never recreated; unusable
versions are skipped with a ``MailSkippedWarning``. Details: ``docs/session.md``.
"""

from __future__ import annotations

import itertools
import logging
import random
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from torch import Tensor

from gradientmail.errors import MailRejectedError, MailSkippedWarning, SessionError, UnusableStateError
from gradientmail.layout import SESSION_PREFIX
from gradientmail.mailbox.base import Mailbox, describe
from gradientmail.session.mail import (
    MEMBERS_PREFIX,
    STATE_PREFIX,
    Contribution,
    Spec,
    State,
    StateHeader,
    decode,
    encode,
    format_refusal,
    is_old_mail_key,
    parse_member_key,
    parse_state_key,
    read_format,
    state_key,
)

KEEP = 4
"""Versions kept behind the newest: a reader that listed an older one can usually still read it."""
RETIRE = 10_000
"""Tombstones kept behind the newest (a few bytes each), so that no version is created twice."""
MAX_BASE_AGE_S = 30.0
"""A writer whose base was read longer ago than this re-lists before writing."""
TOMBSTONE = b"gradientmail: retired version of the run's state\n"
MAX_WALK_BACK = 64
"""Unusable versions a reader skips before giving up: a bound on the reads one bad writer costs."""
MAX_CLOCK_SKEW_S = 300.0
"""How far in the future (by this node's clock) a peer's time may lie and still count as a sign
of life. Beyond it the time is not trusted: a member dated in the year 3000 stops counting."""


@dataclass(frozen=True)
class Listing:
    """One listing of ``session/``: the versions present and who is a member."""

    versions: list[int]
    members: dict[str, float]  # learner -> joined (its newest member key)
    member_keys: dict[str, list[str]]  # learner -> all its member keys
    after: int | None = None  # versions up to this one were not listed (the node holds it)

    @property
    def newest(self) -> int | None:
        return self.versions[-1] if self.versions else self.after


def list_session(mailbox: Mailbox, after: int | None = None) -> Listing:
    """List ``session/``: the versions (after ``after`` only, if given) and the members.

    A full listing (``after=None``) also refuses mail of the first Session format with a clear
    error; a listing after a known version reads the member keys and the newer versions only.
    """
    versions: list[int] = []
    members: dict[str, float] = {}
    member_keys: dict[str, list[str]] = {}
    if after is None:
        keys = mailbox.list(SESSION_PREFIX)
    else:
        keys = itertools.chain(mailbox.list(MEMBERS_PREFIX), mailbox.list(STATE_PREFIX, start_after=state_key(after)))
    for key in keys:
        version = parse_state_key(key)
        if version is not None:
            versions.append(version)
            continue
        member = parse_member_key(key)
        if member is not None:
            learner, joined = member
            members[learner] = max(joined, members.get(learner, joined))
            member_keys.setdefault(learner, []).append(key)
            continue
        if is_old_mail_key(key):
            data = mailbox.get(key)
            found = read_format(data) if data is not None else "gradientmail.session/1"
            if found is None:  # not safetensors with a format at all: junk, not another format
                skipped(
                    UnusableStateError(f"{key!r} under {SESSION_PREFIX!r} is not readable mail of any format; ignored")
                )
                continue
            raise MailRejectedError(format_refusal(key, found))
    versions.sort()
    return Listing(versions=versions, members=members, member_keys=member_keys, after=after)


def skipped(error: UnusableStateError) -> None:
    """Report a version (or file) that was skipped: a warning (and a log line), the run goes on."""
    logging.getLogger("gradientmail.session").warning("skipped: %s", error)
    warnings.warn(str(error), MailSkippedWarning, stacklevel=3)


def read_state(mailbox: Mailbox, version: int, spec: Spec) -> State | None:
    """One checked version, or None when it was retired (it is no longer among the newest).

    Raises:
        UnusableStateError: a corrupt or non-finite version (to be skipped).
        MailRejectedError: a state of another model or format (a configuration error).
    """
    key = state_key(version)
    data = mailbox.get(key)
    if data is None or data == TOMBSTONE:
        return None
    state = decode(data, key=key, spec=spec)
    if state.header.version != version:
        raise UnusableStateError(f"state {key!r} says it is version {state.header.version}")
    return state


class _Unreachable(Exception):
    """The newest version was retired between the listing and the read: list again."""


def read_usable(mailbox: Mailbox, newest: int, spec: Spec, known: State | None = None) -> State:
    """The newest usable version at or below ``newest``, skipping unusable ones with a warning.

    ``known`` (a version this node already holds, checked) ends the walk without a download.

    Raises:
        _Unreachable: ``newest`` itself is retired (newer versions exist): list again.
        MailRejectedError: every version still kept is unusable.
    """
    version = newest
    while version >= max(0, newest - MAX_WALK_BACK):
        if known is not None and known.header.version == version:
            return known
        try:
            state = read_state(mailbox, version, spec)
        except UnusableStateError as error:
            skipped(error)
            version -= 1
            continue
        if state is not None:
            return state
        if version == newest:
            raise _Unreachable
        break  # retired: nothing older is kept either
    raise MailRejectedError(
        f"{describe(mailbox)}: no usable version of the run's state at or below {state_key(newest)!r} "
        f"(the newest ones are corrupt or not finite, at most {MAX_WALK_BACK} are skipped, and older "
        "ones are retired); the run cannot "
        "continue from this prefix"
    )


def read_newest(mailbox: Mailbox, spec: Spec, *, attempts: int = 20) -> tuple[State | None, Listing]:
    """The newest usable version (None when the run has none yet) and the listing that found it."""
    for _ in range(attempts):
        listing = list_session(mailbox)
        if listing.newest is None:
            return None, listing
        try:
            return read_usable(mailbox, listing.newest, spec), listing
        except _Unreachable:
            continue  # retired between listing and reading: KEEP newer versions exist
    raise SessionError(
        f"{describe(mailbox)}: the newest state kept vanishing while being read "
        f"({attempts} listings); is something deleting {SESSION_PREFIX!r}?"
    )


def active_learners(
    listing: Listing, header: StateHeader | None, me: str, now: float, max_staleness: float
) -> set[str]:
    """Who counts in ``N``: this learner, and every member that joined or folded recently.

    A member whose last sign of life (joining, or its newest fold by its own clock) is older than
    ``max_staleness`` has stopped counting: a crashed node leaves its member key behind. A time
    more than ``MAX_CLOCK_SKEW_S`` ahead of ``now`` is no sign of life (a broken clock or a
    forged date would otherwise count forever).
    """
    learners = header.learners if header is not None else {}
    active = {me}
    for learner, joined in listing.members.items():
        entry = learners.get(learner)
        if entry is not None and entry.final and entry.time >= joined:
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


@dataclass(frozen=True)
class Fold:
    """A contribution that landed: the version it created and that version's content."""

    state: State  # the new version, as written (tensors in wire dtype)
    previous: StateHeader | None  # the header of the version it was folded onto
    conflicts: int  # versions lost to other writers before this one won
    active: int  # N: learners counted in the scale of this contribution


def fold(
    mailbox: Mailbox,
    spec: Spec,
    *,
    me: str,
    known: State | None,
    increment_for: Callable[[int], Mapping[str, Tensor]],
    entry: Callable[[StateHeader], Contribution],
    add: Callable[[Mapping[str, Tensor], Mapping[str, Tensor]], dict[str, Tensor]],
    max_staleness: float,
    deadline: float,
) -> Fold:
    """Fold this learner's contribution into the newest version, exactly once.

    Losing a version to another writer costs one read of the winner's version and one more
    attempt (after a randomized backoff), never a lost or doubled contribution.

    Args:
        mailbox: the run's store.
        spec: what a state of this model holds.
        me: this learner.
        known: the version this learner holds; not downloaded again while it is the newest.
        increment_for: the increment for ``N`` active learners.
        entry: this learner's header line, given the header of the version folded onto.
        add: the next version's tensors, as stored, from a base and an increment.
        max_staleness: seconds after which a silent member stops counting in ``N``.
        deadline: ``time.monotonic()`` past which losing again raises.

    Returns:
        The version written, what it was folded onto, the conflicts and ``N``.

    Raises:
        SessionError: past ``deadline``, or when the run's state is gone.
    """
    listing = list_session(mailbox, after=None if known is None else known.header.version)
    newest = listing.newest
    listed = time.monotonic()
    conflicts = 0
    increment: Mapping[str, Tensor] | None = None
    active = 1
    while True:
        if newest is None:
            raise SessionError(
                f"learner {me!r}: the run's state under {STATE_PREFIX!r} on "
                f"{describe(mailbox)} is gone (was the prefix deleted mid-run?)"
            )
        attempt_started = time.monotonic()
        try:
            base = read_usable(mailbox, newest, spec, known)
        except _Unreachable:  # retired since the listing: newer versions exist
            listing, listed = list_session(mailbox), time.monotonic()
            newest = listing.newest
            continue
        if increment is None:
            active_set = active_learners(listing, base.header, me, time.time(), max_staleness)
            active = len(active_set)
            increment = increment_for(active)
        # After the newest listed version, even when that one was skipped as unusable.
        header = replace(base.header.followed_by(me, entry(base.header), time.time()), version=newest + 1)
        tensors = add(base.tensors, increment)
        data = encode(tensors, header)
        if time.monotonic() - listed > MAX_BASE_AGE_S:  # stalled: the base may be long retired
            listing, listed = list_session(mailbox), time.monotonic()
            newest = listing.newest
            continue
        if mailbox.put_if_absent(state_key(header.version), data):
            _retire(mailbox, header.version)
            written = State(key=state_key(header.version), header=header, tensors=tensors)
            return Fold(state=written, previous=base.header, conflicts=conflicts, active=active)
        conflicts += 1
        if time.monotonic() > deadline:
            raise SessionError(
                f"learner {me!r}: lost {conflicts} versions in a row to other writers on "
                f"{describe(mailbox)}; too many learners exchange too often for this store "
                "(raise `every`)"
            )
        newest = header.version  # somebody else wrote it: fold onto theirs
        listed = time.monotonic()
        # Exponential backoff in units of one attempt's duration: colliding writers spread out
        # until about one at a time tries, so a busy chain costs a few reads, not one per rival.
        window = max(time.monotonic() - attempt_started, 0.001)
        time.sleep(random.uniform(0, window * 2 ** min(conflicts, 6)))


def create_base(mailbox: Mailbox, spec: Spec, tensors: Mapping[str, Tensor], me: str) -> State:
    """Version 0, the run's starting point: this learner's tensors if it is first, else the
    winner's (so every node starts from one base whatever its own initialisation)."""
    header = StateHeader(version=0, learner=me, time=time.time())
    stored = {name: tensor.to(spec[name][1]) for name, tensor in tensors.items()}
    if mailbox.put_if_absent(state_key(0), encode(stored, header)):
        return State(key=state_key(0), header=header, tensors=stored)
    state, _ = read_newest(mailbox, spec)
    if state is None:
        raise SessionError(f"{describe(mailbox)}: version 0 of the run's state exists but cannot be read")
    return state


def _retire(mailbox: Mailbox, version: int) -> None:
    """After writing ``version``: tombstone the one ``KEEP`` back, delete the one ``RETIRE`` back."""
    if version >= KEEP:
        mailbox.put(state_key(version - KEEP), TOMBSTONE)
    if version >= RETIRE:
        mailbox.delete(state_key(version - RETIRE))
