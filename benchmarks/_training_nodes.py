"""The processes of ``benchmarks.training``: the data, the model, the training nodes, the monitor.

Everything a node needs travels in a picklable ``NodeConfig``/``MonitorConfig``; the corpus
travels as two files (``train.bin``, ``val.bin``) that the parent writes once, so a node starts
in a fraction of a second (the parent starts nodes from a ``forkserver`` that imported this
module, and with it torch, once).

A node reports by writing ``result-{name}.json`` in its run folder: its start and end times
(``time.time()``, one clock for every process of this machine), what it trained and the
checkpoints it saved, or ``{"error": traceback}``. Nodes of one run start together on a start
line (files in the run folder; DDP ranks on a barrier), so that their speeds, not their start-up,
decide who trains what. Every loop here is bounded: by the units, by a deadline, or both.
"""

from __future__ import annotations

import functools
import gc
import inspect
import json
import statistics
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from gradientmail.mailbox.wrappers import CountingMailbox

CONTEXT = 64
"""Bytes of context; the model predicts the byte that follows them."""
VOCAB = 256
EMBED = 16
HIDDEN = 320
BATCH = 32
LEARNING_RATE = 2e-3
MODEL_SEED = 0
POSITIONS_SEED = 1
VALIDATION_SEED = 7
VALIDATION_CONTEXTS = 4096
STOP_KEY = "bench/stop"
"""The monitor's stop marker, a mailbox key: nodes on other machines would see it too."""
DONE_PREFIX = "bench/done/"
"""``bench/done/{learner}``: the node has left its Session (its progress is in the run)."""
OUTERS = ("delayed_nesterov", "average")
"""Outer optimizers the benchmark compares (``Session(outer=...)``); the first is the default."""
WIRE_VARIANTS = ("delayed_nesterov+bf16", "delayed_nesterov+int8")
"""The default outer with the run's state in bfloat16 (``Session(wire_dtype=torch.bfloat16)``),
and with it rounded as an 8-bit blockwise wire would (``benchmarks._int8_wire``, simulated)."""


@dataclass(frozen=True)
class Plan:
    """The sizes of one benchmark: the full one or ``--quick``."""

    units: int  # units of one pass
    unit_batches: int  # batches of BATCH contexts per unit
    sleeps: tuple[float, ...]  # seconds per batch of each node (its emulated speed)
    every_s: float | None  # Session exchange interval; None until benchmarks.training derives it
    monitor_s: float  # consensus evaluations, time-to-quality runs
    checkpoint_s: float  # checkpoints of single/ddp/fixed_split, for the chart
    timeout_s: float  # longest a run may take, start-up included

    @property
    def nodes(self) -> int:
        return len(self.sleeps)

    @property
    def batches(self) -> int:
        """Batches of one pass."""
        return self.units * self.unit_batches

    @property
    def contexts(self) -> int:
        """Training contexts of one pass (every pass trains on the same ones)."""
        return self.units * self.unit_batches * BATCH


@dataclass(frozen=True)
class NodeConfig:
    """One training process. ``method``: single, ddp, fixed_split or gradientmail."""

    method: str
    name: str  # result-{name}.json; the learner id for gradientmail
    rank: int
    world: int
    data_dir: str  # train.bin, val.bin
    run_dir: str  # start line, results, checkpoints, mailbox/ of this run
    plan: Plan
    sleep_s: float
    units: tuple[int, ...] = ()  # pass-1 unit indices (single, ddp, fixed_split)
    passes: int = 1  # gradientmail: units of passes 1..passes in one queue
    outer: str | None = None  # gradientmail: Session(outer=...) when Session has it
    checkpoints: bool = False
    group_size: int = 1  # groups: ranks per learner (DDP inside); rank // group_size is its group


@dataclass(frozen=True)
class MonitorConfig:
    """The monitor of a time-to-quality run: evaluates the consensus until the target or the end."""

    name: str
    run_dir: str
    data_dir: str
    plan: Plan
    nodes: int
    target: float | None  # stop the nodes at this validation loss; None: never
    deadline_s: float


