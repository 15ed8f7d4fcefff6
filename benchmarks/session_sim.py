"""The Session at 16 to 4,096 learners on a virtual clock: S3's figures, a 1B-parameter model.

Each learner runs the Session's real exchange code (``session.exchange.Exchanger``: enter, the
folds with their listings, pending contributions and retirement, leave) as cooperative tasks on a
``VirtualClock``, against a ``SimulatedStore`` (per-request latency, bandwidth per stream, request
limits per prefix). Models of billions of parameters cannot be held by thousands of learners: each
learner holds a tiny real model (``--real-params``) cut into the fragments the modelled one would
have, and the store bills every tensor body at the modelled size (``StoreModel.body_scale``). CPU
is not billed: virtual time passes only in the store and between steps.

The learner mirrors ``Session``'s training-thread side: a random phase at enter, one fragment per
slot of ``every / fragments`` on its own grid (``Session``'s ``Schedule``, by time), the
exchange job in the background while it steps, its merges applied at the next step
once done, a final fold of every fragment on leaving. Learners step at ``--steps-per-s`` times a
speed drawn per learner from ``1 ± --speed-spread``.

Figures per row (suffix ``_N``, the learner count, or ``_NxF`` for a row of ``--also``: N learners
on F fragments), with ``benchmarks.session_scale``'s definitions:

- ``session_sim_exchange_rate_N``: completed whole exchanges (fragment exchanges / fragments) per learner
  over the window / the intended ``window / every``, the smallest over learners (``_mean``).
- ``session_sim_lag_intervals_N``: samples not in the run (``consensus``) when the window closes, in
  intervals of that learner's own steps, the largest over learners (``_mean``).
- ``session_sim_versions_lag_intervals_N``: the same, counting only what every fragment's newest
  *version* holds (what a learner's fold reads), not the contributions still pending beside it
  (which ``consensus`` adds): whether the chains keep up with the contributions they receive.
- ``session_sim_contributions_per_version_N``: contributions made in the window / versions created
  in it (a version absorbs at most ``chain.MAX_ABSORBED + 1``: above that the chain falls behind);
  ``session_sim_pending_at_end_N``: contributions pending per fragment at the window's end;
  ``session_sim_backlog_warnings_N``: the share of (learner, fragment) pairs that warned of a
  growing backlog (``chain.BACKLOG_WARNING``), ``session_sim_other_warnings_N`` the Session's
  other warnings (their first is printed on stderr).
- ``session_sim_read_per_exchange_N``, ``session_sim_written_per_exchange_N``: bytes a learner moved per
  completed exchange, in model sizes (the modelled model's bytes in its wire dtype), mean over
  learners, from the first step to the end of the exchange in flight at the window's end;
  ``session_sim_requests_per_exchange_N`` the same for requests.
- ``session_sim_conflicts_per_fold_N``: versions lost to other writers per completed fragment exchange
  (``session_sim_conflicts_per_exchange_N``: per completed whole exchange, as ``session_scale``'s).
- ``session_sim_reads_per_s_N``, ``session_sim_writes_per_s_N``: the most requests one prefix
  (a fragment's ``versions`` or ``pending`` folder, ``session/members``) received in one whole
  second of virtual time within the window (joining and the exits, all at once here, are left
  out); ``session_sim_queued_s_N``: seconds requests waited behind a prefix's limit, summed.
- ``session_sim_exact_N``: 1.0 when every learner's samples are in the run exactly once after everyone
  left (``consensus`` equals the samples trained), else 0.0; ``session_sim_wall_s_N``: this machine's
  seconds for the row.

Usage: ``python -m benchmarks.session_sim [--quick] [--learners 16 64 256 1024] [--jobs 2]
[--params 1e9] [--every 60] [--intervals 3] [--fragments F ...] [--also N:F ...] [--latency-ms 20] [--bandwidth-mbs 100]
[--reads-per-s 5500] [--writes-per-s 3500] [--steps-per-s 1] [--speed-spread 0.2] [--seed 0]``.
``--quick`` (CI: 4 and 8 learners, a few seconds) judges nothing. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import logging
import math
import random
import sys
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from benchmarks._common import default_jobs, emit, parallel_map, parser, table, verdicts
from benchmarks._simulated_store import READ, WRITE, SimulatedMailbox, SimulatedStore, StoreModel
from benchmarks._virtual_clock import Event, Task, VirtualClock
from benchmarks.session_scale import make_model, phase_generator
from gradientmail import MemoryMailbox
from gradientmail.layout import parse_state_key, pending_prefix, versions_prefix
from gradientmail.session import consensus
from gradientmail.session.chain import FragmentChain
from gradientmail.session.exchange import Exchanger, Merge
from gradientmail.session.fragments import FragmentPlan, accumulation_dtype, auto_fragments, float_state
from gradientmail.session.mail import Ledger
from gradientmail.session.outer import resolve_outer
from gradientmail.session.schedule import Schedule

LEARNERS = (16, 64, 256, 1024, 4096)
QUICK = {"learners": [4, 8], "params": 1e8, "every": 10.0, "intervals": 4, "steps_per_s": 4.0}
WIRE_BYTES = {torch.float32: 4, torch.bfloat16: 2}


@dataclass(frozen=True)
class SimConfig:
    """One simulated run.

    Attributes:
        learners: how many learners.
        every: seconds between a learner's exchanges of its whole state.
        intervals: the measured window, in intervals (``every``).
        params: the modelled model's parameters (billed at that size).
        wire_dtype: how the state travels (``torch.bfloat16`` or ``torch.float32``).
        fragments: how many fragments (None: what ``Session`` picks for the modelled model).
        real_params: the parameters each learner really holds and exchanges.
        steps_per_s: a learner's steps per second at speed 1.
        speed_spread: each learner's speed is drawn from ``1 ± speed_spread``.
        store: the store's costs and limits (its ``body_scale`` is set from the sizes).
        seed: everything random (phases, speeds, which pending contributions a fold reads).
        join_spread: learners join spread over this many intervals (unsynchronised phases).
        threads: run the tasks as threads even where ``greenlet`` is installed (same figures).
        phase_seed: each learner's phase from ``session_scale.phase_generator(phase_seed, index)``
            (a real run of ``session_scale`` with the same draws the same); None: from ``seed``.
    """

    learners: int
    every: float = 60.0
    intervals: float = 3.0
    params: float = 1e9
    wire_dtype: torch.dtype = torch.bfloat16
    fragments: int | None = None
    real_params: int = 4096
    steps_per_s: float = 1.0
    speed_spread: float = 0.2
    store: StoreModel = field(default_factory=StoreModel)
    seed: int = 0
    join_spread: float = 1.0
    threads: bool = False
    phase_seed: int | None = None

    def __post_init__(self) -> None:
        if self.learners < 1 or self.every <= 0 or self.intervals <= 0 or self.steps_per_s <= 0:
            raise ValueError(f"a run needs learners >= 1 and every, intervals, steps_per_s > 0: {self}")
        if not 1 <= self.real_params <= self.params:
            raise ValueError(f"real_params must be in [1, params]: {self.real_params} for {self.params:g}")
        if not 0 <= self.speed_spread < 1:
            raise ValueError(f"speed_spread must be in [0, 1), not {self.speed_spread}")
        if self.wire_dtype not in WIRE_BYTES:
            raise ValueError(f"wire_dtype must be torch.float32 or torch.bfloat16, not {self.wire_dtype}")

    @property
    def fragment_count(self) -> int:
        return auto_fragments(int(self.params)) if self.fragments is None else self.fragments

    @property
    def model_bytes(self) -> float:
        """One model size: the modelled model's bytes in its wire dtype."""
        return self.params * WIRE_BYTES[self.wire_dtype]

    @property
    def body_scale(self) -> float:
        return self.params / self.real_params


