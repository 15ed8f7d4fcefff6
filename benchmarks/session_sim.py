"""The Session at 16 to 4,096 learners on a virtual clock: S3's figures, a 1B-parameter model.

Each learner runs the Session's real exchange code (``session.exchange.Exchanger``: enter, the
folds with their listings, pending contributions and retirement, leave) as cooperative tasks on a
``VirtualClock``, against a ``SimulatedStore`` (per-request latency, bandwidth per stream, request
limits per prefix). Models of billions of parameters cannot be held by thousands of learners: each
learner holds a tiny real model (``--real-params``) cut into the fragments the modelled one would
have, and the store bills every tensor body at the modelled size (``StoreModel.body_scale``). CPU
is not billed: virtual time passes only in the store and between steps.

Thousands of learners on hundreds of fragments make millions of folds an interval; a row can
simulate some of the fragments (``--simulate S``, spread evenly over the cut). A fragment's chain
shares nothing with another's but its learners' time: every learner still folds every fragment on
its schedule, and a fold of a fragment not simulated is a wait as long as a simulated fold drawn
from the run's recent ones (``FoldDurations``). The simulated chains then see the whole run's
traffic, and the figures are theirs scaled to a whole exchange; what depends on how many
fragments are seen (the busiest prefix, the worst learner's unabsorbed lag) is taken over the
simulated ones only.

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
[--params 1e9] [--every 60] [--intervals 3] [--fragments F ...] [--simulate S ...] [--also N:F[:S] ...]
[--latency-ms 20] [--bandwidth-mbs 100]
[--reads-per-s 5500] [--writes-per-s 3500] [--steps-per-s 1] [--speed-spread 0.2] [--seed 0]``.
``--quick`` (CI: 4 and 8 learners, a few seconds) judges nothing. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import logging
import math
import random
import resource
import sys
import time
import uuid
from collections import OrderedDict, deque
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
from gradientmail.layout import MEMBERS_PREFIX, parse_state_key, pending_prefix, versions_prefix
from gradientmail.mailbox import Mailbox
from gradientmail.session import consensus, exchange
from gradientmail.session.chain import FragmentChain
from gradientmail.session.exchange import Exchanger, FoldLanes, Merge
from gradientmail.session.fragments import FragmentPlan, accumulation_dtype, auto_fragments, float_state
from gradientmail.session.mail import Ledger
from gradientmail.session.members import Members
from gradientmail.session.outer import resolve_outer
from gradientmail.session.overlap import parallel
from gradientmail.session.schedule import Schedule

LEARNERS = (16, 64, 256)
"""The rows of a plain run (a few minutes); `python -m benchmarks --full` adds 1,024 and 4,096 learners
on more fragments (``benchmarks.__main__.FULL_OPTIONS``)."""
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
        simulated: how many fragments run the real protocol (spread evenly over the cut; None or
            more than the cut: all). Every learner still folds every fragment on its schedule; a
            fold of a fragment not simulated is a wait as long as a simulated fold drawn from the
            run's recent ones (``FoldDurations``). Fragments' chains share nothing but their
            learners' time, so the simulated ones see the traffic of the full run.
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
    simulated: int | None = None

    def __post_init__(self) -> None:
        if self.learners < 1 or self.every <= 0 or self.intervals <= 0 or self.steps_per_s <= 0:
            raise ValueError(f"a run needs learners >= 1 and every, intervals, steps_per_s > 0: {self}")
        if not 1 <= self.real_params <= self.params:
            raise ValueError(f"real_params must be in [1, params]: {self.real_params} for {self.params:g}")
        if not 0 <= self.speed_spread < 1:
            raise ValueError(f"speed_spread must be in [0, 1), not {self.speed_spread}")
        if self.wire_dtype not in WIRE_BYTES:
            raise ValueError(f"wire_dtype must be torch.float32 or torch.bfloat16, not {self.wire_dtype}")
        if self.simulated is not None and self.simulated < 1:
            raise ValueError(f"simulated must be at least 1 fragment (None: all), not {self.simulated}")

    @property
    def simulated_fragments(self) -> tuple[int, ...]:
        """The fragments whose chains run the real protocol, spread evenly over the cut."""
        count = self.fragment_count
        kept = count if self.simulated is None else min(self.simulated, count)
        return tuple(i * count // kept for i in range(kept))

    @property
    def simulated_share(self) -> float:
        """The simulated fragments' share of the model (what a learner's bytes are scaled by)."""
        return len(self.simulated_fragments) / self.fragment_count

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
    landed: list[Merge | None] = field(default_factory=list)
    """The running job's folds, in order: a merge, or None for a fragment not simulated."""
    schedule: Schedule | None = None
    buffers: list[dict[str, torch.Tensor]] = field(default_factory=list)
    before: tuple[int, float, float] = (0, 0.0, 0.0)
    after: tuple[int, float, float] = (0, 0.0, 0.0)
    samples_at_end: int = 0
    at_end: float = 0.0
    completed: float = 0.0
    conflicts: int = 0
    merged: int = 0
    """Folds of simulated fragments applied (``exchanges`` counts every fragment's)."""
    merged_before: int = 0
    merged_at_end: int = 0
    weights: list[torch.nn.Parameter] = field(default_factory=list)
    """The model's parameters, listed once (a step adds 1.0 to each)."""
    stood_in: dict[int, int] = field(default_factory=dict)
    """A fragment not simulated -> the samples its latest fold (a wait) would have put in the run."""
    count: int = 0
    """Fragments in the run's cut (the schedule's); ``plan`` holds the simulated ones."""
    positions: dict[int, int] = field(default_factory=dict)
    """A simulated fragment's index in the cut -> its index in ``plan``."""
    durations: FoldDurations | None = None
    lanes: FoldLanes = field(default_factory=FoldLanes)  # its folds at once, by their virtual durations

    def start_schedule(self, phase_seed: int | None) -> None:
        """A random phase, as ``Session`` starts one on entering: its own ``Schedule``, on the
        virtual clock (read through ``time.monotonic`` at each call, which the clock patches),
        drawn from the run's seeded generator or ``session_scale.phase_generator(phase_seed, index)``."""
        self.schedule = Schedule(
            self.count,
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
        """Snapshot ``indices`` (of the cut) now and fold them in a background task (``Session``'s
        job); a fragment not simulated is a wait as long as a simulated fold."""
        positions = [(i, self.positions.get(i)) for i in indices]
        snapshots = [
            (i, p, None if p is None else self.plan.fragments[p].snapshot_into(self.buffers[p], self.model))
            for i, p in positions
        ]
        taken, totals = time.monotonic(), (self.steps, self.samples)
        progress = self.progress(finished=final) if final or self.count - 1 in indices else None
        exchanger, durations, lanes = self.exchanger, self.durations, self.lanes
        assert durations is not None
        assert self.schedule is not None
        width = lanes.for_job(len(snapshots), self.schedule.slot_s)

        def fold(item: tuple[int, int | None, dict[str, torch.Tensor] | None]) -> None:
            index, position, snapshot = item
            if position is None or snapshot is None:
                drawn = durations.draw()
                clock.sleep(drawn)
                lanes.folded(drawn)
                self.stood_in[index] = totals[1]
                self.landed.append(None)
                return
            began = clock.now
            self.landed.append(exchanger.exchange(position, snapshot, totals, final, taken))
            durations.record(clock.now - began)
            lanes.folded(clock.now - began)

        def job() -> None:
            parallel(fold, snapshots, lanes=width)  # as Session's job: as many folds at once
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
            if merge is not None:
                self.merged += 1
                merge.apply_to(self.model)
        if job is not None:
            clock.join(job)

    def step(self, clock: VirtualClock) -> None:
        """``Session.step(samples=1)`` after a training step that adds 1.0 to every weight."""
        if not self.weights:
            self.weights = list(self.model.parameters())
        with torch.no_grad():
            torch._foreach_add_(self.weights, 1.0)
        self.steps += 1
        self.samples += 1
        if self.job is not None:
            if not self.job.finished:
                return
            self.apply(clock)
        assert self.schedule is not None
        if self.schedule.due(self.steps):
            self.job = self.job_for_now(clock, self.schedule.take(self.steps), final=False)


class FoldDurations:
    """The run's recent simulated folds' durations (virtual seconds), from which each fold of a
    fragment not simulated draws its wait: those folds take the learners' time as the simulated
    ones do, with their spread (a claim holder's long fold, a quick one), not only their mean."""

    def __init__(self, first_guess_s: float, seed: int, keep: int = 256) -> None:
        self.recent: deque[float] = deque(maxlen=keep)
        self.first_guess_s = first_guess_s
        self.draws = random.Random(seed)

    def record(self, seconds: float) -> None:
        self.recent.append(seconds)

    def draw(self) -> float:
        """A recent simulated fold's duration (before the first: ``first_guess_s``)."""
        return self.draws.choice(self.recent) if self.recent else self.first_guess_s


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


@contextmanager
def members_listed_once() -> Iterator[None]:
    """Within the block, learners whose listings of the members find the same keys share one
    ``Members`` (each learner's listing is still made and billed).

    Once everyone joined, every listing finds the same keys: thousands of simulated learners would
    otherwise each hold their own copy of the run's member list, N² entries, where a real learner
    holds one. ``Members`` is not changed once listed, so the answer is the same.
    """
    listed: dict[tuple[str, ...], Members] = {}

    def list_members(mailbox: Mailbox) -> Members:
        keys = tuple(mailbox.list(MEMBERS_PREFIX))
        members = listed.get(keys)
        if members is None:
            members = Members()
            for key in keys:
                members.add(key)
            listed.clear()  # the newest only: the list changes when someone joins or leaves
            listed[keys] = members
        return members

    real = exchange.list_members
    exchange.list_members = list_members  # type: ignore[assignment]
    try:
        yield
    finally:
        exchange.list_members = real  # type: ignore[assignment]


class Run:
    """One simulated run: the clock, the store, the learners, and the figures once done."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.clock = VirtualClock(threads=config.threads)
        self.inner = MemoryMailbox(f"session-sim-{uuid.uuid4().hex}")
        store = StoreModel(**{**config.store.__dict__, "body_scale": config.body_scale, "seed": config.seed})
        self.store = SimulatedStore(self.inner, self.clock, store)
        draws = random.Random(config.seed)
        fragment_bytes = config.model_bytes / config.fragment_count
        self.durations = FoldDurations(  # a read and a write of one fragment, three round trips
            3 * store.latency_s + 2 * fragment_bytes / store.bandwidth_bytes_s, config.seed
        )
        self.learners = [
            self._learner(i, 1 + config.speed_spread * draws.uniform(-1, 1)) for i in range(config.learners)
        ]
        self.joined = Event(self.clock)
        self.waited = Event(self.clock)
        self.start = self.end = math.inf  # the measured window, once everyone joined
        self.folded: dict[str, int] = {}
        self.in_versions: dict[str, int] = {}
        self.chains_before = self.chains_after = (0, 0)
        self._joins = self._waits = self._exits = 0
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
        cut = FragmentPlan.of(model, config.fragment_count)
        simulated = config.simulated_fragments
        plan = (
            cut
            if len(simulated) == len(cut)
            else FragmentPlan(tuple(cut.fragments[i] for i in simulated), cut.dtypes, count=len(cut))
        )
        learner = Learner(index, name, config.steps_per_s * speed, model, box, exchanger, plan, config.every)
        learner.buffers = [{} for _ in plan.fragments]
        learner.count = len(cut)
        learner.positions = {fragment: position for position, fragment in enumerate(simulated)}
        learner.durations = self.durations
        return learner

    def run(self) -> None:
        """Simulate the run to the last learner's exit."""
        config = self.config
        random.seed(config.seed)
        torch.manual_seed(config.seed)
        for learner in self.learners:
            at = config.every * config.join_spread * learner.index / config.learners
            self.clock.spawn(lambda learner=learner: self.life(learner), at=at, name=learner.name)
        self.clock.spawn(self.report, name="report")
        log = logging.getLogger("gradientmail.session")
        log.addHandler(self.warnings)
        propagate, log.propagate = log.propagate, False  # thousands of learners: counted, not printed
        try:
            with ledgers_parsed_once(keep=8 * len(config.simulated_fragments)), members_listed_once():
                self.clock.run()
        finally:
            log.removeHandler(self.warnings)
            log.propagate = propagate

    def report(self, every_s: float = 60.0) -> None:
        """While learners live, print on stderr where a long row is, at most once a minute of
        this machine's time: the virtual time, the window's, and the memory held."""
        config, clock = self.config, self.clock
        began = last = time.perf_counter()
        while self._exits < len(self.learners):
            clock.sleep(config.every / 20)
            if time.perf_counter() - last >= every_s:
                last = time.perf_counter()
                where = (
                    "joining" if math.isinf(self.start) else f"{(clock.now - self.start) / config.every:.2f} intervals"
                )
                held = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
                print(
                    f"{config.learners} learners: {where} ({clock.now:.0f} s virtual) after {last - began:.0f} s, "
                    f"{held:.1f} GB at most",
                    file=sys.stderr,
                    flush=True,
                )

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
        learner.merged_before = learner.merged
        if learner.index == 0:
            self.chains_before = self.chain_ends()
        end = self.end = self.start + config.every * config.intervals
        phase = learner.index / len(self.learners)
        for k in range(round(config.every * config.intervals * learner.rate)):
            clock.sleep_until(self.start + (k + phase) / learner.rate)
            learner.step(clock)
        clock.sleep_until(end)
        learner.samples_at_end = learner.samples
        learner.at_end = learner.exchanges / learner.count
        learner.merged_at_end = learner.merged
        if learner.index == 0:  # the run as the window closes, before any exit folds the rest
            self.folded = self.consensus()
            stood_in = config.fragment_count - len(config.simulated_fragments)
            for each in self.learners:  # and what the waits that stood in for folds would hold
                if stood_in:
                    held = min(each.stood_in.values()) if len(each.stood_in) == stood_in else 0
                    self.folded[each.name] = min(self.folded.get(each.name, 0), held)
            self.chains_after = self.chain_ends()
            self.in_versions = self.samples_in_versions()
        if learner.job is not None:
            clock.join(learner.job)
            learner.apply(clock)
        learner.after = learner.box.counters()
        learner.completed = learner.exchanges / learner.count
        learner.conflicts = learner.exchanger.conflicts
        self._waits += 1
        if self._waits == len(self.learners):
            self.waited.set()
        self.waited.wait()
        learner.job = learner.job_for_now(clock, list(range(learner.count)), final=True)
        clock.join(learner.job)
        learner.apply(clock)
        self._exits += 1

    def chain_ends(self) -> tuple[int, int]:
        """``(versions, pending)``: the fragments' newest version numbers summed, and the
        contributions pending, read from the store directly (no request billed)."""
        versions, pending = 0, 0
        for fragment in self.config.simulated_fragments:
            numbers = [parse_state_key(key, fragment) for key in self.inner.list(versions_prefix(fragment))]
            versions += max((n for n in numbers if n is not None), default=0)
            pending += sum(1 for _ in self.inner.list(pending_prefix(fragment)))
        return versions, pending

    def samples_in_versions(self) -> dict[str, int]:
        """``{learner: samples}`` every fragment's newest version holds: what a learner's fold
        reads from the run, without the contributions still pending (which ``consensus`` adds)."""
        held: dict[str, int] = {}
        for fragment in self.config.simulated_fragments:
            view = FragmentChain(self.inner, fragment, self.config.fragment_count, None, shards=None).view(absorb=0)
            lines = {} if view is None else view.base.learners
            for learner in self.learners:
                line = lines.get(learner.name)
                samples = 0 if line is None else line.samples
                held[learner.name] = min(held.get(learner.name, samples), samples)
        return held

    def consensus(self) -> dict[str, int]:
        """``{learner: samples}`` every simulated fragment holds (``consensus``, when all are)."""
        config = self.config
        if len(config.simulated_fragments) == config.fragment_count:
            return consensus(self.inner, make_model(config.real_params).to(config.wire_dtype))
        tables = []
        for fragment in config.simulated_fragments:
            view = FragmentChain(self.inner, fragment, config.fragment_count, None, shards=None).view(exact=True)
            tables.append({} if view is None else view.table)
        names = set().union(*tables)
        return {name: min(table[name].samples if name in table else 0 for table in tables) for name in names}

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
            for name, column, scale in (  # the simulated fragments' share of a whole exchange
                ("requests", 0, config.simulated_share),
                ("read", 1, config.model_bytes * config.simulated_share),
                ("written", 2, config.model_bytes * config.simulated_share),
            )
        }
        unabsorbed = [
            (learner.samples_at_end - self.in_versions.get(learner.name, 0)) / learner.rate / config.every
            for learner in learners
        ]
        exchanges = sum(learner.completed for learner in learners)
        conflicts = sum(learner.conflicts for learner in learners)
        simulated = len(config.simulated_fragments)
        final = self.consensus()
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
            "conflicts_per_exchange": conflicts / config.simulated_share / exchanges if exchanges else math.nan,
            "conflicts_per_fold": conflicts / (exchanges * simulated) if exchanges else math.nan,
            "reads_per_s": float(self.store.peak(READ, self.start, self.end)[1]),
            "writes_per_s": float(self.store.peak(WRITE, self.start, self.end)[1]),
            "queued_s": self.store.waited_s,
            "pending_writes": float(
                sum(
                    n
                    for (prefix, kind, _), n in self.store.per_second.items()
                    if kind == WRITE and prefix.endswith("/pending")
                )
                / config.simulated_share
            ),
            "exact": 1.0 if exact else 0.0,
            "fragments": float(config.fragment_count),
            "switches": float(self.clock.switches),
            "contributions_per_version": sum(learner.merged_at_end - learner.merged_before for learner in learners)
            / max(self.chains_after[0] - self.chains_before[0], 1),
            "pending_at_end": self.chains_after[1] / simulated,
            "backlog_warnings": self.warnings.backlog / (config.learners * simulated),
            "simulated_fragments": float(simulated),
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
    busiest = [run.store.peak(kind, run.start, run.end)[0] for kind in (READ, WRITE)]
    print(
        f"{config.learners} learners: busiest prefixes {busiest[0]!r} (reads), {busiest[1]!r} (writes)", file=sys.stderr
    )
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


