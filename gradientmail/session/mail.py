"""The run's state on the store: safetensors bytes with a small, bounded metadata header.

A *state* is the run's model (every learner's progress folded in) as safetensors tensors, one
per floating-point ``state_dict`` entry (each storage once, so tied weights travel once), kept in
float32 (or float64) whatever the model's dtype, so that many small contributions add up exactly.
Its ``__metadata__`` header says which version it is, who folded the last contribution and what
each learner has contributed so far. Nothing is ever unpickled: a state is parsed by
``safetensors`` and checked against this model's names and shapes before any tensor is used, and
its header is parsed with size and depth bounds and validated field by field.
"""

from __future__ import annotations

import json
import logging
import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

from gradientmail.errors import MailRejectedError, MailSkippedWarning, UnusableStateError
from gradientmail.fold_gate import UnitMark, unit_marks_from_json
from gradientmail.records import MAX_COUNT
from gradientmail.session.marks_store import MarksRef

FORMAT = "gradientmail.session/4"
"""Value of the ``format`` metadata field. Any other value is refused with ``MailRejectedError``."""

OLD_FORMATS = {
    "gradientmail.session/1": "gradientmail 0.1 (position mail, before fragment chains)",
    "gradientmail.session/2": "gradientmail 0.1 (one chain of whole-model versions)",
    "gradientmail.session/3": "gradientmail 0.1 (every version listing every learner's line)",
}

MAX_HEADER_BYTES = 16 * 1024 * 1024
"""Largest safetensors JSON header (or ledger) accepted: tensor entries plus lines of learners."""
RECENT_LINES = 64
"""Learners' lines a version carries at most (those absorbed since its ledger) before its writer
folds them into a new ledger: a version's header does not grow with the number of learners."""
MAX_LEARNERS = 100_000


Spec = dict[str, tuple[tuple[int, ...], "torch.dtype | None"]]
"""Name -> (shape, dtype) of every tensor a state must hold (dtype None: any floating dtype)."""


# -- the header ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Contribution:
    """What one learner has folded into the run so far (one line of a state's header).

    Attributes:
        seq: the learner's exchange count, increasing with every fold it makes.
        step: the learner's ``Session.step`` count at its last fold.
        samples: samples the learner processed in the whole run, all folded in.
        time: the learner's wall clock (unix seconds) at its last fold.
        final: True once the learner's session ended cleanly.
        units: where this fold's snapshot stood in each unit whose consumption record was not
            written yet (``gradientmail.fold_gate``): a node that continues such a unit after
            this learner died skips what the run holds (``session.folded_units``).
        marks: when those were more than ``MAX_UNIT_MARKS``, the object that holds them all
            (``units`` is then empty; ``session.marks_store``).
        marked: ``(step, samples)`` of the learner when the unit marks were taken, when earlier
            than this fold's own (rank 0 of a sharded group marks no batch that another shard
            may not hold yet, ``session.shards``): a restart continues from there.
    """

    seq: int
    step: int
    samples: int
    time: float
    final: bool = False
    units: tuple[UnitMark, ...] = ()
    marks: MarksRef | None = None
    marked: tuple[int, int] | None = None

    def to_json(self) -> list:
        line: list = [self.seq, self.step, self.samples, self.time, self.final]
        if self.units or self.marks is not None or self.marked is not None:
            line.append([list(mark) for mark in self.units])
        if self.marks is not None or self.marked is not None:
            line.append(None if self.marks is None else self.marks.to_json())
        if self.marked is not None:
            line.append(list(self.marked))
        return line

    @property
    def resumes_at(self) -> tuple[int, int]:
        """``(step, samples)`` of the learner where its unit marks stand: where a restart continues."""
        return (self.step, self.samples) if self.marked is None else self.marked

    @classmethod
    def from_json(cls, value: object, *, where: str) -> Contribution:
        if not (isinstance(value, list) and len(value) in (5, 6, 7, 8)):
            raise UnusableStateError(f"{where}: expected [seq, step, samples, time, final(, units(, marks(, marked)))]")
        seq, step, samples, time, final = value[:5]
        for name, count in (("seq", seq), ("step", step), ("samples", samples)):
            if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= MAX_COUNT:
                raise UnusableStateError(f"{where}: {name} {count!r} is not a count")
        if isinstance(time, bool) or not isinstance(time, (int, float)) or not math.isfinite(time):
            raise UnusableStateError(f"{where}: time {time!r} is not a finite number")
        if not isinstance(final, bool):
            raise UnusableStateError(f"{where}: final {final!r} is not a boolean")
        try:
            units = unit_marks_from_json(value[5], MAX_COUNT) if len(value) >= 6 else ()
            marks = MarksRef.from_json(value[6]) if len(value) >= 7 and value[6] is not None else None
        except ValueError as exc:
            raise UnusableStateError(f"{where}: {exc}") from None
        marked = None
        if len(value) == 8:
            pair = value[7]
            if not (
                isinstance(pair, list)
                and len(pair) == 2
                and all(isinstance(n, int) and not isinstance(n, bool) for n in pair)
                and 0 <= pair[0] <= step
                and 0 <= pair[1] <= samples
            ):
                raise UnusableStateError(
                    f"{where}: marked {pair!r} is not [step, samples] at most the line's ({step}, {samples})"
                )
            marked = (pair[0], pair[1])
        return cls(
            seq=seq,
            step=step,
            samples=samples,
            time=float(time),
            final=final,
            units=units,
            marks=marks,
            marked=marked,
        )


