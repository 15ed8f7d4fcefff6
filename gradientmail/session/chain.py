"""One fragment of the run's state on the store: a chain of versions plus pending contributions.

A learner folds its contribution into fragment ``f`` by reading the newest version ``v`` and the
contributions pending beside it, and creating ``v + 1`` = ``v`` + every pending contribution +
its own with ``put_if_absent`` (group commit: one create absorbs many contributions). It first
claims ``v + 1`` (a small ``put_if_absent``); while a peer holds that claim, it does not race:
it leaves its contribution pending (a create of its own key, which nobody contends for), as
does a learner that loses the create, and the next writer of the fragment absorbs it. A claim
that stands, the chain not moving, from one of a learner's folds of the fragment to its next is
a dead peer's, and is passed over. So the folds a fragment takes per second grow with the
number of learners instead of being one whole-model compare-and-swap at a time, and losing
never stops anybody's training.

The fragment's *logical state* is its newest version plus the contributions still pending; that
is what learners and ``consensus`` read. Each contribution carries its learner's sequence number,
a version records the newest one absorbed per learner (its header those absorbed since its
ledger, the ledger every other: ``mail.Ledger``), and contributions are absorbed in order, once
each: exactly once whoever absorbs it, whenever. Old versions are tombstoned, never
recreated; unusable versions and contributions are skipped with a ``MailSkippedWarning``.
Details: ``docs/session.md``.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any, NamedTuple

import torch
from torch import Tensor

from gradientmail.errors import MailRejectedError, SessionError, UnusableStateError, ValueTooLargeError
from gradientmail.layout import (
    SESSION_PREFIX,
    fold_claim_key,
    ledger_key,
    parse_pending_key,
    parse_state_key,
    pending_key,
    pending_prefix,
    state_key,
    versions_prefix,
)
from gradientmail.mailbox.base import Mailbox, describe
from gradientmail.records import MAX_RECORD_BYTES
from gradientmail.session.fragments import to_wire, widen
from gradientmail.session.mail import (
    MAX_HEADER_BYTES,
    RECENT_LINES,
    Contribution,
    Ledger,
    LedgerRef,
    Pending,
    PendingHeader,
    Spec,
    State,
    StateHeader,
    VoidSlotError,
    decode,
    decode_pending,
    encode,
    metadata_of,
    skipped,
)
from gradientmail.session.options import retire_after_s
from gradientmail.session.overlap import parallel
from gradientmail.session.retirement import MIN_AGE_S, Retirement

KEEP = 4
"""Versions kept behind the newest: a reader that listed an older one can usually still read it."""
RETIRE = 10_000
"""Tombstones kept behind the newest (a few bytes each), so that no version is created twice."""
TOMBSTONE = b"gradientmail: retired version of the run's state\n"
MAX_WALK_BACK = 64
"""Unusable versions a reader skips before giving up: a bound on the reads one bad writer costs."""
CLOSED_SLOT_ATTEMPTS = 3
"""Pending slots a fold tries when peers closed the one it chose (``mail.ClosedSlot``)."""
STALLED_S = 30.0
"""A fold whose create lands this long after its listing checks that the chain did not move on
without it (a frozen VM, a request retried through a partition): ``RETIRE`` versions later, the
number it creates may be one the chain retired, which nobody would read."""
ABSORB = 2
"""Other learners' pending contributions a writer that holds no claim reads and absorbs per fold
(or a quarter of the backlog, if more); a claim holder absorbs up to ``MAX_ABSORBED``."""
MAX_ABSORBED = 16
"""Other learners' pending contributions one claim holder reads (all at once, beside the base)
and absorbs per fold; the rest wait for the next version. It bounds what one fold reads and how
long it takes (one transfer time each way) whatever the number of learners: past it a
fragment's chain absorbs ``MAX_ABSORBED + 1`` contributions per fold time, which sets how many
learners a fragment serves (docs/session.md, "What it costs")."""
BACKLOG_SHARE = 4
BACKLOG_WARNING = 4 * MAX_ABSORBED
"""Others' pending contributions above which, at two of a learner's folds of a fragment in a row
(not fewer at the second), the chain is falling behind: a steady chain leaves about what arrives
during one fold (17 at 256 learners on 16 fragments of a 1B model, the simulator finds)."""
READ_ATTEMPTS = 20
"""Listings a reader makes before concluding that something deletes the run's state."""


