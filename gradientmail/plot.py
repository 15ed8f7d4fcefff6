"""Gantt charts of a run: one row per learner, one bar per unit, time on the x axis.

Bars are the measured training spans from progress records where there are any, else claim
to next claim. Beyond ``MAX_BARS`` units a bar per unit is illegible (and drawing 100k of them
took minutes), so each learner's row shows its busy time instead: its units merged wherever
they lie closer than a pixel apart, drawn as one shape per row, with its unit count in the row's
label. matplotlib is imported only when a chart is drawn (Agg backend, no display).
"""

from __future__ import annotations

import os
import re
import statistics
import textwrap
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gradientmail.errors import MissingExtraError
from gradientmail.status import Claim, RunStatus

MAX_BARS = 500
"""Most units drawn one bar each; a chart of more shows each learner's busy time (``merge_spans``)."""


@dataclass(frozen=True, slots=True)
class Span:
    """One bar: ``learner`` worked on ``unit`` from ``start`` to ``end`` (seconds)."""

    learner: str
    unit: str
    start: float
    end: float
    estimated: bool = False
    """True when ``end`` is a guess (a last unit with no progress record to end it)."""
    measured: bool = False
    """True when the bar is the unit's training (first batch to last batch, from the learner's
    progress record); False when it is derived from claim times."""


def short_label(identifier: str) -> str:
    """``000003-1.json`` (a ``unit_grid`` identifier) as ``3-1``; anything else as it is."""
    match = re.fullmatch(r"0*(\d+)-(\d+)(?:\.json)?", identifier)
    return f"{match[1]}-{match[2]}" if match else identifier.removesuffix(".json")


def spans_from_run(run: RunStatus) -> list[Span]:
    """The bars of ``run``: measured training spans where progress records carry them, else claim times.

    Example:
        >>> from gradientmail.status import Claim, RunStatus
        >>> run = RunStatus("doc", 0.0, claims=[Claim("0.json", "A", 1.0), Claim("1.json", "A", 3.0)])
        >>> [(span.unit, span.start, span.end) for span in spans_from_run(run)]
        [('0.json', 1.0, 3.0), ('1.json', 3.0, 5.0)]
    """
    claimed = _claim_spans(run)
    measured = [
        Span(learner, span.unit, span.first, span.last, measured=True)
        for learner, spans in run.unit_spans.items()
        for span in spans
    ]
    typical = statistics.median([s.end - s.start for s in measured] or [1.0])
    window: dict[str, tuple[float, float]] = {}
    for span in measured:
        low, high = window.get(span.learner, (span.start, span.end))
        window[span.learner] = (min(low, span.start), max(high, span.end))
    timed = {(span.learner, span.unit) for span in measured}
    spans = list(measured)
    for span in claimed:
        if (span.learner, span.unit) in timed:
            continue
        if span.learner in window:  # keep claim-derived bars out of the measured ones
            low, high = window[span.learner]
            if span.start < low:
                span = Span(span.learner, span.unit, span.start, min(span.end, low), span.estimated)
            elif span.start < high:  # claimed then, trained later (after the record) or never
                span = Span(span.learner, span.unit, high, max(span.end, high + typical), estimated=True)
        spans.append(span)
    return sorted(spans, key=lambda s: (s.learner, s.start))


def describe_spans(spans: Sequence[Span]) -> str:
    """What the bars show, for a chart's title and the command's message."""
    measured = sum(span.measured for span in spans)
    if measured == len(spans):
        what = "bars: first to last batch"
    elif measured == 0:
        what = "bars: claim to next claim (no batch times in the progress records)"
    else:
        what = (
            f"bars: first to last batch ({measured}), claim to next claim "
            f"({len(spans) - measured}, units without batch times)"
        )
    if len(spans) > MAX_BARS:
        what += f"; over {MAX_BARS} units, so each row is its learner's busy time (units merged)"
    return what