@dataclass(frozen=True)
class StateHeader:
    """What a version of one fragment says about itself (the safetensors ``__metadata__``).

    Attributes:
        version: this version's place in its fragment's chain; 0 is the base.
        learner: who wrote this version (folded contributions into the previous one).
        time: the writer's wall clock (unix seconds) when it wrote it.
        learners: ``{learner: Contribution}``, the newest contribution of each learner this
            fragment absorbed since ``ledger`` (its ``seq`` says which; older ones are absorbed
            too); without a ledger, of every learner.
        fragment: which fragment of the state this is.
        fragments: how many fragments the run's state is cut into.
        shards: how many shards the state is cut into first (``session.shards``; 1: none).
        ledger: the ledger holding every other learner's line (``Ledger``), or None.
    """

    version: int
    learner: str
    time: float
    learners: dict[str, Contribution] = field(default_factory=dict)
    fragment: int = 0
    fragments: int = 1
    shards: int = 1
    ledger: LedgerRef | None = None

    def to_metadata(self) -> dict[str, str]:
        return {
            "format": FORMAT,
            "kind": "version",
            **_cut_fields(self.fragment, self.fragments, self.shards),
            "version": str(self.version),
            "learner": self.learner,
            "time": repr(float(self.time)),
            "learners": json.dumps({k: v.to_json() for k, v in sorted(self.learners.items())}, separators=(",", ":")),
            **({} if self.ledger is None else {"ledger": f"{self.ledger.version}/{self.ledger.learner}"}),
        }

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, object], *, key: str) -> StateHeader:
        fragment, fragments, shards = _check_kind(metadata, "version", key)
        try:
            version = _count(metadata["version"], "version")
            learner = metadata["learner"]
            time = float(metadata["time"])  # type: ignore[arg-type]
            raw = metadata["learners"]
            if not isinstance(learner, str) or not isinstance(raw, str):
                raise ValueError("learner and learners must be strings")
            table = json.loads(raw)  # shallow by construction: one line of scalars (and unit marks) per learner
        except (KeyError, TypeError, ValueError, RecursionError) as exc:
            raise UnusableStateError(f"state {key!r} has an unreadable metadata header: {exc!r}") from exc
        if not math.isfinite(time):
            raise UnusableStateError(f"state {key!r} has a non-finite time {time!r}")
        ledger = None
        if "ledger" in metadata:
            ledger = LedgerRef.parse(metadata["ledger"], where=f"state {key!r}")
            if ledger.version > version:
                raise UnusableStateError(f"state {key!r} (version {version}) names a later ledger {ledger}")
        return cls(
            version=version,
            learner=learner,
            time=time,
            learners=lines_of(table, where=f"state {key!r}"),
            fragment=fragment,
            fragments=fragments,
            shards=shards,
            ledger=ledger,
        )