class RunCut(NamedTuple):
    """How the run's state is cut: into ``shards`` shards (``session.shards``), ``fragments`` in all."""

    fragments: int
    shards: int


def run_cut(mailbox: Mailbox) -> RunCut | None:
    """How the run's state is cut, from fragment 0's newest version header (None: the run has
    no state yet)."""
    versions = FragmentChain(mailbox, 0, 1, {}).list_versions()
    for version in reversed(versions[-MAX_WALK_BACK - 1 :]):
        key = state_key(version, 0)
        data = mailbox.get(key)
        if data is None or data == TOMBSTONE:
            continue
        try:
            header = StateHeader.from_metadata(metadata_of(data, key), key=key)
        except UnusableStateError:
            continue  # reported by the reader that walks the same versions
        return RunCut(header.fragments, header.shards)
    # No readable header: one fragment, whose reader then says what is wrong with the versions.
    return RunCut(1, 1) if versions else None


def run_fragments(mailbox: Mailbox) -> int | None:
    """How many fragments the run's state is cut into (None: the run has no state yet)."""
    found = run_cut(mailbox)
    return None if found is None else found.fragments


# -- one fragment -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class View:
    """A fragment's logical state as one reader saw it: a version plus the pending contributions.

    Attributes:
        base: the newest usable version found.
        absorbed: the pending contributions that follow it (in each learner's order), checked.
        empty: keys of pending contributions that were unusable: absorbed as nothing.
        garbage: keys of pending contributions ``base`` had already absorbed (left by a writer
            that stopped before deleting them).
        newest: the newest version number listed (``base``'s, unless newer ones were unusable).
    """

    base: State
    absorbed: list[Pending]
    empty: list[tuple[str, str, int]]  # (key, learner, seq)
    garbage: list[str]
    newest: int
    listed: float = 0.0
    """When the listing behind this view was made (``time.monotonic()``)."""
    claimed: bool | None = None
    """Whether this learner holds the claim to fold the next version (None: it did not ask).
    False: another learner is folding it, and this learner's contribution waits for the next."""

    @cached_property
    def table(self) -> Mapping[str, Contribution]:
        """Each learner's newest contribution in this logical state (built once; not to be changed)."""
        table = self.base.learners
        for pending in self.absorbed:
            table[pending.header.learner] = pending.header.contribution
        for _, learner, seq in self.empty:
            old = table.get(learner)
            table[learner] = replace(old, seq=seq) if old is not None else Contribution(seq, 0, 0, 0.0)
        return table

    @property
    def learners(self) -> dict[str, Contribution]:
        """Each learner's newest contribution in this logical state (a copy to change)."""
        return dict(self.table)

    def seq_of(self, learner: str) -> int:
        """``learner``'s newest sequence number in this logical state (-1: none)."""
        entry = self.table.get(learner)
        return -1 if entry is None else entry.seq


@dataclass(frozen=True)
class Folded:
    """What one fold did: the logical state it leaves this learner with.

    Attributes:
        tensors: the fragment's values after this fold (as summed, float32/float64).
        learners: each learner's newest contribution in them.
        version: the version written (None: this contribution was left pending).
        base: the newest version read.
        conflicts: 1 when another writer created the version first, else 0.
    """

    tensors: dict[str, Tensor]
    learners: dict[str, Contribution]
    version: int | None
    base: State
    conflicts: int