# -- data ----------------------------------------------------------------------------------------


def read_bytes(path: Path) -> Tensor:
    """A byte-token file (``gradientmail.data``), whole, as ``uint8``: the corpus is small, and
    contexts are drawn at random positions, so it is read once rather than in ranges."""
    from gradientmail.data import TokenReader

    with TokenReader(path, seq_len=CONTEXT, dtype="uint16", vocab_size=256) as reader:
        return reader.tokens(0, reader.num_tokens).to(torch.uint8)


def contexts_at(corpus: Tensor, positions: Tensor) -> Tensor:
    """``[len(positions), CONTEXT + 1]`` int64: each row a context and the byte after it."""
    return corpus[positions[:, None] + torch.arange(CONTEXT + 1)].long()


class TrainingData:
    """The training set: ``plan.contexts`` fixed positions in the corpus, cut into units.

    Pass 1 takes the positions in their drawn (random) order, pass ``p`` > 1 in a permutation of
    its own, so a later pass is the same data in another order. A unit's batches depend only on
    its pass and index, so any node can load any unit.
    """

    def __init__(self, data_dir: str | Path, plan: Plan) -> None:
        self.corpus = read_bytes(Path(data_dir) / "train.bin")
        self.plan = plan
        generator = torch.Generator().manual_seed(POSITIONS_SEED)
        self.positions = torch.randint(0, len(self.corpus) - CONTEXT, (plan.contexts,), generator=generator)
        self._orders: dict[int, Tensor] = {}

    def order(self, pass_: int) -> Tensor:
        if pass_ == 1:
            return torch.arange(self.plan.contexts)
        if pass_ not in self._orders:
            generator = torch.Generator().manual_seed(POSITIONS_SEED + pass_)
            self._orders[pass_] = torch.randperm(self.plan.contexts, generator=generator)
        return self._orders[pass_]

    def load(self, unit: tuple[int, int]) -> Iterator[tuple[int, Tensor]]:
        """The batches of unit ``(pass, index)``, labelled with their global step."""
        pass_, index = unit
        size = self.plan.unit_batches * BATCH
        rows = self.order(pass_)[index * size : (index + 1) * size]
        contexts = contexts_at(self.corpus, self.positions[rows])
        first = ((pass_ - 1) * self.plan.units + index) * self.plan.unit_batches
        for offset, batch in enumerate(contexts.split(BATCH)):
            yield first + offset, batch


def unit_id(pass_: int, index: int) -> str:
    return f"p{pass_}-{index:04d}"


def unit_table(plan: Plan, passes: int) -> dict[str, tuple[int, int]]:
    """The shared queue's units, pass 1 first: ``{"p1-0000": (1, 0), ...}``."""
    return {unit_id(p, i): (p, i) for p in range(1, passes + 1) for i in range(plan.units)}


def validation_set(data_dir: str | Path) -> Tensor:
    """``VALIDATION_CONTEXTS`` fixed contexts from the held-out files: the same for every method."""
    corpus = read_bytes(Path(data_dir) / "val.bin")
    generator = torch.Generator().manual_seed(VALIDATION_SEED)
    positions = torch.randint(0, len(corpus) - CONTEXT, (VALIDATION_CONTEXTS,), generator=generator)
    return contexts_at(corpus, positions)


# -- model ----------------------------------------------------------------------------------------