@dataclass
class Learner:
    """One simulated learner: a tiny model, its store view, its ``Exchanger`` and schedule."""

    index: int
    name: str
    rate: float
    model: torch.nn.Module
    box: SimulatedMailbox
    exchanger: Exchanger
    plan: FragmentPlan
    every: float
    steps: int = 0
    samples: int = 0
    exchanges: int = 0
    job: Task | None = None
    landed: list[Merge] = field(default_factory=list)
    schedule: Schedule | None = None
    buffers: list[dict[str, torch.Tensor]] = field(default_factory=list)
    before: tuple[int, float, float] = (0, 0.0, 0.0)
    after: tuple[int, float, float] = (0, 0.0, 0.0)
    samples_at_end: int = 0
    at_end: float = 0.0
    completed: float = 0.0
    conflicts: int = 0
    exchanges_before: int = 0

    def start_schedule(self, phase_seed: int | None) -> None:
        """A random phase, as ``Session`` starts one on entering: its own ``Schedule``, on the
        virtual clock (read through ``time.monotonic`` at each call, which the clock patches),
        drawn from the run's seeded generator or ``session_scale.phase_generator(phase_seed, index)``."""
        self.schedule = Schedule(
            len(self.plan),
            every_s=self.every,
            every_steps=math.inf,
            steps=self.steps,
            clock=lambda: time.monotonic(),
            rng=random.Random(random.random()) if phase_seed is None else phase_generator(phase_seed, self.index),
        )

    def progress(self, *, finished: bool) -> dict[str, Any]:
        return {
            "learner": self.name,
            "steps": self.steps,
            "samples": self.samples,
            "samples_per_s": self.rate,
            "units": None,
            "started": time.time(),
            "last_seen": time.time(),
            "finished": finished,
        }

    def job_for_now(self, clock: VirtualClock, indices: list[int], *, final: bool) -> Task:
        """Snapshot ``indices`` now and fold them in a background task (``Session``'s job)."""
        snapshots = [(i, self.plan.fragments[i].snapshot_into(self.buffers[i], self.model)) for i in indices]
        taken, totals = time.monotonic(), (self.steps, self.samples)
        progress = self.progress(finished=final) if final or len(self.plan) - 1 in indices else None
        exchanger = self.exchanger

        def job() -> None:
            for i, snapshot in snapshots:
                self.landed.append(exchanger.exchange(i, snapshot, totals, final, taken))
            if final:
                exchanger.leave()
            if progress is not None:
                exchanger.put_progress(progress)

        return clock.spawn(job, name=f"{self.name}-job")

    def apply(self, clock: VirtualClock) -> None:
        """Apply the finished job's merges (at a step boundary), then raise its error if it failed."""
        job, self.job = self.job, None
        merges, self.landed = self.landed, []
        for merge in merges:
            self.exchanges += 1
            merge.apply_to(self.model)
        if job is not None:
            clock.join(job)

    def step(self, clock: VirtualClock) -> None:
        """``Session.step(samples=1)`` after a training step that adds 1.0 to every weight."""
        with torch.no_grad():
            for parameter in self.model.parameters():
                parameter.add_(1.0)
        self.steps += 1
        self.samples += 1
        if self.job is not None:
            if not self.job.finished:
                return
            self.apply(clock)
        assert self.schedule is not None
        if self.schedule.due(self.steps):
            self.job = self.job_for_now(clock, self.schedule.take(self.steps), final=False)