def lines_of(table: object, *, where: str) -> dict[str, Contribution]:
    """Checked ``{learner: Contribution}`` from parsed JSON (a header's or a ledger's table)."""
    if not isinstance(table, dict) or len(table) > MAX_LEARNERS:
        raise UnusableStateError(f"{where}: 'learners' is not a table of at most {MAX_LEARNERS}")
    learners = {}
    for name, value in table.items():
        if not name or "/" in name or name.startswith("."):
            raise UnusableStateError(f"{where}: learner id {str(name)[:80]!r} is not one key segment")
        learners[name] = Contribution.from_json(value, where=f"{where}, learner {name!r}")
    return learners


@dataclass(frozen=True)
class LedgerRef:
    """Which ledger a version's header names: the version it was written for, and by whom."""

    version: int
    learner: str

    def __str__(self) -> str:
        return f"{self.version}/{self.learner}"

    @classmethod
    def parse(cls, text: object, *, where: str) -> LedgerRef:
        version, slash, learner = str(text).partition("/")
        try:
            number = _count(version, "ledger version")
        except ValueError:
            number = -1
        if number < 0 or not slash or not learner or "/" in learner or learner.startswith(".") or len(learner) > 255:
            raise UnusableStateError(f"{where}: unreadable ledger reference {str(text)[:80]!r}")
        return cls(number, learner)


@dataclass(frozen=True)
class Ledger:
    """Every learner's line in one fragment as of one version, kept beside the chain.

    A version carries only the lines absorbed since its ledger (at most about ``RECENT_LINES``):
    whoever needs a learner's line reads the ledger once (readers keep the last one) instead of
    every version repeating one line per learner. The writer of a version whose recent lines
    would exceed ``RECENT_LINES`` writes a new ledger first and names it.

    Attributes:
        fragment, fragments: where in the run's cut.
        version: the version it was written for.
        learners: ``{learner: Contribution}`` of every learner absorbed up to ``version``.
        previous: the ledger it replaced (deleted by the writer of the next one), or None.
    """

    fragment: int
    fragments: int
    version: int
    learners: dict[str, Contribution]
    previous: LedgerRef | None = None

    def to_bytes(self) -> bytes:
        record = {
            "format": FORMAT,
            "kind": "ledger",
            "fragment": f"{self.fragment}/{self.fragments}",
            "version": self.version,
            "learners": {k: v.to_json() for k, v in sorted(self.learners.items())},
            "previous": None if self.previous is None else str(self.previous),
        }
        return json.dumps(record, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes, *, key: str, fragment: int, fragments: int, version: int) -> Ledger:
        """A checked ledger of ``version`` of fragment ``fragment``/``fragments``.

        Raises:
            MailRejectedError: a ledger of another format.
            UnusableStateError: anything else unreadable or not what the version named.
        """
        try:
            record = json.loads(data)
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            raise UnusableStateError(f"ledger {key!r} is not readable JSON") from exc
        if not isinstance(record, dict):
            raise UnusableStateError(f"ledger {key!r} is not a JSON object")
        if record.get("format") != FORMAT:
            raise MailRejectedError(format_refusal(key, record.get("format")))
        where = f"ledger {key!r}"
        if record.get("kind") != "ledger" or record.get("fragment") != f"{fragment}/{fragments}":
            raise UnusableStateError(f"{where} is not the ledger of fragment {fragment}/{fragments}")
        if record.get("version") != version:
            raise UnusableStateError(f"{where} says it is of version {str(record.get('version'))[:40]}")
        previous = record.get("previous")
        return cls(
            fragment=fragment,
            fragments=fragments,
            version=version,
            learners=lines_of(record.get("learners"), where=where),
            previous=None if previous is None else LedgerRef.parse(previous, where=where),
        )