class ByteMLP(torch.nn.Module):
    """Next-byte prediction from 64 bytes: embedding, one GELU layer (414k parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, EMBED)
        self.hidden = torch.nn.Linear(CONTEXT * EMBED, HIDDEN)
        self.out = torch.nn.Linear(HIDDEN, VOCAB)

    def forward(self, contexts: Tensor) -> Tensor:
        return self.out(torch.nn.functional.gelu(self.hidden(self.embed(contexts).flatten(1))))


def make_model() -> ByteMLP:
    """The same initial parameters in every process and for every method."""
    torch.manual_seed(MODEL_SEED)
    return ByteMLP()


def batch_loss(model: torch.nn.Module, batch: Tensor) -> Tensor:
    return torch.nn.functional.cross_entropy(model(batch[:, :CONTEXT]), batch[:, CONTEXT])


@torch.no_grad()
def validation_loss(model: torch.nn.Module, validation: Tensor) -> float:
    """Mean cross-entropy (nats per byte) over the validation contexts."""
    total = 0.0
    for chunk in validation.split(1024):
        total += float(batch_loss(model, chunk)) * len(chunk)
    return total / len(validation)


# -- helpers of every node ------------------------------------------------------------------------


def start_line(run_dir: Path, rank: int, count: int, timeout_s: float = 120.0) -> float:
    """Wait until ``count`` nodes reached the line; return this node's start time."""
    line = run_dir / "ready"
    line.mkdir(exist_ok=True)
    (line / str(rank)).touch()
    deadline = time.monotonic() + timeout_s
    while sum(1 for _ in line.iterdir()) < count:
        if time.monotonic() > deadline:
            raise TimeoutError("the other nodes never reached the start line")
        time.sleep(0.002)
    return time.time()


def pad(began: float, seconds: float) -> None:
    """Emulate a slower machine: a batch takes at least ``seconds`` from ``began`` (monotonic)."""
    left = began + seconds - time.monotonic()
    if left > 0:
        time.sleep(left)


class Checkpoints:
    """Saves the model every ``interval`` seconds from ``start``, for the loss-over-time chart.

    A save costs a few milliseconds once per interval; the parent evaluates them after the run.
    """

    def __init__(self, config: NodeConfig, model: torch.nn.Module, start: float) -> None:
        self.enabled = config.checkpoints
        self.directory = Path(config.run_dir) / "checkpoints"
        self.directory.mkdir(exist_ok=True)
        self.prefix = config.name
        self.model = model
        self.start = start
        self.interval = config.plan.checkpoint_s
        self.saved: list[tuple[float, str]] = []  # (time.time() at the save, path)

    def maybe_save(self) -> None:
        if self.enabled and time.time() >= self.start + (len(self.saved) + 1) * self.interval:
            self.save()

    def save(self) -> None:
        if not self.enabled:
            return
        path = self.directory / f"{self.prefix}-{len(self.saved):04d}.pt"
        at = time.time()
        torch.save(self.model.state_dict(), path)
        self.saved.append((at, str(path)))


def adam(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=LEARNING_RATE)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Tensor) -> None:
    batch_loss(model, batch).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def measure_step_s(data_dir: str | Path, plan: Plan, steps: int = 40, warmup: int = 5) -> float:
    """Seconds of one unpadded training step (forward, backward, Adam) on this thread: the
    median of ``steps`` timed steps after ``warmup``, on the benchmark's own model and batches."""
    data = TrainingData(data_dir, plan)
    model = make_model()
    optimizer = adam(model)
    batches = [batch for _, batch in data.load((1, 0))]  # cycled: the data barely matters here
    times = []
    for step in range(warmup + steps):
        began = time.perf_counter()
        train_step(model, optimizer, batches[step % len(batches)])
        if step >= warmup:
            times.append(time.perf_counter() - began)
    return statistics.median(times)


# -- the methods ----------------------------------------------------------------------------------


def run_fixed(
    config: NodeConfig, model: torch.nn.Module, data: TrainingData, start: float, net: torch.nn.Module | None = None
) -> dict[str, Any]:
    """Train on this node's fixed units in order (single, fixed_split and each DDP rank).

    ``net`` is what the batches go through (the DDP wrapper), ``model`` what is checkpointed.
    The data is read before the start, as every method does, so the makespans compare training.
    """
    optimizer = adam(model)
    net = model if net is None else net
    checkpoints = Checkpoints(config, model, start)
    batches = 0
    for index in config.units:
        for _, batch in data.load((1, index)):
            began = time.monotonic()
            train_step(net, optimizer, batch)
            batches += 1
            checkpoints.maybe_save()
            pad(began, config.sleep_s)
    end = time.time()
    checkpoints.save()
    torch.save(model.state_dict(), Path(config.run_dir) / f"final-{config.name}.pt")
    return {"batches": batches, "units": len(config.units), "end": end, "checkpoints": checkpoints.saved}


