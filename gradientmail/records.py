"""Bounded, validated parsing of the JSON records read from a mailbox: one place everyone uses.

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

Unknown fields are kept and ignored (the formats only ever gain fields, ``gradientmail.layout``).
Readers that must go on (a node's scans, the status tool) use ``SkippedRecords``: it counts each
refused record and warns once per kind and learner (``RecordSkippedWarning``), not once per
record and scan.
"""

from __future__ import annotations

import json
import logging
import math
import re
import threading
import warnings
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from gradientmail.errors import RecordError, RecordSkippedWarning
from gradientmail.mailbox.keys import is_valid_key

__all__ = [
    "CLAIM",
    "DONE",
    "LEASE",
    "MAX_COUNT",
    "MAX_DEPTH",
    "MAX_RECORD_BYTES",
    "PROGRESS",
    "RUN",
    "WORK",
    "RecordKind",
    "SkippedRecords",
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
        "state": _one_of("active", "released"),
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
        "state": _one_of("running", "stopped"),
    },
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


# -- parsing -----------------------------------------------------------------------------------
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKET = re.compile(rb"[\[\]{}]")


def _too_deep(data: bytes, limit: int) -> bool:
    """Whether arrays and objects nest deeper than ``limit`` (brackets inside strings aside)."""
    if data.count(b"[") + data.count(b"{") <= limit:
        return False  # the usual case: a flat record, no scan
    depth = 0
    for match in _BRACKET.finditer(_STRING.sub(b'""', data)):
        if match.group() in (b"[", b"{"):
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
        raise RecordError(f"{where}: {len(data):,} bytes, more than a record may hold ({MAX_RECORD_BYTES:,})")
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


def parse(kind: RecordKind, data: bytes, key: str = "") -> dict[str, Any]:
    """``data`` as a ``kind`` record: bounded, every known field checked; else ``RecordError``."""
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

    def parse(self, kind: RecordKind, data: bytes | None, key: str, who: str | None = None) -> dict[str, Any] | None:
        """The record, or None when ``data`` is None (missing) or unusable (counted, warned)."""
        if data is None:
            return None
        try:
            return parse(kind, data, key)
        except RecordError as exc:
            self.skip(kind, exc, who)
            return None

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