@dataclass(frozen=True)
class PendingHeader:
    """What a pending contribution says about itself: whose it is and what it brings.

    Attributes:
        learner: who made it.
        contribution: the learner's line once this contribution is absorbed (``seq`` orders a
            learner's contributions to one fragment; they are absorbed in that order, once each).
        fragment: which fragment it adds to.
        fragments: how many fragments the run's state is cut into.
        shards: how many shards the state is cut into first (1: none).
    """

    learner: str
    contribution: Contribution
    fragment: int = 0
    fragments: int = 1
    shards: int = 1

    def to_metadata(self) -> dict[str, str]:
        return {
            "format": FORMAT,
            "kind": "pending",
            **_cut_fields(self.fragment, self.fragments, self.shards),
            "learner": self.learner,
            "contribution": json.dumps(self.contribution.to_json(), separators=(",", ":")),
        }

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, object], *, key: str) -> PendingHeader:
        fragment, fragments, shards = _check_kind(metadata, "pending", key)
        learner, raw = metadata.get("learner"), metadata.get("contribution")
        if not isinstance(learner, str) or not learner or "/" in learner or not isinstance(raw, str):
            raise UnusableStateError(f"pending contribution {key!r} has an unreadable metadata header")
        try:
            value = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            raise UnusableStateError(f"pending contribution {key!r} has an unreadable contribution") from exc
        contribution = Contribution.from_json(value, where=f"pending contribution {key!r}")
        return cls(learner=learner, contribution=contribution, fragment=fragment, fragments=fragments, shards=shards)


VOID = "void"
"""The ``kind`` of a closed pending contribution slot (``ClosedSlot``)."""


@dataclass(frozen=True)
class ClosedSlot:
    """A learner's pending contribution slot that a peer closed: it holds nothing.

    A peer that judged ``learner`` dead (its lease stood still a whole lease) and takes its units
    over reads what the run holds of them; the learner may only be frozen, between the check
    before a write and the write. The peer first creates the learner's next slot in every
    fragment (``session.folded_units.close_slots``), so such a late contribution finds its key
    taken and is never written. Readers absorb a closed slot as nothing (``VoidSlotError``).
    """

    learner: str
    seq: int
    by: str
    fragment: int = 0
    fragments: int = 1

    def to_bytes(self) -> bytes:
        """Safetensors bytes without tensors, this header in the metadata."""
        from safetensors.torch import save

        metadata = {
            "format": FORMAT,
            "kind": VOID,
            "fragment": f"{self.fragment}/{self.fragments}",
            "learner": self.learner,
            "seq": str(self.seq),
            "by": self.by,
        }
        return save({}, metadata=metadata)


class VoidSlotError(UnusableStateError):
    """A pending slot a peer closed (``ClosedSlot``): absorbed as nothing, without a warning."""


def _cut_fields(fragment: int, fragments: int, shards: int) -> dict[str, str]:
    """Where a header's fragment sits in the run's cut; ``shards`` only when the state is sharded,
    so an unsharded run's headers are as they always were."""
    fields = {"fragment": f"{fragment}/{fragments}"}
    if shards != 1:
        fields["shards"] = str(shards)
    return fields


def _check_kind(metadata: Mapping[str, object], kind: str, key: str) -> tuple[int, int, int]:
    """``(fragment, fragments, shards)`` of a header of ``kind``; refuses other formats and kinds."""
    fmt = metadata.get("format")
    if fmt != FORMAT:
        raise MailRejectedError(format_refusal(key, fmt))
    if metadata.get("kind") != kind:
        raise UnusableStateError(f"{key!r} is not a {kind} of the run's state (kind {metadata.get('kind')!r})")
    text = metadata.get("fragment")
    try:
        index, slash, count = str(text).partition("/")
        if not slash:
            raise ValueError(text)
        fragment, fragments = _count(index, "fragment"), _count(count, "fragments")
    except ValueError as exc:
        raise UnusableStateError(f"{key!r} has an unreadable fragment field {str(text)[:40]!r}") from exc
    if not 0 <= fragment < fragments:
        raise UnusableStateError(f"{key!r} says it is fragment {fragment} of {fragments}")
    text = metadata.get("shards", "1")
    try:
        shards = _count(text, "shards")
    except ValueError as exc:
        raise UnusableStateError(f"{key!r} has an unreadable shards field {str(text)[:40]!r}") from exc
    if not 1 <= shards <= fragments or fragments % shards:
        raise UnusableStateError(f"{key!r} says its {fragments} fragments are cut into {shards} shards")
    return fragment, fragments, shards


def _count(value: object, name: str) -> int:
    number = int(str(value))
    if not 0 <= number <= MAX_COUNT:
        raise ValueError(f"{name} {number} out of range")
    return number


def skipped(error: UnusableStateError) -> None:
    """Report a version or contribution that was skipped: a warning (and a log line), the run goes on."""
    logging.getLogger("gradientmail.session").warning("skipped: %s", error)
    warnings.warn(str(error), MailSkippedWarning, stacklevel=3)