def single(config: NodeConfig) -> dict[str, Any]:
    model, data = make_model(), TrainingData(config.data_dir, config.plan)
    start = time.time()
    return {"start": start, **run_fixed(config, model, data, start)}


def fixed_split(config: NodeConfig) -> dict[str, Any]:
    model, data = make_model(), TrainingData(config.data_dir, config.plan)
    start = start_line(Path(config.run_dir), config.rank, config.world)
    return {"start": start, **run_fixed(config, model, data, start)}


def in_process_group(
    config: NodeConfig, store: str, rank: int, world: int, run: Callable[[], dict[str, Any]]
) -> dict[str, Any]:
    """``run()`` inside a gloo group of ``world`` ranks (``store`` in the run folder), torn down after.

    What ``run`` built (its DDP model) is freed before ``destroy_process_group()``: a DDP model
    freed after it drops the group's last reference while holding the GIL and joins gloo's
    threads, one of which may need the GIL to let go of a collective's tensors (torch), and the
    process hangs at exit.
    """
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"file://{Path(config.run_dir) / store}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=120),
    )
    try:
        result = run()
        gc.collect()  # a DDP model in a reference cycle goes now, while the group lives
        return result
    finally:
        dist.destroy_process_group()


def ddp(config: NodeConfig) -> dict[str, Any]:
    """One rank of ``DistributedDataParallel`` over gloo: gradients all-reduced every step.

    Each rank pads its step to its own speed after ``optimizer.step()``; the all-reduce waits
    for the slowest rank, so every step takes the slowest rank's time (its communication hides
    inside that rank's pad, which flatters DDP on this machine).
    """
    return in_process_group(config, "ddp-store", config.rank, config.world, lambda: _ddp_rank(config))


def _ddp_rank(config: NodeConfig) -> dict[str, Any]:
    import torch.distributed as dist

    model, data = make_model(), TrainingData(config.data_dir, config.plan)
    wrapped = torch.nn.parallel.DistributedDataParallel(model)
    if config.rank != 0:  # every rank holds the same model: rank 0 checkpoints it
        config = replace(config, checkpoints=False)
    dist.barrier()
    start = time.time()
    result = run_fixed(config, model, data, start, net=wrapped)
    dist.barrier()
    return {"start": start, **result}


def session_options(outer: str | None) -> dict[str, Any]:
    """``Session`` keywords for a variant name: ``"average"``, or ``"delayed_nesterov+bf16"`` for
    that outer with the run's state kept in bfloat16 (``wire_dtype``). Nothing for older code."""
    from gradientmail import Session

    if outer is None or "outer" not in inspect.signature(Session).parameters:
        return {}
    if not isinstance(outer, str):  # an OuterOptimizer object (experiments)
        return {"outer": outer}
    name, _, wire = outer.partition("+")
    options: dict[str, Any] = {"outer": name}
    if wire == "bf16":
        options["wire_dtype"] = torch.bfloat16
    elif wire != "int8" and wire:  # int8: the mailbox rounds (session_mailbox), not the Session
        raise ValueError(f"unknown wire variant {wire!r} in {outer!r}")
    return options


def session_mailbox(outer: str | None, box: Any) -> Any:
    """The mailbox the Session writes through: ``box``, or ``Int8Wire(box)`` for ``+int8``."""
    if isinstance(outer, str) and outer.partition("+")[2] == "int8":
        from benchmarks._int8_wire import Int8Wire

        return Int8Wire(box)
    return box