def _claim_spans(run: RunStatus) -> list[Span]:
    """Bars from claim times: a unit's claim to the next claim of the same claiming thread."""
    streams: dict[tuple, list[Claim]] = defaultdict(list)
    for claim in run.claims:
        if claim.claimed_at is not None:
            streams[claim.stream].append(claim)
    known: list[Span] = []
    last: list[Claim] = []
    for claims in streams.values():
        claims.sort(key=lambda c: (c.claimed_at, c.identifier))
        for claim, following in zip(claims, claims[1:], strict=False):
            known.append(Span(claim.learner, claim.identifier, claim.claimed_at, following.claimed_at))
        last.append(claims[-1])
    typical = statistics.median(s.end - s.start for s in known) if known else 1.0
    spans = list(known)
    for claim in last:
        row = run.learner(claim.learner)
        end = row.last_seen if row is not None else None
        if end is not None and end > claim.claimed_at:
            spans.append(Span(claim.learner, claim.identifier, claim.claimed_at, end))
        else:
            spans.append(
                Span(claim.learner, claim.identifier, claim.claimed_at, claim.claimed_at + typical, estimated=True)
            )
    return sorted(spans, key=lambda s: (s.learner, s.start))


def merge_spans(spans: Iterable[Span], gap: float) -> dict[str, list[tuple[float, float]]]:
    """Each learner's busy time: its spans' ``(start, end)`` merged where less than ``gap`` apart.

    Example:
        >>> spans = [Span("A", "u0", 0.0, 1.0), Span("A", "u1", 1.05, 2.0), Span("A", "u2", 5.0, 6.0)]
        >>> merge_spans(spans, gap=0.1)
        {'A': [(0.0, 2.0), (5.0, 6.0)]}
    """
    by_learner: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for span in spans:
        by_learner[span.learner].append((span.start, max(span.end, span.start)))
    merged: dict[str, list[tuple[float, float]]] = {}
    for learner, times in by_learner.items():
        times.sort()
        runs = [times[0]]
        for start, end in times[1:]:
            low, high = runs[-1]
            if start - high < gap:
                runs[-1] = (low, max(high, end))
            else:
                runs.append((start, end))
        merged[learner] = runs
    return merged


def run_origin(run: RunStatus, spans: Sequence[Span]) -> float:
    """Time zero of a chart: the run's creation, or its first claim when that is earlier."""
    first = min((s.start for s in spans), default=0.0)
    return run.created if run.created is not None and run.created <= first else first