def learners_by_fragments(text: str) -> tuple[int, int, int | None]:
    """``"1024:16"`` -> ``(1024, 16, None)``, ``"1024:64:4"`` -> ``(1024, 64, 4)`` (``--also``)."""
    parts = text.split(":")
    if not (2 <= len(parts) <= 3 and all(part.isdigit() and int(part) > 0 for part in parts)):
        raise argparse.ArgumentTypeError(
            f"expected learners:fragments or learners:fragments:simulated, such as 1024:16 or 1024:64:4, not {text!r}"
        )
    count, cut, *simulated = (int(part) for part in parts)
    return count, cut, simulated[0] if simulated else None


def row_name(count: int, cut: int, simulated: int | None) -> str:
    """A row of ``--also``: ``1024x16``, or ``1024x64s4`` when 4 of its fragments are simulated."""
    return f"{count}x{cut}" + ("" if simulated is None or simulated >= cut else f"s{simulated}")


def main(argv: list[str] | None = None) -> dict[str, object]:
    command = parser(__doc__)
    command.add_argument("--learners", type=int, nargs="+", help="learner counts (default 16 64 256)")
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
        help="more rows: N learners on F fragments each, named NxF (a count of --learners on another cut); "
        "N:F:S simulates S of the F fragments, named NxFsS",
    )
    command.add_argument(
        "--simulate",
        type=int,
        nargs="+",
        help="fragments whose chains are simulated, the others' folds standing in as waits: one count for every "
        "row, or one per learner count (default: all)",
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
    counts, cuts, simulated = chosen["learners"], chosen["fragments"] or [None], args.simulate or [None]
    for option, given in (("--fragments", cuts), ("--simulate", simulated)):
        if len(given) not in (1, len(counts)):
            command.error(f"{option} takes one count or one per learner count ({len(counts)}), not {len(given)}")
    if any(each is not None and each < 1 for each in simulated):
        command.error(f"--simulate takes counts of at least 1 fragment, not {simulated}")

    def config(count: int, cut: int | None, kept: int | None = None) -> SimConfig:
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
            simulated=kept,
        )

    # Rows by their name: the learner count, or "1024x16" for a row of --also.
    configs = {
        str(count): config(count, cut, kept)
        for count, cut, kept in zip(
            counts,
            cuts * len(counts) if len(cuts) == 1 else cuts,
            simulated * len(counts) if len(simulated) == 1 else simulated,
        )
    }
    configs.update({row_name(*row): config(*row) for row in args.also or []})
    # The largest rows first, each in its own process: a row's figures do not depend on where it ran.
    largest_first = sorted(configs, key=lambda name: -configs[name].learners * len(configs[name].simulated_fragments))
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
        also=[":".join(str(part) for part in row if part is not None) for row in args.also or []],
        simulate=args.simulate,
    )
    emit(figures)
    return figures


if __name__ == "__main__":
    main()