def format_refusal(key: str, found: object) -> str:
    """The ``MailRejectedError`` message for a state or mail of another format."""
    if isinstance(found, str) and found in OLD_FORMATS:
        return (
            f"{key!r} holds mail of format {found!r}, written by {OLD_FORMATS[found]}; this "
            f"gradientmail reads only {FORMAT!r}: start the run in a fresh prefix (or finish it "
            "with the version that began it)"
        )
    return (
        f"{key!r} has format {found!r}, expected {FORMAT!r} (written by another version of "
        "gradientmail, or not gradientmail state at all)"
    )


@dataclass(frozen=True)
class State:
    """One checked version of one fragment: its key, header and tensors (as stored), and the
    lines of the ledger its header names (read by ``FragmentChain``; empty without one)."""

    key: str
    header: StateHeader
    tensors: dict[str, Tensor]
    ledger: Mapping[str, Contribution] = field(default_factory=dict)

    @property
    def learners(self) -> dict[str, Contribution]:
        """``{learner: Contribution}``: the newest contribution of every learner this version absorbed."""
        return {**self.ledger, **self.header.learners}

    def absorbed(self, learner: str) -> int:
        """The sequence number of ``learner``'s newest contribution in this version (-1: none)."""
        entry = self.header.learners.get(learner)
        if entry is None:
            entry = self.ledger.get(learner)
        return -1 if entry is None else entry.seq


@dataclass(frozen=True)
class Pending:
    """One checked pending contribution: its key, header and tensors (as stored)."""

    key: str
    header: PendingHeader
    tensors: dict[str, Tensor]


def encode(tensors: Mapping[str, Tensor], header: StateHeader | PendingHeader) -> bytes:
    """Safetensors bytes of CPU ``tensors`` with ``header`` in the metadata."""
    from safetensors.torch import save

    return save({name: t.contiguous() for name, t in tensors.items()}, metadata=header.to_metadata())


def metadata_of(data: bytes, key: str) -> dict[str, object]:
    """The ``__metadata__`` of safetensors bytes, read from the (bounded) header alone."""
    if len(data) < 8:
        raise UnusableStateError(f"state {key!r} is truncated ({len(data)} bytes)")
    size = int.from_bytes(data[:8], "little")
    if size > len(data) - 8 or size > MAX_HEADER_BYTES:
        raise UnusableStateError(
            f"state {key!r} is truncated or corrupt: its header claims {size} bytes, "
            f"{len(data) - 8} follow (at most {MAX_HEADER_BYTES} accepted)"
        )
    try:
        header = json.loads(bytes(data[8 : 8 + size]))
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise UnusableStateError(f"state {key!r} is corrupt: unreadable safetensors header") from exc
    metadata = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(metadata, dict):
        raise UnusableStateError(f"state {key!r} has no gradientmail metadata header")
    return metadata


def read_format(data: bytes) -> object:
    """The ``format`` field of safetensors bytes, or None when there is none (for messages)."""
    try:
        return metadata_of(data, "").get("format")
    except MailRejectedError:
        return None


def _tensors(data: bytes, *, key: str, spec: Spec | None, learner: str) -> dict[str, Tensor]:
    from safetensors.torch import load

    try:
        tensors = load(bytes(data))
    except Exception as exc:  # safetensors raises its own error types for every corruption
        raise UnusableStateError(f"state {key!r} (written by {learner!r}) is corrupt: {exc}") from exc
    if spec is not None:  # None: a reader of headers, which has no model to compare with
        check(tensors, spec, key=key, learner=learner)
    check_finite(tensors, key=key, learner=learner)
    return tensors


def _check_cut(
    fragment: int, fragments: int, shards: int, key: str, expected: tuple[int, int, int | None] | None
) -> None:
    if expected is None:
        return
    if fragments != expected[1]:
        raise MailRejectedError(
            f"{key!r}: the run's state is cut into {fragments} fragments, this node cuts it into "
            f"{expected[1]}; every node of a run must use the same model and the same `fragments`"
        )
    if expected[2] is not None and shards != expected[2]:
        raise MailRejectedError(
            f"{key!r}: the run's state is cut into {shards} shard(s), this node into {expected[2]}; "
            "every node of a run must shard the model alike (an FSDP group of the same size) or not at all"
        )
    if fragment != expected[0]:
        raise UnusableStateError(f"{key!r} says it is fragment {fragment}, expected {expected[0]}")


