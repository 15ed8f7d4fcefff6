"""The JSON records on the store: each one's schema, bounded parsing, and typed writer and reader.

Every JSON record the library writes has one class here (``ClaimRecord``, ``WorkRecord``,
``DoneRecord``, ``LeaseRecord``, ``PresenceRecord``, ``RunRecord``, ``MemberRecord``,
``ProgressRecord``): its ``new(...)`` builds a body to write, ``from_bytes`` (or ``read``)
reads one back, bounded and checked, and typed properties say what the fields mean. The keys they live under are in
``gradientmail.layout``. The Session's tensor records (state and pending contributions) are
safetensors with a bounded JSON header, typed by ``session.mail.StateHeader`` and
``PendingHeader`` beside their encoding, which needs torch: this bottom layer does not.

Anyone who can write the mailbox prefix can put anything under it, and a broken writer (a disk
that filled up, a foreign tool) can too, so every record a node or ``gradientmail status``
reads is untrusted input. ``parse`` refuses, with a ``RecordError`` that names the key and the
problem, a record that is

- larger than ``MAX_RECORD_BYTES`` (records are a few hundred bytes),
- nested deeper than ``MAX_DEPTH`` (checked *before* ``json.loads``, whose recursion a few
  thousand ``[`` would otherwise exhaust: ``RecursionError``),
- not a JSON object, or holding ``NaN`` / ``Infinity`` (not JSON),
- holding a known field of the wrong type or out of range: a learner that is not one key
  segment (``".."``, ``"a/b"``: it would address another learner's keys), a count that is not
  an ``int`` in ``[0, MAX_COUNT]``, a time that is not a finite unix time between 1970 and
  9999, a state outside its few values.

Code reads only what is checked. A record class exposes the fields its ``RecordKind`` declares,
each with its check, and nothing else: a typed ``Field`` of an undeclared name fails when the class
is defined, and ``get``, ``[]``, ``to_dict`` and ``replace`` refuse an undeclared name
(``UndeclaredFieldError``). Unknown fields (a newer writer's, or junk) are kept as opaque bytes
for ``to_bytes`` only, so a rewrite keeps them, and no decision can depend on an unchecked
value. A record is read from the store with the same bound (``get_record``, ``Record.fetch``): a
stray huge value under a record's prefix is refused after at most ``MAX_RECORD_BYTES + 1`` bytes,
never loaded, and is then unusable like any other. Readers that must go on (a node's scans, the
status tool) use ``SkippedRecords``: it counts each refused record and warns once per kind and
learner (``RecordSkippedWarning``), not once per record and scan.
"""

from __future__ import annotations

import json
import logging
import math
import re
import threading
import time
import warnings
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar, Generic, TypeVar, overload

from gradientmail.errors import RecordError, RecordSkippedWarning, ValueTooLargeError
from gradientmail.mailbox.base import Mailbox, VersionedMailbox
from gradientmail.mailbox.keys import is_valid_key

__all__ = [
    "ACTIVE",
    "CLAIM",
    "ClaimRecord",
    "DONE",
    "DoneRecord",
    "FENCED",
    "LEASE",
    "LeaseRecord",
    "MAX_COUNT",
    "MEMBER",
    "MemberRecord",
    "MAX_DEPTH",
    "MAX_RECORD_BYTES",
    "PRESENCE",
    "PROGRESS",
    "PresenceRecord",
    "ProgressRecord",
    "RELEASED",
    "RUN",
    "RUNNING",
    "Record",
    "RecordKind",
    "RunRecord",
    "STOPPED",
    "SkippedRecords",
    "UndeclaredFieldError",
    "WORK",
    "WorkRecord",
    "get_record",
    "get_record_versioned",
    "loads_object",
    "parse",
]

_log = logging.getLogger("gradientmail.records")

MAX_RECORD_BYTES = 64 * 1024
"""Largest record accepted; the library's own are a few hundred bytes."""

