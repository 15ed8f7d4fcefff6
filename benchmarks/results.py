"""The results file: every benchmark's latest figures, each with the command, date and machine.

``benchmarks/results.json`` is the one source of the figures that ``benchmarks/RESULTS.md``, the
README and ``docs/`` show (``python -m benchmarks.figures`` renders them). ``python -m benchmarks``
merges into it: a script it ran replaces that script's entry, every other entry stays as it was
with its own provenance, so the long ``--full`` runs need not be repeated to refresh the rest.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

RESULTS_JSON = Path(__file__).with_name("results.json")
"""Where ``python -m benchmarks`` keeps the figures (``--output`` chooses another file)."""

MAX_BYTES = 16 * 1024 * 1024
"""A results file larger than this is not one this package wrote."""


class ResultsError(ValueError):
    """The results file is not what ``python -m benchmarks`` writes; the message says where."""


@dataclass(frozen=True)
class Run:
    """One entry of the results file: the figures of one command, and where they come from.

    ``note`` says when the figures were not measured on the code beside them (carried over from
    an earlier run), so a reader can tell a stale figure from a fresh one.
    """

    command: str
    date: str
    machine: str
    figures: dict[str, Any]
    seconds: float | None = None
    lines: list[str] = field(default_factory=list)
    note: str = ""


def spread(figures: Mapping[str, Any], name: str) -> tuple[float, float] | None:
    """The [min, max] of figure ``name`` over its repeats, under any of the names scripts use."""
    for key in (f"{name}_range", f"{name}_spread"):
        value = figures.get(key)
        if isinstance(value, (list, tuple)) and len(value) == 2 and all(is_number(v) for v in value):
            return float(value[0]), float(value[1])
    low, high = figures.get(f"{name}_min"), figures.get(f"{name}_max")
    if is_number(low) and is_number(high):
        return float(low), float(high)
    return None


def is_number(value: Any) -> bool:
    """A finite int or float (``bool`` is not a figure)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def merge(old: Mapping[str, Run], new: Mapping[str, Run]) -> dict[str, Run]:
    """``old`` with every entry of ``new`` replacing the one of the same name; order kept, new last."""
    return {**old, **new}


def load(path: Path = RESULTS_JSON) -> dict[str, Run]:
    """The entries of the results file at ``path`` (none when it does not exist yet).

    Raises:
        ResultsError: the file is too large, not JSON, or an entry lacks a field or has one of
            the wrong type; the message names the file and the entry.
    """
    if not path.exists():
        return {}
    size = path.stat().st_size
    if size > MAX_BYTES:
        raise ResultsError(f"{path}: {size:,} bytes, more than a results file holds ({MAX_BYTES:,})")
    try:
        data = json.loads(path.read_text())
    except ValueError as error:
        raise ResultsError(f"{path}: not JSON ({error})") from None
    if not isinstance(data, dict) or not isinstance(data.get("runs"), dict):
        raise ResultsError(f'{path}: expected an object with "runs": {{name: entry}}')
    return {name: parse_run(path, name, entry) for name, entry in data["runs"].items()}


def parse_run(path: Path, name: str, entry: Any) -> Run:
    """One entry, checked field by field so that a hand edit gone wrong names itself."""
    where = f"{path}: run {name!r}"
    if not isinstance(entry, dict):
        raise ResultsError(f"{where} is not an object")
    for key in ("command", "date", "machine"):
        if not isinstance(entry.get(key), str) or not entry[key]:
            raise ResultsError(f"{where}: {key!r} must be a non-empty string")
    if not isinstance(entry.get("figures"), dict):
        raise ResultsError(f"{where}: 'figures' must be an object of figure names to values")
    seconds = entry.get("seconds")
    if seconds is not None and not is_number(seconds):
        raise ResultsError(f"{where}: 'seconds' must be a number")
    lines = entry.get("lines", [])
    if not isinstance(lines, list) or not all(isinstance(line, str) for line in lines):
        raise ResultsError(f"{where}: 'lines' must be a list of strings")
    note = entry.get("note", "")
    if not isinstance(note, str):
        raise ResultsError(f"{where}: 'note' must be a string")
    unknown = set(entry) - {"command", "date", "machine", "figures", "seconds", "lines", "note"}
    if unknown:
        raise ResultsError(f"{where}: unknown fields {sorted(unknown)}")
    return Run(entry["command"], entry["date"], entry["machine"], entry["figures"], seconds, lines, note)


def save(runs: Mapping[str, Run], path: Path = RESULTS_JSON) -> None:
    """Write ``runs`` to ``path`` (stable order and layout, so a diff shows what a run changed)."""
    data = {"runs": {name: asdict(run) for name, run in runs.items()}}
    path.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