def new_figure(width: float, height: float):
    """A matplotlib ``Figure`` drawn with Agg, without pyplot (no display, no global state)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise MissingExtraError(f"charts need matplotlib: pip install 'gradientmail[cli]' ({exc})") from exc
    figure = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def draw_gantt(
    spans: Iterable[Span],
    ax: Any = None,
    *,
    origin: float | None = None,
    rows: Sequence[str] | None = None,
    title: str | None = None,
    markers: Mapping[str, float] | None = None,
    labels: bool | None = None,
) -> Any:
    """Draw ``spans`` on a matplotlib ``ax`` (a new figure's when None) and return the axes.

    Args:
        spans: the bars; time values are shifted by ``origin`` (default: the earliest start).
        rows: learner names top to bottom (default: sorted names of ``spans``).
        title: axes title.
        markers: vertical dashed lines, ``{"fixed split": 24.0}``, in shifted time.
        labels: write each unit's identifier in its bar (default: when there are at most 48).

    More than ``MAX_BARS`` spans are drawn as each row's busy time (``merge_spans``, units
    closer than 1/1000 of the time axis merged): one shape per row, whatever the units.
    """
    spans = list(spans)
    if ax is None:
        names = rows or sorted({s.learner for s in spans})
        ax = new_figure(8.0, 1.2 + 0.45 * max(1, len(names))).add_subplot()
    if origin is None:
        origin = min((s.start for s in spans), default=0.0)
    names = list(rows) if rows is not None else sorted({s.learner for s in spans})
    position = {name: index for index, name in enumerate(names)}
    colors = [f"C{index % 10}" for index in range(len(names))]
    if labels is None:
        labels = len(spans) <= 48
    extent = max((s.end - origin for s in spans), default=0.0) or 1.0
    ticks = names
    if len(spans) > MAX_BARS:
        _draw_busy(ax, spans, origin, extent, position, colors)
        units = Counter(span.learner for span in spans)
        ticks = [f"{name} ({units[name]:,} units)" for name in names]
    else:
        _draw_bars(ax, spans, origin, extent, position, colors, labels)
    end = max((s.end - origin for s in spans), default=0.0)
    lines = {"makespan": end, **(markers or {})}
    for index, (label, x) in enumerate(lines.items()):
        ax.axvline(
            x,
            color="black" if index == 0 else f"C{(index + 3) % 10}",
            linestyle="--",
            linewidth=1.0,
            label=f"{label} {x:.3g}",
        )
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7, frameon=False, handlelength=1.5)
    ax.set_yticks(range(len(names)), ticks)
    ax.set_ylim(len(names) - 0.5, -0.5)
    ax.set_xlim(0, max([end, *lines.values()]) * 1.04 or 1.0)
    ax.set_xlabel("time (s)")
    ax.grid(axis="x", alpha=0.3)
    if title:
        ax.set_title(title, fontsize=10)
    return ax


def _draw_bars(
    ax: Any,
    spans: list[Span],
    origin: float,
    extent: float,
    position: Mapping[str, int],
    colors: Sequence[str],
    labels: bool,
) -> None:
    """One bar per span (hatched when its end is a guess), its unit written in it if ``labels``."""
    for span in spans:
        if span.learner not in position:
            continue
        row = position[span.learner]
        left, width = span.start - origin, max(span.end - span.start, 0.0)
        ax.barh(
            row,
            width,
            left=left,
            height=0.7,
            color=colors[row],
            edgecolor="white",
            linewidth=1.0,
            alpha=0.45 if span.estimated else 0.9,
            hatch="//" if span.estimated else None,
        )
        if labels and width >= 0.035 * extent:
            ax.text(
                left + width / 2,
                row,
                short_label(span.unit),
                ha="center",
                va="center",
                fontsize=6,
                color="white",
                clip_on=True,
            )


def _draw_busy(
    ax: Any, spans: list[Span], origin: float, extent: float, position: Mapping[str, int], colors: Sequence[str]
) -> None:
    """Each row's busy time as one ``broken_barh`` (a second, hatched, for guessed ends)."""
    for estimated in (False, True):
        chosen = [span for span in spans if span.estimated == estimated and span.learner in position]
        for learner, runs in merge_spans(chosen, gap=extent / 1000).items():
            row = position[learner]
            ax.broken_barh(
                [(start - origin, end - start) for start, end in runs],
                (row - 0.35, 0.7),
                facecolors=colors[row],
                edgecolor="none",
                alpha=0.45 if estimated else 0.9,
                hatch="//" if estimated else None,
            )


def save_gantt(spans: Iterable[Span], path: str | os.PathLike[str], **options: Any) -> str:
    """Draw ``spans`` (``draw_gantt`` options) into a PNG at ``path``; returns the path."""
    ax = draw_gantt(spans, **options)
    path = os.fspath(path)
    directory = os.path.dirname(path)
    if directory:
        os.makedirs(directory, exist_ok=True)
    ax.figure.savefig(path, format="png")
    return path


def plot_run(
    run: RunStatus, path: str | os.PathLike[str], *, title: str | None = None, spans: Sequence[Span] | None = None
) -> str:
    """The Gantt chart of ``run`` (from its mailbox) written to ``path`` as PNG.

    ``spans``: ``spans_from_run(run)`` when the caller already has them (computed when None).
    """
    spans = spans_from_run(run) if spans is None else list(spans)
    return save_gantt(
        spans,
        path,
        origin=run_origin(run, spans),
        rows=sorted({*(row.learner for row in run.learners if row.units), *(span.learner for span in spans)}) or None,
        title=title or textwrap.fill(f"{run.mailbox}: {len(spans)} units; {describe_spans(spans)}", 72),
    )