MAX_DEPTH = 16
"""Deepest nesting of arrays and objects accepted; the library's records are flat."""

MAX_COUNT = 2**62
"""Largest count (steps, samples, units, beats) accepted."""

MAX_TIME = 253_402_300_799.0
"""The last second of year 9999: later "unix times" are not times (and break formatting)."""

MAX_TEXT = 1024
"""Longest free-text field (token, host, incarnation) accepted."""


# -- field checks: each returns None when the value is fine, else what is wrong ----------------
Check = Callable[[Any], "str | None"]


def _segment(value: Any) -> str | None:
    if not isinstance(value, str):
        return f"is {type(value).__name__}, not a str"
    if not value or "/" in value or not is_valid_key(f"leases/{value}.json"):
        return f"{_short(value)} is not one mailbox key segment"
    return None


def _text(value: Any) -> str | None:
    if not isinstance(value, str):
        return f"is {type(value).__name__}, not a str"
    return f"is longer than {MAX_TEXT} characters" if len(value) > MAX_TEXT else None


def _int_in(low: int, high: int) -> Check:
    def check(value: Any) -> str | None:
        if isinstance(value, bool) or not isinstance(value, int):
            return f"{_short(value)} is not an int"
        return None if low <= value <= high else f"{value} is outside [{low}, {high}]"

    return check