class WarningCounter(logging.Handler):
    """Counts the Session's warnings by their first words (``fragment 3 of 16: 70 contributions
    ... wait`` counts as a backlog warning), instead of printing thousands of learners' lines."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.backlog = 0
        self.other = 0
        self.first_other = ""

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "contributions of other learners wait to be folded" in message:
            self.backlog += 1
        else:
            self.other += 1
            self.first_other = self.first_other or message[:300]


@contextmanager
def ledgers_parsed_once(keep: int) -> Iterator[None]:
    """Within the block, learners that read the same ledger share one parse (and its lines).

    Thousands of simulated learners in one process would otherwise each parse every ledger (N lines
    each) and hold their own copy of every line: CPU and memory that grow as N², where a real
    learner, alone in its process, parses each ledger once. The answer is the same (a ledger is
    never changed once written, and the parse is a function of its bytes), so nothing billed
    changes. ``keep``: the ledgers remembered, newest used last.
    """
    parse = Ledger.__dict__["from_bytes"]
    parsed: OrderedDict[tuple[Any, ...], Ledger] = OrderedDict()

    def from_bytes(cls: type[Ledger], data: bytes, *, key: str, fragment: int, fragments: int, version: int) -> Ledger:
        token = (key, fragment, fragments, version, data)
        ledger = parsed.get(token)
        if ledger is None:
            ledger = parsed[token] = parse.__func__(
                cls, data, key=key, fragment=fragment, fragments=fragments, version=version
            )
            if len(parsed) > keep:
                parsed.popitem(last=False)
        else:
            parsed.move_to_end(token)
        return ledger

    Ledger.from_bytes = classmethod(from_bytes)  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        Ledger.from_bytes = parse  # type: ignore[method-assign]


class Run:
    """One simulated run: the clock, the store, the learners, and the figures once done."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.clock = VirtualClock(threads=config.threads)
        self.inner = MemoryMailbox(f"session-sim-{uuid.uuid4().hex}")
        store = StoreModel(**{**config.store.__dict__, "body_scale": config.body_scale, "seed": config.seed})
        self.store = SimulatedStore(self.inner, self.clock, store)
        draws = random.Random(config.seed)
        self.learners = [
            self._learner(i, 1 + config.speed_spread * draws.uniform(-1, 1)) for i in range(config.learners)
        ]
        self.joined = Event(self.clock)
        self.waited = Event(self.clock)
        self.start = self.end = math.inf  # the measured window, once everyone joined
        self.folded: dict[str, int] = {}
        self.in_versions: dict[str, int] = {}
        self.chains_before = self.chains_after = (0, 0)
        self._joins = self._waits = 0
        self.warnings = WarningCounter()

    def _learner(self, index: int, speed: float) -> Learner:
        config = self.config
        model = make_model(config.real_params).to(config.wire_dtype)
        box = SimulatedMailbox(self.store)
        name = f"learner-{index}"
        exchanger = Exchanger(
            box,
            name,
            outer=resolve_outer("average"),
            wire_dtype=config.wire_dtype,
            catch_up=True,
            max_staleness_s=600.0,
        )
        plan = FragmentPlan.of(model, config.fragment_count)
        buffers: list[dict[str, torch.Tensor]] = [{} for _ in plan.fragments]
        learner = Learner(index, name, config.steps_per_s * speed, model, box, exchanger, plan, config.every)
        learner.buffers = buffers
        return learner

    def run(self) -> None:
        """Simulate the run to the last learner's exit."""
        config = self.config
        random.seed(config.seed)
        torch.manual_seed(config.seed)
        for learner in self.learners:
            at = config.every * config.join_spread * learner.index / config.learners
            self.clock.spawn(lambda learner=learner: self.life(learner), at=at, name=learner.name)
        log = logging.getLogger("gradientmail.session")
        log.addHandler(self.warnings)
        propagate, log.propagate = log.propagate, False  # thousands of learners: counted, not printed
        try:
            with ledgers_parsed_once(keep=8 * config.fragment_count):
                self.clock.run()
        finally:
            log.removeHandler(self.warnings)
            log.propagate = propagate

    def life(self, learner: Learner) -> None:
        config, clock = self.config, self.clock
        entries = float_state(learner.model)
        initial = {name: t.detach().to("cpu", accumulation_dtype(t.dtype), copy=True) for name, t in entries.items()}
        values, _ = learner.exchanger.enter(learner.plan, initial)
        for fragment, value in zip(learner.plan.fragments, values):
            fragment.load_into(learner.model, value)
        learner.exchanger.put_progress(learner.progress(finished=False))
        learner.start_schedule(config.phase_seed)
        self._joins += 1
        if self._joins == len(self.learners):  # everyone steps from the same moment on
            self.start = clock.now + 0.05
            self.joined.set()
        self.joined.wait()
        learner.before = learner.box.counters()
        learner.exchanges_before = learner.exchanges
        if learner.index == 0:
            self.chains_before = self.chain_ends()
        end = self.end = self.start + config.every * config.intervals
        phase = learner.index / len(self.learners)
        for k in range(round(config.every * config.intervals * learner.rate)):
            clock.sleep_until(self.start + (k + phase) / learner.rate)
            learner.step(clock)
        clock.sleep_until(end)
        learner.samples_at_end = learner.samples
        learner.at_end = learner.exchanges / len(learner.plan)
        if learner.index == 0:  # the run as the window closes, before any exit folds the rest
            self.folded = consensus(self.inner, make_model(config.real_params).to(config.wire_dtype))
            self.chains_after = self.chain_ends()
            self.in_versions = self.samples_in_versions()
        if learner.job is not None:
            clock.join(learner.job)
            learner.apply(clock)
        learner.after = learner.box.counters()
        learner.completed = learner.exchanges / len(learner.plan)
        learner.conflicts = learner.exchanger.conflicts
        self._waits += 1
        if self._waits == len(self.learners):
            self.waited.set()
        self.waited.wait()
        learner.job = learner.job_for_now(clock, list(range(len(learner.plan))), final=True)
        clock.join(learner.job)
        learner.apply(clock)

    def chain_ends(self) -> tuple[int, int]:
        """``(versions, pending)``: the fragments' newest version numbers summed, and the
        contributions pending, read from the store directly (no request billed)."""
        versions, pending = 0, 0
        for fragment in range(self.config.fragment_count):
            numbers = [parse_state_key(key, fragment) for key in self.inner.list(versions_prefix(fragment))]
            versions += max((n for n in numbers if n is not None), default=0)
            pending += sum(1 for _ in self.inner.list(pending_prefix(fragment)))
        return versions, pending

    def samples_in_versions(self) -> dict[str, int]:
        """``{learner: samples}`` every fragment's newest version holds: what a learner's fold
        reads from the run, without the contributions still pending (which ``consensus`` adds)."""
        held: dict[str, int] = {}
        for fragment in range(self.config.fragment_count):
            view = FragmentChain(self.inner, fragment, self.config.fragment_count, None, shards=None).view(absorb=0)
            lines = {} if view is None else view.base.learners
            for learner in self.learners:
                line = lines.get(learner.name)
                samples = 0 if line is None else line.samples
                held[learner.name] = min(held.get(learner.name, samples), samples)
        return held

    def figures(self) -> dict[str, float]:
        """The row's figures (without the ``_N`` suffix); see the module docstring."""
        config, learners = self.config, self.learners
        intended = config.intervals
        rates = [learner.at_end / intended for learner in learners]
        lags = [
            (learner.samples_at_end - self.folded.get(learner.name, 0)) / learner.rate / config.every
            for learner in learners
        ]
        per = {
            name: [
                (learner.after[column] - learner.before[column]) / scale / max(learner.completed, 1e-9)
                for learner in learners
            ]
            for name, column, scale in (
                ("requests", 0, 1),
                ("read", 1, config.model_bytes),
                ("written", 2, config.model_bytes),
            )
        }
        unabsorbed = [
            (learner.samples_at_end - self.in_versions.get(learner.name, 0)) / learner.rate / config.every
            for learner in learners
        ]
        exchanges = sum(learner.completed for learner in learners)
        conflicts = sum(learner.conflicts for learner in learners)
        final = consensus(self.inner, make_model(config.real_params).to(config.wire_dtype))
        exact = all(final.get(learner.name) == learner.samples for learner in learners)
        return {
            "exchange_rate": min(rates),
            "exchange_rate_mean": sum(rates) / len(rates),
            "lag_intervals": max(lags),
            "lag_intervals_mean": sum(lags) / len(lags),
            "versions_lag_intervals": max(unabsorbed),
            "read_per_exchange": sum(per["read"]) / len(learners),
            "read_per_exchange_max": max(per["read"]),
            "written_per_exchange": sum(per["written"]) / len(learners),
            "written_per_exchange_max": max(per["written"]),
            "requests_per_exchange": sum(per["requests"]) / len(learners),
            "conflicts": float(conflicts),
            "conflicts_per_exchange": conflicts / exchanges if exchanges else math.nan,
            "conflicts_per_fold": conflicts / (exchanges * config.fragment_count) if exchanges else math.nan,
            "reads_per_s": float(self.store.peak(READ, self.start, self.end)[1]),
            "writes_per_s": float(self.store.peak(WRITE, self.start, self.end)[1]),
            "queued_s": self.store.waited_s,
            "pending_writes": float(
                sum(
                    n
                    for (prefix, kind, _), n in self.store.per_second.items()
                    if kind == WRITE and prefix.endswith("/pending")
                )
            ),
            "exact": 1.0 if exact else 0.0,
            "fragments": float(config.fragment_count),
            "switches": float(self.clock.switches),
            "contributions_per_version": sum(
                learner.at_end * len(learner.plan) - learner.exchanges_before for learner in learners
            )
            / max(self.chains_after[0] - self.chains_before[0], 1),
            "pending_at_end": self.chains_after[1] / config.fragment_count,
            "backlog_warnings": self.warnings.backlog / (config.learners * config.fragment_count),
            "other_warnings": float(self.warnings.other),
        }