def gradientmail(config: NodeConfig) -> dict[str, Any]:
    """The documented loop: ``shared_queue`` + ``Session``; leaves early on the stop marker."""
    from gradientmail import LocalMailbox, Session, units_claimed_by
    from gradientmail.patterns.shared_queue import shared_queue

    box = LocalMailbox(Path(config.run_dir) / "mailbox")
    data = TrainingData(config.data_dir, config.plan)
    if config.plan.every_s is None:
        raise ValueError("plan.every_s is None: benchmarks.training derives it before starting nodes")
    model = make_model()
    optimizer = adam(model)
    wire = session_mailbox(config.outer, box)
    counting = CountingMailbox(wire)  # the Session's traffic, in model sizes per exchange
    session = Session(
        model,
        mailbox=counting,
        learner_id=config.name,
        every=timedelta(seconds=config.plan.every_s),
        every_steps=None,
        **session_options(config.outer),
    )
    units = unit_table(config.plan, config.passes)
    start = start_line(Path(config.run_dir), config.rank, config.world)
    batches, stopped, next_check = 0, False, 0.0
    with (
        session,
        shared_queue(
            units, mailbox=box, learner_id=config.name, load=data.load, workers=0, shutdown_timeout=60.0
        ) as queue,
    ):
        for _, batch in queue:
            began = time.monotonic()
            train_step(model, optimizer, batch)
            session.step(samples=len(batch))
            batches += 1
            if began >= next_check:  # a store read per 50 ms, not per batch
                next_check = began + 0.05
                if box.get(STOP_KEY) is not None:
                    stopped = True
                    break
            pad(began, config.sleep_s)
    end = time.time()
    box.put(f"{DONE_PREFIX}{config.name}", b"")
    return {
        "start": start,
        "end": end,
        "batches": batches,
        "units": units_claimed_by(config.name),
        "exchanges": getattr(session, "exchanges", None),  # fragment exchanges since #22
        "fragments": getattr(session, "fragments", None),
        "merges": getattr(session, "merges", None),
        "stopped": stopped,
        "outer": str(config.outer or "average"),
        "state_bytes_sent": getattr(wire, "bytes_sent", None),  # Int8Wire: float32 bytes written
        "state_bytes_int8": getattr(wire, "bytes_int8", None),  # ... and as 8-bit they would be
        **traffic(counting, model, session),
    }


def traffic(counting: Any, model: torch.nn.Module, session: Any) -> dict[str, Any]:
    """The Session's bytes each way, the model's size (float32) and its whole exchanges."""
    fragments = getattr(session, "fragments", None) or 1
    return {
        "bytes_read": counting.bytes_read,
        "bytes_written": counting.bytes_written,
        "model_bytes": sum(value.numel() * 4 for value in model.state_dict().values() if value.is_floating_point()),
        "whole_exchanges": session.exchanges / fragments,
    }


def group_batches(data: TrainingData, size: int, unit: tuple[int, int]) -> Iterator[tuple[int, Tensor]]:
    """A group's steps: ``size`` batches of the unit at a time, one per rank (``split_rows``)."""
    batches = list(data.load(unit))
    for first in range(0, len(batches), size):
        steps = batches[first : first + size]
        yield steps[0][0] // size, torch.cat([batch for _, batch in steps])


def groups(config: NodeConfig) -> dict[str, Any]:
    """One rank of a group (a "machine"): DDP over its gloo group, ``Session(group=)`` and
    ``shared_queue(group=)``; each rank trains a whole batch of ``BATCH`` contexts per step at its
    own pad, as a one-process learner does, so a group of K does K batches per step."""
    group, member = divmod(config.rank, config.group_size)
    return in_process_group(config, f"group-{group}-store", member, config.group_size, lambda: _group_rank(config))