def _real(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:  # an int beyond float range
        return None
    return number if math.isfinite(number) else None


def _time(value: Any) -> str | None:
    number = _real(value)
    if number is None or not 0.0 <= number <= MAX_TIME:
        return f"{_short(value)} is not a unix time (a finite number of seconds, 1970 to 9999)"
    return None


def _rate(value: Any) -> str | None:
    number = _real(value)
    return None if number is not None and number >= 0.0 else f"{_short(value)} is not a finite number >= 0"


def _positive(value: Any) -> str | None:
    number = _real(value)
    return None if number is not None and number > 0.0 else f"{_short(value)} is not a finite number > 0"


_FINGERPRINT = re.compile(r"sha256:[0-9a-f]{64}")


def _fingerprint(value: Any) -> str | None:
    if isinstance(value, str) and _FINGERPRINT.fullmatch(value):
        return None
    return f"{_short(value)} is not 'sha256:' and 64 hex digits"


def _flag(value: Any) -> str | None:
    return None if isinstance(value, bool) else f"{_short(value)} is not true or false"


def _one_of(*choices: str) -> Check:
    def check(value: Any) -> str | None:
        return None if value in choices else f"{_short(value)} is not one of {', '.join(choices)}"

    return check


def _either(*checks: Check) -> Check:
    def check(value: Any) -> str | None:
        problems = [problem for problem in (c(value) for c in checks) if problem is not None]
        return problems[0] if len(problems) == len(checks) else None

    return check


def _nullable(check: Check) -> Check:
    return lambda value: None if value is None else check(value)


_COUNT = _int_in(0, MAX_COUNT)
_STEP = _int_in(-MAX_COUNT, MAX_COUNT)  # a loader's step label, any int

MAX_SPANS = 256
"""Most unit spans a progress record may carry (writers keep 64, ``unit_timing``)."""


def _unit_spans(value: Any) -> str | None:
    """``{"recent": [{"unit", "first", "last", "batches"}, ...], "older": {...}}``."""
    if not isinstance(value, dict):
        return f"is {type(value).__name__}, not an object"
    recent = value.get("recent", [])
    if not isinstance(recent, list) or len(recent) > MAX_SPANS:
        return f"'recent' is not a list of at most {MAX_SPANS} spans"
    for index, entry in enumerate(recent):
        if not isinstance(entry, dict):
            return f"'recent'[{index}] is {type(entry).__name__}, not an object"
        problem = (
            _text(entry.get("unit"))
            or _time(entry.get("first"))
            or _time(entry.get("last"))
            or _COUNT(entry.get("batches"))
        )
        if problem is None and entry["last"] < entry["first"]:
            problem = "ends before it starts"
        if problem is not None:
            return f"'recent'[{index}] {problem}"
    older = value.get("older", {})
    if not isinstance(older, dict):
        return f"'older' is {type(older).__name__}, not an object"
    for name, check in (("units", _COUNT), ("batches", _COUNT), ("busy_s", _rate)):
        problem = check(older[name]) if name in older else None
        if problem is not None:
            return f"'older' field {name!r} {problem}"
    return None


@dataclass(frozen=True)
class RecordKind:
    """One record format of ``gradientmail.layout``: its name, field checks, required fields."""

    name: str
    fields: Mapping[str, Check]
    required: tuple[str, ...] = ()


ACTIVE, RELEASED = "active", "released"
"""A claim's ``state`` in the elastic queue: being worked on, or handed back for anyone to take."""

RUNNING, STOPPED = "running", "stopped"
"""A lease's or presence record's ``state``: its writer runs, or has stopped for good."""

FENCED = "fenced"
"""A lease's ``state`` once a peer judged its writer dead and took the record over, to take its
units over (``queue.lease``): that incarnation of the writer may write nothing more."""

CLAIM = RecordKind(
    "claim",
    {
        "learner": _segment,
        "token": _text,
        "host": _text,
        "pid": _COUNT,
        "worker": _nullable(_COUNT),
        "claimed_at": _time,
        "incarnation": _text,
        "state": _one_of(ACTIVE, RELEASED),
        "step": _nullable(_STEP),
        "taken_from": _nullable(_segment),
        "released_at": _time,
        "position": _nullable(_COUNT),
    },
    required=("learner",),
)
WORK = RecordKind(
    "work record",
    {
        "learner": _segment,
        "token": _text,
        "incarnation": _text,
        "step": _nullable(_STEP),
        "position": _nullable(_COUNT),
        "done": _flag,
        "updated": _time,
        "untracked": _flag,
    },
)
DONE = RecordKind("done record", {"learner": _segment, "token": _text, "at": _time})
LEASE = RecordKind(
    "lease",
    {
        "learner": _segment,
        "incarnation": _text,
        "beat": _COUNT,
        "consumed": _COUNT,
        "time": _time,
        "lease_s": _positive,
        "state": _one_of(RUNNING, STOPPED, FENCED),
        "fenced_by": _segment,
        "fenced_at": _time,
    },
)
PRESENCE = RecordKind(
    "presence record",
    {
        "learner": _segment,
        "incarnation": _text,
        "state": _one_of(RUNNING, STOPPED),
        "beat": _COUNT,
        "time": _time,
        "renew_s": _positive,
        "host": _text,
        "boot": _nullable(_text),
        "pidns": _nullable(_text),
        "pid": _COUNT,
        "pid_start": _nullable(_COUNT),
    },
    required=("incarnation", "state", "host", "pid"),
)
PROGRESS = RecordKind(
    "progress record",
    {
        "learner": _segment,
        "steps": _COUNT,
        "samples": _COUNT,
        "samples_in_run": _nullable(_COUNT),  # of those, the ones whose progress the run's state holds
        "samples_per_s": _nullable(_rate),
        "units": _nullable(_COUNT),
        "started": _nullable(_time),
        "last_seen": _nullable(_time),
        # Some writers store a finish time rather than a flag.
        "finished": _nullable(_either(_flag, _time)),
        "unit_spans": _nullable(_unit_spans),  # the recent units' training spans (unit_timing)
    },
)
RUN = RecordKind("run record", {"units": _COUNT, "created": _time, "fingerprint": _fingerprint})
MEMBER = RecordKind("member record", {"learner": _segment, "joined": _time})


# -- parsing -----------------------------------------------------------------------------------
_TOKEN = re.compile(rb'\\.|["\[\]{}]', re.DOTALL)
"""What nesting depends on: an escape (two bytes), a quote, a bracket. One pass, each byte once."""


def _too_deep(data: bytes, limit: int) -> bool:
    """Whether arrays and objects nest deeper than ``limit`` (brackets inside strings aside).

    Linear in ``len(data)`` whatever the bytes: one left-to-right scan (a regex that matched
    whole strings rescanned to the end from every quote of an unterminated one: a 64 KiB record
    of escaped quotes took 16 s).
    """
    if data.count(b"[") + data.count(b"{") <= limit:
        return False  # the usual case: a flat record, no scan
    depth = 0
    in_string = False
    for match in _TOKEN.finditer(data):
        token = match.group()
        if token == b'"':
            in_string = not in_string
        elif in_string or len(token) == 2:
            continue  # a bracket inside a string, or an escape
        elif token in (b"[", b"{"):
            depth += 1
            if depth > limit:
                return True
        else:
            depth -= 1
    return False


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


_DECODER = json.JSONDecoder(parse_constant=_refuse_constant)
"""What ``json.loads(data, parse_constant=...)`` builds on every call, built once: a claim is read
back after every create."""


def loads_object(data: bytes, *, where: str = "record") -> dict[str, Any]:
    """``data`` as a JSON object, bounded in size and depth; ``RecordError`` saying why not."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise RecordError(f"{where}: is {type(data).__name__}, not bytes")
    data = bytes(data)
    if len(data) > MAX_RECORD_BYTES:
        raise _too_large(where, len(data))
    if _too_deep(data, MAX_DEPTH):
        raise RecordError(f"{where}: JSON nested deeper than {MAX_DEPTH} levels")
    try:
        raw = bytes(data) if isinstance(data, memoryview) else data
        value = _DECODER.decode(raw.decode(json.detect_encoding(raw), "surrogatepass"))  # json.loads(data)
    except RecursionError:  # belt and braces: the depth check should have caught it
        raise RecordError(f"{where}: JSON nested too deeply") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise RecordError(f"{where}: not JSON ({_first_line(exc)})") from None
    if not isinstance(value, dict):
        raise RecordError(f"{where}: a JSON {type(value).__name__}, not an object")
    return value


def _too_large(where: str, size: int | None) -> RecordError:
    held = f"{size:,} bytes, more" if size is not None else "more"
    return RecordError(f"{where}: {held} than a record may hold ({MAX_RECORD_BYTES:,} bytes)")


def _refused(kind: RecordKind | None, key: str, refusal: ValueTooLargeError) -> RecordError:
    return _too_large(f"{kind.name if kind else 'record'} {key!r}", refusal.size)


def get_record(mailbox: Mailbox, key: str, kind: RecordKind | None = None) -> bytes | None:
    """The body stored at ``key`` (None: missing), read with the record bound.

    Raises:
        RecordError: it is longer than ``MAX_RECORD_BYTES``: refused after reading at most one
            byte more (none where the store tells the size first), so a stray huge value costs
            no memory. ``kind`` names the record in the message.
    """
    try:
        return mailbox.get(key, max_bytes=MAX_RECORD_BYTES)
    except ValueTooLargeError as exc:
        raise _refused(kind, key, exc) from None


def get_record_versioned(
    mailbox: VersionedMailbox, key: str, kind: RecordKind | None = None
) -> tuple[bytes, str] | None:
    """``(body, version)`` of the record at ``key`` (None: missing), read as ``get_record`` reads.

    Raises:
        RecordError: it is longer than ``MAX_RECORD_BYTES``.
    """
    try:
        return mailbox.get_versioned(key, max_bytes=MAX_RECORD_BYTES)
    except ValueTooLargeError as exc:
        raise _refused(kind, key, exc) from None


def _checked_body(kind: RecordKind, data: bytes, key: str) -> dict[str, Any]:
    """The whole body of a ``kind`` record (unknown fields too), every declared field checked."""
    where = f"{kind.name} {key!r}" if key else kind.name
    record = loads_object(data, where=where)
    for name in kind.required:
        if name not in record:
            raise RecordError(f"{where}: field {name!r} is missing")
    for name, check in kind.fields.items():
        if name in record:
            problem = check(record[name])
            if problem is not None:
                raise RecordError(f"{where}: field {name!r} {problem}")
    return record


def parse(kind: RecordKind, data: bytes, key: str = "") -> dict[str, Any]:
    """The declared fields of ``data`` as a ``kind`` record, each checked; else ``RecordError``.

    Unknown fields are left out: nothing may decide on a value no check has seen.
    """
    record = _checked_body(kind, data, key)
    return {name: value for name, value in record.items() if name in kind.fields}


# -- typed records: each record's writer and reader together ---------------------------------------
_ENCODER = json.JSONEncoder(separators=(",", ":"))
"""``json.dumps(..., separators=(",", ":"))``'s encoder, built once instead of per record."""

RecordT = TypeVar("RecordT", bound="Record")
T = TypeVar("T")


def _typed(value: Any, kind: type | tuple[type, ...]) -> Any:
    """``value`` if it is a ``kind`` (never a bool standing in for a number), else None."""
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        return None
    return value if isinstance(value, kind) else None


def _number(value: Any) -> float | None:
    value = _typed(value, (int, float))
    return None if value is None else float(value)


class Field(Generic[T]):
    """A typed read of one declared record field: the stored value when it has the type, else None.

    ``kind`` float accepts any JSON number (as a float); ``at_least`` refuses smaller ints. A record
    class may only hold ``Field``s of names its ``KIND`` declares (checked when it is defined).
    """

    def __init__(self, kind: type[T], doc: str = "", *, at_least: int | None = None) -> None:
        self.kind = kind
        self.at_least = at_least
        self.__doc__ = doc
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, record: None, owner: type) -> Field[T]: ...
    @overload
    def __get__(self, record: Record, owner: type) -> T | None: ...
    def __get__(self, record: Record | None, owner: type) -> Field[T] | T | None:
        if record is None:
            return self
        value = record.get(self.name)  # declared: checked when the class was defined
        if self.kind is float:
            return _number(value)  # type: ignore[return-value]
        value = _typed(value, self.kind)
        if self.at_least is not None and value is not None and value < self.at_least:
            return None
        return value