def simulate_row(config: SimConfig) -> dict[str, float]:
    """``simulate(config)``, printing the row on stderr when done (a long run's rows as they come)."""
    row = simulate(config)
    done = ", ".join(f"{header} {shape.format(row[key])}" for key, header, shape in COLUMNS)
    print(f"{config.learners} learners: {done}", file=sys.stderr, flush=True)
    return row


def simulate(config: SimConfig) -> dict[str, float]:
    """Run ``config`` on the virtual clock; its figures (see the module docstring)."""
    run = Run(config)
    started = time.perf_counter()
    try:
        run.run()
        figures = run.figures()
    finally:
        run.inner.clear()
    figures["wall_s"] = time.perf_counter() - started
    if run.warnings.other:
        print(
            f"{config.learners} learners: {run.warnings.other} warnings, the first: {run.warnings.first_other}",
            file=sys.stderr,
        )
    return figures


COLUMNS = (
    ("fragments", "fragments", "{:.0f}"),
    ("exchange_rate", "rate min", "{:.3f}"),
    ("exchange_rate_mean", "rate mean", "{:.3f}"),
    ("lag_intervals", "lag max", "{:.2f}"),
    ("versions_lag_intervals", "unabsorbed max", "{:.2f}"),
    ("read_per_exchange", "read", "{:.2f}"),
    ("written_per_exchange", "written", "{:.2f}"),
    ("requests_per_exchange", "requests", "{:.1f}"),
    ("conflicts_per_fold", "conflicts/fold", "{:.2f}"),
    ("contributions_per_version", "per version", "{:.1f}"),
    ("pending_at_end", "pending", "{:.1f}"),
    ("backlog_warnings", "warned", "{:.2f}"),
    ("reads_per_s", "reads/s/prefix", "{:.0f}"),
    ("writes_per_s", "writes/s/prefix", "{:.0f}"),
    ("exact", "exact", "{:.0f}"),
    ("wall_s", "wall s", "{:.0f}"),
)
DEFAULTS: dict[str, Any] = {
    "learners": list(LEARNERS),
    "params": 1e9,
    "every": 60.0,
    "intervals": 3.0,
    "fragments": None,
    "latency_ms": 20.0,
    "bandwidth_mbs": 100.0,
    "reads_per_s": 5500.0,
    "writes_per_s": 3500.0,
    "steps_per_s": 1.0,
    "speed_spread": 0.2,
    "seed": 0,
}