def _group_rank(config: NodeConfig) -> dict[str, Any]:
    import torch.distributed as dist

    from gradientmail import LocalMailbox, Session
    from gradientmail.patterns.shared_queue import shared_queue

    group = config.rank // config.group_size
    if config.plan.every_s is None:
        raise ValueError("plan.every_s is None: benchmarks.training derives it before starting nodes")
    box = LocalMailbox(Path(config.run_dir) / "mailbox")
    counting = CountingMailbox(box)
    data = TrainingData(config.data_dir, config.plan)
    model = make_model()
    wrapped = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = adam(model)
    learner = f"machine-{group}"
    session = Session(
        wrapped,
        mailbox=counting,
        learner_id=learner,
        every=timedelta(seconds=config.plan.every_s),
        group=dist.group.WORLD,
        **session_options(config.outer),
    )
    load = functools.partial(group_batches, data, config.group_size)
    start = start_line(Path(config.run_dir), config.rank, config.world)
    batches = 0
    with (
        session,
        shared_queue(
            unit_table(config.plan, 1),
            mailbox=box,
            learner_id=learner,
            load=load,
            workers=0,
            shutdown_timeout=60.0,
            group=dist.group.WORLD,
        ) as queue,
    ):
        for _, batch in queue:
            began = time.monotonic()
            train_step(wrapped, optimizer, batch)
            session.step(samples=len(batch))
            batches += 1
            pad(began, config.sleep_s)
    end = time.time()
    result = {
        "start": start,
        "end": end,
        "batches": batches,
        "merges": session.merges,
        "fragments": session.fragments,
        "exchanges": session.exchanges,
        **traffic(counting, model, session),
    }
    dist.barrier()  # neither rank tears its connections down while the other still uses them
    return result


METHODS = {"single": single, "ddp": ddp, "fixed_split": fixed_split, "gradientmail": gradientmail, "groups": groups}


def node_main(config: NodeConfig) -> None:
    """A node process: run the method, write the result (or the error) for the parent."""
    launched = time.time()
    _run_and_report(
        Path(config.run_dir) / f"result-{config.name}.json",
        lambda: {"launched": launched, **METHODS[config.method](config)},
    )


def _run_and_report(path: Path, run: Any) -> None:
    torch.set_num_threads(1)  # 4 nodes share 2 cores
    try:
        result = run()
    except BaseException:
        path.write_text(json.dumps({"error": traceback.format_exc()}))
        raise
    path.write_text(json.dumps(result))


# -- the monitor ----------------------------------------------------------------------------------


@dataclass
class Monitor:
    """Evaluates ``consensus(box, model)`` every ``plan.monitor_s`` seconds: the run's curve.

    Writes the stop marker once the loss is at or below ``target``; ends after evaluating the
    final consensus (every node wrote its done marker) or at the deadline.
    """

    config: MonitorConfig
    points: list[tuple[float, float]] = field(default_factory=list)
    reached_at: float | None = None

    def run(self) -> dict[str, Any]:
        from gradientmail import LocalMailbox, consensus

        box = LocalMailbox(Path(self.config.run_dir) / "mailbox")
        model = make_model()
        validation = validation_set(self.config.data_dir)
        deadline = time.monotonic() + self.config.deadline_s
        while time.monotonic() < deadline:
            tick = time.monotonic()
            finished = sum(1 for _ in box.list(DONE_PREFIX)) >= self.config.nodes
            at = time.time()
            try:
                consensus(box, model)
            except LookupError:  # no mail yet
                time.sleep(0.02)
                continue
            loss = validation_loss(model, validation)
            self.points.append((at, loss))
            target = self.config.target
            if self.reached_at is None and target is not None and loss <= target:
                self.reached_at = at
                box.put(STOP_KEY, b"")
            if finished:
                break
            time.sleep(max(0.0, tick + self.config.plan.monitor_s - time.monotonic()))
        return {"points": self.points, "reached_at": self.reached_at}


def monitor_main(config: MonitorConfig) -> None:
    _run_and_report(Path(config.run_dir) / f"result-{config.name}.json", lambda: Monitor(config).run())