class FragmentChain:
    """Fragment ``index`` of ``count`` on ``mailbox``: read its logical state, fold into it.

    Args:
        mailbox: the run's store.
        index: which fragment.
        count: how many fragments the run's state is cut into (checked in every header).
        spec: what its versions and contributions hold (dtype None: any floating dtype; None:
            any tensors, for a reader that wants the headers and has no model).
        wire_dtype: the dtype written versions and contributions are stored in (None: as summed).
        shards: how many shards the state is cut into first (checked in every header; None:
            any, for a reader of headers).
    """

    def __init__(
        self,
        mailbox: Mailbox,
        index: int,
        count: int,
        spec: Spec | None,
        *,
        wire_dtype: torch.dtype | None = None,
        shards: int | None = 1,
    ) -> None:
        self.mailbox = mailbox
        self.index = index
        self.count = count
        self.shards = shards
        self.spec = spec
        self.wire_dtype = wire_dtype
        # Retiring only what a download proved superseded (see ``_clean_up``):
        self._retirement = Retirement(KEEP, retire_after_s(MIN_AGE_S))
        self._reused = 0  # folds built on a version held in memory since the last download
        self._ledger: tuple[LedgerRef, Ledger] | None = None  # the last ledger read or written
        self._blocked: int | None = None  # the newest version when a peer's claim last stood in the way
        self._backlog = 0  # others' pending contributions seen at this learner's previous fold
        self._backlog_warned = False

    def __repr__(self) -> str:
        return f"FragmentChain({self.index}/{self.count} on {describe(self.mailbox)})"

    # -- listing and reading -----------------------------------------------------------------
    def list_versions(self, after: int | None = None) -> list[int]:
        """The version numbers present (after ``after`` only, if given), ascending."""
        prefix = versions_prefix(self.index)
        start = None if after is None else state_key(after, self.index)
        found = (parse_state_key(key, self.index) for key in self.mailbox.list(prefix, start_after=start))
        versions = sorted(v for v in found if v is not None)
        if versions:
            self._retirement.sighted(versions[-1])
        return versions

    def list_pending(self) -> dict[str, dict[int, str]]:
        """``{learner: {seq: key}}`` of the contributions waiting beside the versions."""
        pending: dict[str, dict[int, str]] = {}
        for key in self.mailbox.list(pending_prefix(self.index)):
            parsed = parse_pending_key(key, self.index)
            if parsed is not None:
                pending.setdefault(parsed[0], {})[parsed[1]] = key
        return pending

    def read_version(self, version: int) -> State | None:
        """One checked version with its ledger's lines, or None when it (or its ledger) was
        retired (or never written).

        Raises:
            UnusableStateError: a corrupt or non-finite version (to be skipped).
            MailRejectedError: a version of another model, cut or format (a configuration error).
        """
        key = state_key(version, self.index)
        data = self.mailbox.get(key)
        if data is None or data == TOMBSTONE:
            return None
        state = decode(data, key=key, spec=self.spec, fragment=(self.index, self.count, self.shards))
        if state.header.version != version:
            raise UnusableStateError(f"state {key!r} says it is version {state.header.version}")
        if state.header.ledger is None:
            return state
        ledger = self.read_ledger(state.header.ledger)
        return None if ledger is None else replace(state, ledger=ledger.learners)

    def read_ledger(self, ref: LedgerRef) -> Ledger | None:
        """The checked ledger ``ref`` names (the last one is kept: read once per ledger), or None
        when it was deleted (the versions that name it are being retired).

        Raises:
            UnusableStateError: an unreadable, oversized or mismatched ledger (its version is skipped).
        """
        held = self._ledger
        if held is not None and held[0] == ref:
            return held[1]
        key = ledger_key(self.index, ref.version, ref.learner)
        try:
            data = self.mailbox.get(key, max_bytes=MAX_HEADER_BYTES)
        except ValueTooLargeError:
            raise UnusableStateError(f"ledger {key!r} is larger than {MAX_HEADER_BYTES} bytes") from None
        if data is None:
            return None
        ledger = Ledger.from_bytes(data, key=key, fragment=self.index, fragments=self.count, version=ref.version)
        self._ledger = (ref, ledger)
        return ledger

    def read_usable(self, newest: int, known: State | None = None) -> State | None:
        """The newest usable version at or below ``newest``, skipping unusable ones with a warning.

        ``known`` (a version this node already holds, checked) ends the walk without a download.
        Returns None when ``newest`` itself is retired (newer versions exist: list again).

        Raises:
            MailRejectedError: every version still kept is unusable.
        """
        version = newest
        while version >= max(0, newest - MAX_WALK_BACK):
            if known is not None and known.header.version == version:
                return known
            try:
                state = self.read_version(version)
            except UnusableStateError as error:
                skipped(error)
                version -= 1
                continue
            if state is not None:
                self._retirement.downloaded(version)
                return state
            if version == newest:
                return None
            break  # retired: nothing older is kept either
        raise MailRejectedError(
            f"{describe(self.mailbox)}: no usable version of the run's state at or below "
            f"{state_key(newest, self.index)!r} (the newest ones are corrupt or not finite, at most "
            f"{MAX_WALK_BACK} are skipped, and older ones are retired); the run cannot continue from this prefix"
        )

    def _read_pending(self, key: str) -> Pending | UnusableStateError | None:
        data = self.mailbox.get(key)
        if data is None:
            return None
        try:
            return decode_pending(data, key=key, spec=self.spec, fragment=(self.index, self.count, self.shards))
        except UnusableStateError as error:
            return error

    def view(
        self,
        known: State | None = None,
        *,
        exact: bool = False,
        absorb: int | None = None,
        me: str | None = None,
        claim: bool = False,
    ) -> View | None:
        """The fragment's logical state (None when the run has no version of it yet).

        ``known`` is a version this node holds (not downloaded again while it is the newest).
        A pending contribution that vanishes between listing and reading was absorbed by a newer
        version: an ``exact`` reader (``consensus``) then reads again; a learner's view may lag.
        ``absorb`` bounds the other learners' pending contributions read (``me``'s are always
        read): a writer takes that many, chosen at random, or a quarter of the backlog when that
        is more; the rest wait for the next writer. None reads every one, 0 only ``me``'s.
        ``claim`` (a writer, ``me``): first claim the next version (``fold_claim_key``). Holding it,
        ``me`` reads the pending contributions (up to ``MAX_ABSORBED``) beside the base, to fold
        them; when a peer holds it, only
        ``me``'s own (``View.claimed`` False: leave the contribution pending). A claim that
        still stands at ``me``'s next fold of this fragment, the chain not having moved since,
        is a dead or stalled peer's: ``me`` folds as if it held it.

        Raises:
            SessionError: the state kept vanishing for ``READ_ATTEMPTS`` listings.
            MailRejectedError: as ``read_usable``.
        """
        floor = None if known is None else max(0, known.header.version - MAX_WALK_BACK)
        if self._reused >= KEEP:  # download the base now and then: what this node wrote may
            known = None  # not be what the store holds (an upload cut short on the way)
        for _ in range(READ_ATTEMPTS):
            after = floor if known is None else known.header.version
            listed = time.monotonic()
            versions, pending = parallel(
                lambda read: read(), [lambda after=after: self.list_versions(after), self.list_pending]
            )
            newest = versions[-1] if versions else after
            if newest is None:
                return None
            view = self._assemble(
                newest, known, pending, exact=exact, absorb=absorb, me=me, listed=listed, claim=claim and me is not None
            )
            if view is not None:
                return view
            known = None  # retired or absorbed under us: list again from the start
        raise SessionError(
            f"{describe(self.mailbox)}: the newest state of fragment {self.index} kept vanishing while "
            f"being read ({READ_ATTEMPTS} listings); is something deleting {SESSION_PREFIX!r}?"
        )

    def _assemble(
        self,
        newest: int,
        known: State | None,
        pending: Mapping[str, Mapping[int, str]],
        *,
        exact: bool,
        absorb: int | None,
        me: str | None,
        listed: float,
        claim: bool = False,
    ) -> View | None:
        # The base and the contributions it may not have absorbed yet, read in parallel: those
        # ``known`` already absorbed are not fetched (a newer base may have absorbed more).
        candidates = {
            learner: [seqs[seq] for seq in sorted(seqs) if known is None or seq > known.absorbed(learner)]
            for learner, seqs in pending.items()
        }
        wanted = candidates.pop(me, []) if me is not None else []
        others = [learner for learner, keys in candidates.items() if keys]
        if claim:  # others' contributions are read once the claim is known to be this learner's
            pass
        elif absorb is None:
            wanted += [key for learner in others for key in candidates[learner]]
        elif absorb > 0:  # a bounded share, at random: every pending contribution is soon some writer's pick
            budget = max(absorb, math.ceil(sum(len(candidates[learner]) for learner in others) / BACKLOG_SHARE))
            random.shuffle(others)
            for learner in others:
                if budget <= 0:
                    break
                wanted += candidates[learner][:budget]
                budget -= len(candidates[learner][:budget])
        rest = self._absorbable(candidates, others) if claim else []
        if claim:
            self._watch_backlog(sum(len(candidates[learner]) for learner in others))

        def claim_then_read() -> tuple[bool, list[Any]]:
            # The others' contributions are read as soon as the claim is known to be this
            # learner's, beside the base's download: a claim holder's fold costs one transfer
            # time for its reads, not two.
            assert me is not None
            won = self.mailbox.put_if_absent(fold_claim_key(self.index, newest + 1), me.encode())
            if not won and self._blocked == newest:
                won = True  # it stood since this learner's previous fold: a dead or stalled peer's
            return won, parallel(self._read_pending, rest, lanes=MAX_ABSORBED) if won else []

        jobs: list[Callable[[], Any]] = [lambda: self.read_usable(newest, known)]
        jobs += [lambda key=key: self._read_pending(key) for key in wanted]
        if claim:
            jobs.append(claim_then_read)
        results = parallel(lambda job: job(), jobs)
        base, contents = results[0], dict(zip(wanted, results[1 : 1 + len(wanted)]))
        claimed = None
        if claim:
            claimed, read = results[-1]
            self._blocked = None if claimed else newest
            if claimed:  # this learner folds the next version: the contributions pending go in
                contents.update(zip(rest, read))
        if base is None:
            return None
        self._reused = self._reused + 1 if base is known else 0
        absorbed: list[Pending] = []
        empty: list[tuple[str, str, int]] = []
        garbage: list[str] = []
        for learner, seqs in pending.items():
            seq = base.absorbed(learner)
            garbage += [key for s, key in seqs.items() if s <= seq]
            while (key := seqs.get(seq + 1)) is not None and key in contents:
                content = contents[key]
                if content is None:  # absorbed by a newer version since the listing
                    if exact:
                        return None
                    break
                if isinstance(content, UnusableStateError):
                    if not isinstance(content, VoidSlotError):  # a closed slot is no fault
                        skipped(content)
                    empty.append((key, learner, seq + 1))
                elif content.header.learner != learner or content.header.contribution.seq != seq + 1:
                    skipped(UnusableStateError(f"pending contribution {key!r} says it is another learner's or seq"))
                    empty.append((key, learner, seq + 1))
                else:
                    absorbed.append(content)
                seq += 1
        return View(
            base=base,
            absorbed=absorbed,
            empty=empty,
            garbage=garbage,
            newest=newest,
            listed=listed,
            claimed=claimed,
        )

    def _watch_backlog(self, backlog: int) -> None:
        """Warn (once) when others' pending contributions are above ``BACKLOG_WARNING`` at two of
        this learner's folds of the fragment in a row, and not fewer at the second: its chain
        absorbs fewer than the learners contribute, and their progress reaches the others later
        and later (a burst, such as everyone's last fold at once, is gone by the next fold)."""
        before, self._backlog = self._backlog, backlog
        if self._backlog_warned or not BACKLOG_WARNING < before <= backlog:
            return
        self._backlog_warned = True
        logging.getLogger("gradientmail.session").warning(
            "fragment %d of %d: %d contributions of other learners wait to be folded, and more "
            "than at this learner's previous fold of it (%d): a fold absorbs at most %d, so this "
            "fragment's chain folds more slowly than the learners contribute and their progress "
            "reaches the others later and later. Start the run with more fragments "
            "(Session(fragments=...): docs/session.md, 'How many nodes a fragment serves')",
            self.index,
            self.count,
            backlog,
            before,
            MAX_ABSORBED + 1,
        )

    @staticmethod
    def _absorbable(candidates: Mapping[str, list[str]], others: list[str]) -> list[str]:
        """The pending contributions a claim holder reads: every one, up to ``MAX_ABSORBED``
        (each learner's in order, learners at random: every one is soon some holder's pick)."""
        if sum(len(candidates[learner]) for learner in others) <= MAX_ABSORBED:
            return [key for learner in others for key in candidates[learner]]
        chosen: list[str] = []
        for learner in random.sample(others, len(others)):
            chosen += candidates[learner][: MAX_ABSORBED - len(chosen)]
            if len(chosen) == MAX_ABSORBED:
                break
        return chosen

    # -- writing ---------------------------------------------------------------------------------
    def create_base(self, tensors: Mapping[str, Tensor], me: str) -> State:
        """Version 0: this learner's tensors if it is first, else the winner's."""
        header = StateHeader(
            version=0, learner=me, time=time.time(), fragment=self.index, fragments=self.count, shards=self.shards or 1
        )
        key = state_key(0, self.index)
        spec = self.spec or {}  # a writer always has a spec
        stored = {name: tensor.to(spec[name][1] or tensor.dtype) for name, tensor in tensors.items()}
        if self.mailbox.put_if_absent(key, encode(stored, header)):
            return State(key=key, header=header, tensors=stored)
        view = self.view()
        if view is None:
            raise SessionError(
                f"{describe(self.mailbox)}: version 0 of fragment {self.index} exists but cannot be read"
            )
        return view.base

    def fold(
        self,
        view: View,
        me: str,
        contribution: Mapping[str, Tensor],
        entry: Contribution,
        *,
        before_create: Callable[[float], None] | None = None,
    ) -> Folded:
        """Fold ``contribution`` (this learner's, ``entry.seq``) into the fragment, exactly once.

        Creates the version after ``view.newest`` holding the base, every contribution in
        ``view`` and this one. If another writer created it first, the contribution is left
        pending instead, for the next writer to absorb: never folded again, never lost.

        Args:
            view: the logical state just read (``view()``).
            me: this learner.
            contribution: what to add, in the summing dtype (float32 or float64).
            entry: this learner's line once it is absorbed.
            before_create: called with ``view.listed`` just before each write (the create, and
                the pending contribution after a lost race); it may raise to fold nothing (a
                process frozen meanwhile whose units were taken over).

        Raises:
            SessionError: this learner's contribution ``entry.seq`` exists already (two
                processes under one learner id).
        """
        summed = widen(view.base.tensors)
        for increment in [p.tensors for p in view.absorbed] + [contribution]:
            for name, value in increment.items():
                summed[name] += value.to(summed[name].dtype)
        learners = view.learners
        learners[me] = entry
        if view.claimed is False:  # a peer is folding the next version: no race, no upload lost
            return self._leave_pending(view, me, contribution, entry, summed, learners, before_create, lost=0)
        version = view.newest + 1
        recent, ledger = self._recent(view, learners, me, version)
        header = StateHeader(
            version=version,
            learner=me,
            time=time.time(),
            learners=recent,
            fragment=self.index,
            fragments=self.count,
            shards=self.shards or 1,
            ledger=view.base.header.ledger if ledger is None else LedgerRef(version, me),
        )
        key = state_key(header.version, self.index)
        stored = {name: to_wire(value, self.wire_dtype) for name, value in summed.items()}
        data = encode(stored, header)  # before the check: the window from check to create stays short
        if ledger is not None:  # named by the version: written first
            self.mailbox.put(ledger_key(self.index, version, me), ledger.to_bytes())
        if before_create is not None:
            before_create(view.listed)
        created = self.mailbox.put_if_absent(key, data)
        if created and time.monotonic() - view.listed > STALLED_S and self._orphaned(header.version, me, entry.seq):
            # Created after the chain had moved on and retired that number: nobody will read it.
            self.mailbox.delete(key)
            created = False
        if ledger is not None and not created:
            self._drop_ledger(LedgerRef(version, me))  # nobody names it
        if created:
            lines = view.base.ledger if ledger is None else ledger.learners
            written = State(key=key, header=header, tensors=stored, ledger=lines)
            done = [p.key for p in view.absorbed] + [k for k, _, _ in view.empty] + view.garbage
            if ledger is not None:
                if ledger.previous is not None:  # the one before it is named by retired versions only
                    done += self._older_ledger(ledger.previous)
                self._ledger = (LedgerRef(version, me), ledger)
            self._clean_up(done, header.version)
            # As stored (wire dtype rounded) is what the run holds; without a wire dtype, that is ``summed``.
            held = summed if self.wire_dtype is None else widen(stored)
            return Folded(held, learners, header.version, written, 0)
        if view.claimed:  # the version exists (or the create was refused): nobody else holds it
            self._drop(fold_claim_key(self.index, version))
        return self._leave_pending(view, me, contribution, entry, summed, learners, before_create, lost=1)

    def _leave_pending(
        self,
        view: View,
        me: str,
        contribution: Mapping[str, Tensor],
        entry: Contribution,
        summed: dict[str, Tensor],
        learners: dict[str, Contribution],
        before_create: Callable[[float], None] | None,
        *,
        lost: int,
    ) -> Folded:
        """Leave this contribution pending, for the next writer to absorb (``lost``: 1 after a
        lost race, 0 when a peer's claim stood in the way)."""
        # Only this learner writes its key, unless a peer that judged it dead closed the slot
        # (``mail.ClosedSlot``).
        wire = {name: to_wire(value, self.wire_dtype) for name, value in contribution.items()}
        for _ in range(CLOSED_SLOT_ATTEMPTS):
            pending = PendingHeader(
                learner=me, contribution=entry, fragment=self.index, fragments=self.count, shards=self.shards or 1
            )
            own = pending_key(self.index, me, entry.seq)
            data = encode(wire, pending)
            if before_create is not None:  # again: the process may have been frozen inside the create
                before_create(view.listed)
            # Read back (only on this path, after a lost race): a peer's closure that landed
            # instead, on a store that told both writers they won, is a closed slot, and this
            # contribution goes to the next one.
            if self.mailbox.put_if_absent(own, data) and not self._closed_instead(own, data):
                learners[me] = entry
                return Folded(summed, learners, None, view.base, lost)
            if not isinstance(self._read_pending(own), VoidSlotError):
                raise SessionError(
                    f"learner {me!r}: its contribution {own!r} already exists; two processes run under "
                    "one learner id (give each process its own)"
                )
            # Closed by a peer that judged this learner dead: ``before_create`` raises when this
            # process's lease was fenced and the fold holds batches not recorded; else the next
            # slot is this fold's (a restart that read the state before the slot was closed, or a
            # fold that holds nothing the peer trains again).
            entry = replace(entry, seq=entry.seq + 1)
        raise SessionError(
            f"learner {me!r}: its pending contribution slots of fragment {self.index} were closed "
            f"{CLOSED_SLOT_ATTEMPTS} times in a row by peers that judged it dead"
        )

    def _recent(
        self, view: View, learners: dict[str, Contribution], me: str, version: int
    ) -> tuple[dict[str, Contribution], Ledger | None]:
        """The lines version ``version`` carries, and the ledger to write first (None: none).

        A version carries the lines absorbed since its base's ledger; once they would be more than
        ``RECENT_LINES`` (and the ledger is more than ``KEEP`` versions old, so that the versions
        readers may still read keep theirs), every line goes to a new ledger and the version
        carries none.
        """
        recent = dict(view.base.header.learners)
        for pending in view.absorbed:
            recent[pending.header.learner] = learners[pending.header.learner]
        for _, learner, _ in view.empty:
            recent[learner] = learners[learner]
        recent[me] = learners[me]
        named = view.base.header.ledger
        if len(recent) <= RECENT_LINES or (named is not None and version - named.version <= KEEP):
            return recent, None
        return {}, Ledger(self.index, self.count, version, dict(learners), previous=named)

    def _older_ledger(self, ref: LedgerRef) -> list[str]:
        """The key of the ledger before ``ref`` (that ``ref``'s own ledger replaced), if known."""
        held = self._ledger
        before = held[1].previous if held is not None and held[0] == ref else None
        return [] if before is None else [ledger_key(self.index, before.version, before.learner)]

    def _drop_ledger(self, ref: LedgerRef) -> None:
        self._drop(ledger_key(self.index, ref.version, ref.learner))

    def _drop(self, key: str) -> None:
        try:
            self.mailbox.delete(key)
        except Exception as exc:  # best effort: an unnamed ledger is never read, a spent claim never read again
            logging.getLogger("gradientmail.session").warning("fragment %d: %r left: %r", self.index, key, exc)

    def _closed_instead(self, key: str, data: bytes) -> bool:
        """Whether this learner's pending slot ``key``, which it was just told it created with
        ``data``, holds a peer's closure instead (a store that told both writers they won).

        Only this learner and a closing peer write the key, and a closure is record-sized: the
        read-back is bounded by that. A missing key was ours, already absorbed by a peer's fold.
        """
        try:
            stored = self.mailbox.get(key, max_bytes=min(len(data), MAX_RECORD_BYTES))
        except ValueTooLargeError:
            return False  # larger than any closure: this learner's own contribution
        return stored is not None and stored != data

    def _orphaned(self, version: int, me: str, seq: int) -> bool:
        """Whether ``version``, just created by ``me`` with contribution ``seq``, is off the chain.

        A version created long after its base was listed may reuse a number the chain retired
        meanwhile: newer versions then exist that do not hold ``me``'s contribution (every version
        built on this one would). On doubt (the newest is unreadable) it counts as on the chain.
        """
        newer = self.list_versions(after=version)
        if not newer:
            return False
        try:
            newest = self.read_usable(newer[-1])
        except (UnusableStateError, MailRejectedError):
            return False
        return newest is not None and newest.header.version > version and newest.absorbed(me) < seq

    def _clean_up(self, absorbed: list[str], version: int) -> None:
        """After writing ``version``: delete what it absorbed, and retire what is due
        (``session.retirement``: tombstones; the version ``RETIRE`` behind each is deleted).

        Best effort: the fold has landed, and whatever is left (absorbed contributions, an old
        version still readable) is harmless.
        """
        jobs: list[Callable[[], None]] = [lambda key=key: self.mailbox.delete(key) for key in absorbed]
        self._retire(self._retirement.wrote(version), jobs, f"after version {version}")

    def settle(self, newest: int) -> None:
        """At this learner's last fold: pay the retirements it owes (``session.retirement``), which
        wait for a version it *downloaded* and would otherwise be left to nobody. One download of
        the newest version (listed from ``newest``, the last this node saw), only when owed."""
        if self._retirement.owes:
            try:
                versions = self.list_versions(after=newest - 1 if newest > 0 else None)
                if versions:
                    self.read_usable(versions[-1])
            except Exception as exc:  # best effort, as all clean-up
                logging.getLogger("gradientmail.session").warning("fragment %d: old versions left: %r", self.index, exc)
                return
            self._retire(self._retirement.due(), [], "at the last fold")

    def _retire(self, versions: list[int], jobs: list[Callable[[], None]], when: str) -> None:
        """Run ``jobs``, tombstone each of ``versions`` and delete the one ``RETIRE`` behind each,
        and the claim of each: kept until then, so that a learner whose listing predates the
        version finds it claimed and leaves its contribution pending instead of racing."""
        for old in versions:
            jobs.append(lambda old=old: self.mailbox.delete(fold_claim_key(self.index, old)))
            jobs.append(lambda old=old: self.mailbox.put(state_key(old, self.index), TOMBSTONE))
            if old >= RETIRE - KEEP:  # tombstones are kept RETIRE versions behind the newest
                jobs.append(lambda old=old: self.mailbox.delete(state_key(old - (RETIRE - KEEP), self.index)))
        try:
            parallel(lambda job: job(), jobs)
        except Exception as exc:  # the contribution is in; a later writer cleans up
            logging.getLogger("gradientmail.session").warning(
                "fragment %d: cleaning up %s failed (left for a later writer): %r", self.index, when, exc
            )