def learners_by_fragments(text: str) -> tuple[int, int]:
    """``"1024:16"`` -> ``(1024, 16)`` (``--also``)."""
    count, colon, cut = text.partition(":")
    if not (colon and count.isdigit() and cut.isdigit() and int(count) > 0 and int(cut) > 0):
        raise argparse.ArgumentTypeError(f"expected learners:fragments, such as 1024:16, not {text!r}")
    return int(count), int(cut)


def main(argv: list[str] | None = None) -> dict[str, object]:
    command = parser(__doc__)
    command.add_argument("--learners", type=int, nargs="+", help="learner counts (default 16 64 256 1024 4096)")
    command.add_argument("--params", type=float, help="the modelled model's parameters (default 1e9)")
    command.add_argument("--every", type=float, help="seconds between a learner's whole exchanges (default 60)")
    command.add_argument("--intervals", type=float, help="the measured window, in intervals (default 3)")
    command.add_argument(
        "--fragments",
        type=int,
        nargs="+",
        help="fragments: one count for every row, or one per learner count (default: what Session picks for the model)",
    )
    command.add_argument(
        "--also",
        type=learners_by_fragments,
        nargs="+",
        metavar="N:F",
        help="more rows: N learners on F fragments each, named NxF (a count of --learners on another cut)",
    )
    command.add_argument("--latency-ms", type=float, help="the store's round trip per request, ms (default 20)")
    command.add_argument("--bandwidth-mbs", type=float, help="bandwidth of one request's stream, MB/s (default 100)")
    command.add_argument("--reads-per-s", type=float, help="reads one prefix serves per second (default 5500)")
    command.add_argument("--writes-per-s", type=float, help="writes one prefix serves per second (default 3500)")
    command.add_argument("--steps-per-s", type=float, help="a learner's steps per second at speed 1 (default 1)")
    command.add_argument("--speed-spread", type=float, help="learners' speeds drawn from 1 ± this (default 0.2)")
    command.add_argument("--seed", type=int, help="the random seed of every draw (default 0)")
    command.add_argument(
        "--jobs", type=int, default=default_jobs(), help="rows simulated at once, one process each (default 2)"
    )
    args = command.parse_args(argv)
    chosen = {**DEFAULTS, **(QUICK if args.quick else {})}
    for name in DEFAULTS:
        if getattr(args, name) is not None:
            chosen[name] = getattr(args, name)
    torch.set_num_threads(1)  # thousands of tasks, one running at a time: no intra-op pool

    store = StoreModel(
        latency_s=chosen["latency_ms"] / 1000,
        bandwidth_bytes_s=chosen["bandwidth_mbs"] * 1e6,
        reads_per_s=chosen["reads_per_s"],
        writes_per_s=chosen["writes_per_s"],
    )
    counts, cuts = chosen["learners"], chosen["fragments"] or [None]
    if len(cuts) not in (1, len(counts)):
        command.error(f"--fragments takes one count or one per learner count ({len(counts)}), not {len(cuts)}")

    def config(count: int, cut: int | None) -> SimConfig:
        return SimConfig(
            learners=count,
            every=chosen["every"],
            intervals=chosen["intervals"],
            params=chosen["params"],
            fragments=cut,
            steps_per_s=chosen["steps_per_s"],
            speed_spread=chosen["speed_spread"],
            store=store,
            seed=chosen["seed"],
        )

    # Rows by their name: the learner count, or "1024x16" for a row of --also.
    configs = {
        str(count): config(count, cut) for count, cut in zip(counts, cuts * len(counts) if len(cuts) == 1 else cuts)
    }
    configs.update({f"{count}x{cut}": config(count, cut) for count, cut in args.also or []})
    # The largest rows first, each in its own process: a row's figures do not depend on where it ran.
    largest_first = sorted(configs, key=lambda name: -configs[name].learners * configs[name].fragment_count)
    rows = dict(zip(largest_first, parallel_map(simulate_row, [configs[name] for name in largest_first], args.jobs)))
    results = {name: rows[name] for name in configs}

    print(
        f"Session on a virtual clock: {chosen['params']:.3g} parameters in bfloat16 ({2 * chosen['params'] / 1e9:.3g} GB),"
        f" every {chosen['every']:g} s, {chosen['intervals']:g} intervals measured after "
        f"joining over one; store {chosen['latency_ms']:g} ms a request, {chosen['bandwidth_mbs']:g} MB/s a stream, "
        f"{chosen['reads_per_s']:g} reads and {chosen['writes_per_s']:g} writes per second per prefix; "
        f"{chosen['steps_per_s']:g} steps/s ± {chosen['speed_spread']:g}; seed {chosen['seed']}"
        f"{' (quick)' if args.quick else ''}"
    )
    rows = [
        [str(count), *(shape.format(figures[key]) for key, _, shape in COLUMNS)] for count, figures in results.items()
    ]
    print(table(["learners", *(header for _, header, _ in COLUMNS)], rows))
    print(
        "rate: completed exchanges / intended (window / every), min and mean over learners; lag: progress not yet "
        "in the run at the window's end, in intervals, worst learner; read, written: model sizes per completed "
        "exchange per learner; requests: per completed exchange; conflicts/fold: versions lost per fragment "
        "exchange; reads/s, writes/s: the busiest prefix's busiest second; exact: every sample in the run once "
        "after the exits; wall s: this machine's seconds"
    )
    figures: dict[str, object] = {
        f"session_sim_{key}_{count}": value for count, row in results.items() for key, value in row.items()
    }
    for line in verdicts({name: value for name, value in figures.items() if isinstance(value, float)}):
        print(line)
    figures.update(
        {name: chosen[name] for name in DEFAULTS if name != "learners"},
        learners=list(chosen["learners"]),
        also=[f"{count}:{cut}" for count, cut in args.also or []],
    )
    emit(figures)
    return figures


if __name__ == "__main__":
    main()