class UndeclaredFieldError(LookupError):
    """Code asked a record for a field its ``RecordKind`` does not declare, so that no check ever
    looked at the value: declare the field with its check in ``gradientmail.records`` first."""


class Record:
    """A record body: typed fields over the exact JSON object it was read from or built as.

    Only the fields its ``KIND`` declares can be read (``Field`` properties, ``get``, ``[]``,
    ``to_dict``); unknown ones are opaque. ``to_bytes`` gives back exactly the body it holds:
    unknown fields (a newer writer's) and the key order are kept, so a rewrite changes only what
    it means to change.
    """

    KIND: ClassVar[RecordKind]
    __slots__ = ("_body",)

    def __init__(self, fields: Mapping[str, Any]) -> None:
        self._body: Mapping[str, Any] = MappingProxyType(dict(fields))
        """The whole body, key order kept; only ``to_bytes`` sees its unknown fields."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        declared = cls.KIND.fields
        for owner in cls.__mro__:
            for name, value in vars(owner).items():
                if isinstance(value, Field) and name not in declared:
                    raise TypeError(
                        f"{cls.__name__}.{name} would read field {name!r}, which {cls.KIND.name!r} does not "
                        "declare with a check"
                    )

    @classmethod
    def from_bytes(cls: type[RecordT], data: bytes, key: str = "") -> RecordT:
        """The record in ``data``, bounded and checked.

        Raises:
            RecordError: not a usable record of this kind (too large or deep, not JSON, a bad field).
        """
        return cls(_checked_body(cls.KIND, data, key))

    @classmethod
    def read(cls: type[RecordT], data: bytes | None, key: str = "") -> RecordT | None:
        """The record in ``data``, or None when it is missing (None) or unusable."""
        if data is None:
            return None
        try:
            return cls.from_bytes(data, key)
        except RecordError:
            return None

    @classmethod
    def fetch(cls: type[RecordT], mailbox: Mailbox, key: str) -> RecordT | None:
        """The record stored at ``key`` (a bounded ``get_record``), or None when it is missing or
        unusable (too large included)."""
        try:
            return cls.read(get_record(mailbox, key, cls.KIND), key)
        except RecordError:
            return None

    def to_bytes(self) -> bytes:
        """The body as compact JSON: the bytes the record is stored as."""
        return self.encode(self._body)

    @staticmethod
    def encode(fields: Mapping[str, Any]) -> bytes:
        """``fields`` as the bytes a record holding them is stored as (``to_bytes`` without the
        record: a claim is written per unit)."""
        return _ENCODER.encode(dict(fields)).encode()

    def _declared(self, name: str) -> str:
        if name not in self.KIND.fields:
            raise UndeclaredFieldError(
                f"{self.KIND.name} has no declared field {name!r} (declared: {', '.join(self.KIND.fields)}); "
                "an undeclared field is never checked, so no code may read or write it"
            )
        return name

    def to_dict(self) -> dict[str, Any]:
        """The declared fields present, in the body's order, as a mutable dict (unknown fields are
        left out)."""
        declared = self.KIND.fields
        return {name: value for name, value in self._body.items() if name in declared}

    def get(self, name: str, default: Any = None) -> Any:
        """A declared field as stored, ``default`` when absent (code that decides reads the
        typed properties)."""
        return self._body.get(self._declared(name), default)

    def __getitem__(self, name: str) -> Any:
        """A declared field as stored; ``KeyError`` when absent."""
        return self._body[self._declared(name)]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self.KIND.fields and name in self._body

    def replace(self: RecordT, **changes: Any) -> RecordT:
        """A copy with declared fields ``changes``: those present keep their place, new ones go last."""
        for name in changes:
            self._declared(name)
        return type(self)({**self._body, **changes})

    def __repr__(self) -> str:
        return f"{type(self).__name__}({dict(self._body)!r})"


class ClaimRecord(Record):
    """``units/{identifier}``: who owns a unit (and, in the elastic queue, its state).

    Example:
        >>> record = ClaimRecord.from_bytes(b'{"learner":"node-0","token":"t0","worker":null}')
        >>> record.learner, record.token, record.state
        ('node-0', 't0', None)
        >>> record.to_bytes()
        b'{"learner":"node-0","token":"t0","worker":null}'
    """

    KIND = CLAIM
    __slots__ = ()
    learner = Field(str, "The learner that claimed the unit.")

    @classmethod
    def of(cls, claim: Mapping[str, Any] | ClaimRecord) -> ClaimRecord:
        """``claim`` itself, or a claim dict (as the queue's callbacks see it) wrapped."""
        return claim if isinstance(claim, ClaimRecord) else cls(claim)

    token = Field(str)
    host = Field(str)
    pid = Field(int)

    @property
    def worker(self) -> Any:
        """The DataLoader worker that claimed (None: the main process), as stored."""
        return self.get("worker")

    claimed_at = Field(float)
    state = Field(str, "``ACTIVE`` or ``RELEASED`` for elastic claims, None for the design note's.")
    incarnation = Field(str)
    step = Field(int)
    position = Field(int, at_least=0)
    taken_from = Field(str)


class WorkRecord(Record):
    """``work/{learner}/{identifier}``: the last batch the loop consumed under a claim.

    Example:
        >>> record = WorkRecord.from_bytes(WorkRecord.new("node-0", "t0", "i0", 7, position=3).to_bytes())
        >>> record.step, record.position, record.done
        (7, 3, False)
    """

    KIND = WORK
    __slots__ = ()
    learner = Field(str)

    @classmethod
    def new(
        cls,
        learner: str,
        token: str,
        incarnation: str,
        step: int | None,
        *,
        position: int | None = None,
        done: bool = False,
        untracked: bool = False,
    ) -> WorkRecord:
        return cls(
            {
                "learner": learner,
                "token": token,
                "incarnation": incarnation,
                "step": step,
                "position": position,
                "done": done,
                "updated": time.time(),
                **({"untracked": True} if untracked else {}),
            }
        )

    token = Field(str)
    incarnation = Field(str)
    step = Field(int, "The last consumed batch's step label (any int; None before the first).")
    position = Field(int, "Its index in the unit's ``load()`` iteration (None: an older writer's record).", at_least=0)

    @property
    def done(self) -> bool:
        return self.get("done") is True

    @property
    def untracked(self) -> bool:
        """Written by the design note's queue while it loads the unit: no consumed batch recorded."""
        return self.get("untracked") is True


class DoneRecord(Record):
    """``done/{identifier}``: a unit's batches were all consumed, under claim ``token``."""

    KIND = DONE
    __slots__ = ()
    learner = Field(str)

    @classmethod
    def new(cls, learner: str, token: str) -> DoneRecord:
        return cls({"learner": learner, "token": token, "at": time.time()})

    token = Field(str)


class LeaseRecord(Record):
    """``leases/{learner}.json``: one heartbeat of an elastic learner (``verdict.judge_lease``),
    or its fence (``FENCED``: a peer took it over, ``queue.lease``)."""

    KIND = LEASE
    __slots__ = ()
    learner = Field(str)

    @classmethod
    def new(cls, learner: str, incarnation: str, beat: int, consumed: int, lease_s: float, state: str) -> LeaseRecord:
        return cls(
            {
                "learner": learner,
                "incarnation": incarnation,
                "beat": beat,
                "consumed": consumed,
                "time": time.time(),
                "lease_s": lease_s,
                "state": state,
            }
        )

    incarnation = Field(str)
    state = Field(str, "``RUNNING``, ``STOPPED`` or ``FENCED``.")
    time = Field(float, "When its writer wrote it (unix seconds, the writer's clock).")
    consumed = Field(int)
    fenced_by = Field(str, "The learner that fenced it (``FENCED``), to take its writer's units over.")


class PresenceRecord(Record):
    """``learners/{learner}.json``: the live incarnation of a learner id, and where it runs.

    Example:
        >>> record = PresenceRecord.new("node-0", "i0", RUNNING, 1, 10.0, {"host": "h"}, pid=42, pid_start=None)
        >>> PresenceRecord.from_bytes(record.to_bytes()).pid
        42
    """

    KIND = PRESENCE
    __slots__ = ()
    learner = Field(str)

    @classmethod
    def new(
        cls,
        learner: str,
        incarnation: str,
        state: str,
        beat: int,
        renew_s: float,
        machine: Mapping[str, Any],
        *,
        pid: int,
        pid_start: int | None,
        now: float | None = None,
    ) -> PresenceRecord:
        return cls(
            {
                "learner": learner,
                "incarnation": incarnation,
                "state": state,
                "beat": beat,
                "time": time.time() if now is None else now,
                "renew_s": renew_s,
                **machine,
                "pid": pid,
                "pid_start": pid_start,
            }
        )

    @property
    def incarnation(self) -> str:
        return self["incarnation"]  # required and checked

    @property
    def state(self) -> str:
        """``RUNNING`` or ``STOPPED``."""
        return self["state"]

    @property
    def host(self) -> str:
        return self["host"]

    @property
    def pid(self) -> int:
        return self["pid"]

    pid_start = Field(int, "The process's start time in clock ticks since boot (None: unknown).")
    time = Field(float)
    renew_s = Field(float)


class RunRecord(Record):
    """``run.json``: the run's unit count and unit-set fingerprint, written once."""

    KIND = RUN
    __slots__ = ()

    @classmethod
    def new(cls, units: int, fingerprint: str | None) -> RunRecord:
        fields: dict[str, Any] = {"units": units, "created": time.time()}
        if fingerprint is not None:
            fields["fingerprint"] = fingerprint
        return cls(fields)

    units = Field(int)
    created = Field(float)
    fingerprint = Field(str, "``unit_fingerprint`` of the run's identifiers (None: an older version's record).")


class MemberRecord(Record):
    """``session/members/{learner}.{joined ms}``: a learner in the Session (its key says who and
    since when; peers count the keys, the body repeats them for a reader of the store)."""

    KIND = MEMBER
    __slots__ = ()
    learner = Field(str)

    @classmethod
    def new(cls, learner: str, joined: float) -> MemberRecord:
        return cls({"learner": learner, "joined": joined})

    joined = Field(float)


class ProgressRecord(Record):
    """``progress/{learner}.json``: a learner's training progress, as ``gradientmail status`` shows it."""

    KIND = PROGRESS
    __slots__ = ()
    learner = Field(str)

    @classmethod
    def new(
        cls,
        progress: Mapping[str, Any],
        *,
        units: int | None,
        samples_in_run: int | None,
        unit_spans: Mapping[str, Any] | None = None,
    ) -> ProgressRecord:
        """The Session's figures (``progress``), the queue's ``units`` and ``unit_spans``."""
        fields = dict(progress, units=units, samples_in_run=samples_in_run)
        if unit_spans is not None:
            fields["unit_spans"] = dict(unit_spans)
        return cls(fields)

    steps = Field(int)
    samples = Field(int)


class SkippedRecords:
    """Counts the records a reader skipped, and warns once per (kind, learner).

    ``who`` is the learner a record belongs to when the reader knows it (from the key or the
    claim), else None: every unreadable record of one kind without a known learner then shares
    one warning. ``counts`` maps kind name to records skipped.
    """

    def __init__(self, reader: str) -> None:
        self.reader = reader
        self.counts: Counter[str] = Counter()
        self._warned: set[tuple[str, str | None]] = set()
        self._lock = threading.Lock()

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def read(self, record: type[RecordT], data: bytes | None, key: str, who: str | None = None) -> RecordT | None:
        """The ``record`` in ``data``, or None when it is missing or unusable (counted, warned)."""
        if data is None:
            return None
        try:
            return record.from_bytes(data, key)
        except RecordError as exc:
            self.skip(record.KIND, exc, who)
            return None

    def get(self, record: type[Record], mailbox: Mailbox, key: str, who: str | None = None) -> bytes | None:
        """The body stored at ``key`` (``get_record``), or None when it is missing or too large
        (counted, warned): for a reader that needs the bytes too."""
        try:
            return get_record(mailbox, key, record.KIND)
        except RecordError as exc:
            self.skip(record.KIND, exc, who)
            return None

    def fetch(self, record: type[RecordT], mailbox: Mailbox, key: str, who: str | None = None) -> RecordT | None:
        """The ``record`` stored at ``key``, or None when it is missing or unusable (counted, warned)."""
        return self.read(record, self.get(record, mailbox, key, who), key, who)

    def skip(self, kind: RecordKind, error: RecordError, who: str | None = None) -> None:
        with self._lock:
            self.counts[kind.name] += 1
            first = (kind.name, who) not in self._warned
            self._warned.add((kind.name, who))
        _log.log(logging.WARNING if first else logging.DEBUG, "%s: skipped %s", self.reader, error)
        if first:
            whose = f" of learner {who!r}" if who is not None else ""
            warnings.warn(
                f"{self.reader}: skipped {error}; further unusable {kind.name}s{whose} are "
                "skipped without a warning (gradientmail status lists them)",
                RecordSkippedWarning,
                stacklevel=3,
            )


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