def decode(data: bytes, *, key: str, spec: Spec | None, fragment: tuple[int, int, int | None] | None = None) -> State:
    """Parse and check one version; raise ``MailRejectedError`` unless it fits ``spec`` exactly
    (None: any tensors, still finite).

    ``fragment`` is ``(index, count, shards)`` as this node cuts the state (None: not checked;
    shards None: any).
    """
    header = StateHeader.from_metadata(metadata_of(data, key), key=key)
    _check_cut(header.fragment, header.fragments, header.shards, key, fragment)
    return State(key=key, header=header, tensors=_tensors(data, key=key, spec=spec, learner=header.learner))


def decode_pending(
    data: bytes, *, key: str, spec: Spec | None, fragment: tuple[int, int, int | None] | None = None
) -> Pending:
    """Parse and check one pending contribution, as ``decode`` does a version.

    Raises:
        VoidSlotError: a peer closed this slot (``ClosedSlot``): it holds no contribution.
    """
    metadata = metadata_of(data, key)
    if metadata.get("format") == FORMAT and metadata.get("kind") == VOID:
        raise VoidSlotError(f"pending slot {key!r} was closed by {str(metadata.get('by'))[:80]!r}")
    header = PendingHeader.from_metadata(metadata, key=key)
    _check_cut(header.fragment, header.fragments, header.shards, key, fragment)
    return Pending(key=key, header=header, tensors=_tensors(data, key=key, spec=spec, learner=header.learner))


def all_finite(tensor: Tensor) -> bool:
    """True when ``tensor`` holds no NaN or Inf: one reduction on the usual (finite) path.

    A sum is non-finite whenever any element is (NaN and Inf propagate); a finite tensor whose
    sum overflows is caught by the exact check that follows.

    Example:
        >>> all_finite(torch.ones(3)), all_finite(torch.tensor([1.0, float("nan")]))
        (True, False)
    """
    if tensor.numel() == 0 or bool(torch.isfinite(tensor.sum())):
        return True
    return bool(torch.isfinite(tensor).all())


def check_finite(tensors: Mapping[str, Tensor], *, key: str, learner: str) -> None:
    """Raise ``UnusableStateError`` naming the first tensor holding NaN or Inf.

    One diverged (or hostile) writer's NaN would otherwise spread into every node that folds
    onto its version and into ``consensus()``.
    """
    for name, tensor in tensors.items():
        if not all_finite(tensor):
            bad = int((~torch.isfinite(tensor)).sum())
            raise UnusableStateError(
                f"state {key!r} written by learner {learner!r}: tensor {name!r} holds {bad} "
                "non-finite values (NaN or Inf); refused, the run goes on from the newest finite state"
            )


def check(tensors: Mapping[str, Tensor], spec: Spec, *, key: str, learner: str) -> None:
    """Raise ``MailRejectedError`` naming the first difference between ``tensors`` and ``spec``."""
    where = f"state {key!r} written by learner {learner!r} does not match this model"
    missing = [name for name in spec if name not in tensors]
    extra = sorted(name for name in tensors if name not in spec)
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing tensors {_names(missing)}")
        if extra:
            parts.append(f"unexpected tensors {_names(extra)}")
        raise MailRejectedError(f"{where}: {'; '.join(parts)} (a different model architecture?)")
    for name, (shape, dtype) in spec.items():
        got = tensors[name]
        if tuple(got.shape) != shape:
            raise MailRejectedError(f"{where}: tensor {name!r} has shape {tuple(got.shape)}, expected {shape}")
        if dtype is None and not got.is_floating_point():
            raise MailRejectedError(f"{where}: tensor {name!r} has dtype {got.dtype}, not a float")
        if dtype is not None and got.dtype != dtype:
            raise MailRejectedError(
                f"{where}: tensor {name!r} travels as {got.dtype}, expected {dtype} (every node "
                "of a run must use the same model dtype and wire_dtype)"
            )


def _names(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return f"[{shown}{', ...' if len(names) > limit else ''}] ({len(names)})"
