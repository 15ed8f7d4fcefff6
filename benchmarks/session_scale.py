"""The real ``Session`` at scale: 4, 16 and 64 learners (threads) on one S3-like store.

What it measures, per learner count N (figures suffixed ``_N`` on the JSON line):

- ``scale_exchange_rate_N``: completed exchanges per learner over the window, divided by the
  intended number (window / ``every``); the smallest over learners (``..._mean_N``: the mean). A
  completed exchange is ``session.exchanges / session.fragments`` (a Session that exchanges its
  state in F fragments per interval says so in ``fragments``; otherwise 1). The exchange still
  in flight when the window closes is not counted, so 20 s at 2 s tops out near 0.9-1.0.
- ``scale_lag_intervals_N``: progress not yet in the run when the window closes, in exchange
  intervals: ``(session.samples - consensus()[learner]) / steps_per_s / every``, the largest over
  learners (``..._mean_N``: the mean; ``scale_lag_s_N``: the same in seconds).
- ``scale_read_per_exchange_N`` and ``scale_written_per_exchange_N``: bytes a learner moved per
  completed exchange, in model sizes (float32 parameter bytes), mean over learners (``..._max_N``:
  the largest). Counted from the first step to the end of the exchange in flight at the window's
  end (waited for, so every byte counted belongs to a counted exchange); joining and leaving the
  run (enter, exit) are not counted. ``scale_requests_per_exchange_N``: requests, the same way.
- ``scale_conflicts_N`` (``session.conflicts`` summed) and ``scale_conflicts_per_exchange_N``.
- ``scale_errors_N``: exceptions raised by ``enter``, ``step``, ``wait`` or ``exit``; a learner
  whose step raises stops training (its session is then exited with that exception).
- ``scale_exact_N``: 1.0 when, once everyone left, the run holds each learner's samples exactly
  once (``consensus`` equals the samples it trained), else 0.0; ``scale_ledgers_N``: the ledger
  keys kept then (a run of more than 64 learners keeps their lines in ledgers).
- ``scale_cpu_per_wall_N``: the process's CPU seconds over the window / the window's wall
  seconds, i.e. cores kept busy. Near the machine's core count, the learners were CPU-bound and
  the other figures measure the machine more than the Session; ``scale_step_rate_N`` (steps
  taken / steps intended, the smallest over learners) and ``scale_late_ms_N`` (the latest any
  step started after its due time) say whether pacing held; ``scale_step_max_ms_N``: the longest
  ``session.step`` call (the training thread's own cost of the Session, worst case).
- ``scale_wait_s_N`` and ``scale_exit_s_N``: seconds from the window's end until every exchange
  in flight was done, and then until every learner had left (each exit folds the rest).

The store: one shared ``MemoryMailbox``; each learner reaches it through its own
``PacedMailbox``, which sleeps (``time.sleep``, so requests of different threads overlap, as
S3's do) a latency per request (default 15 ms) plus the body's bytes over a per-stream
bandwidth (default 40 MB/s): a get pays for the bytes it returns, a put (or put_if_absent,
replace_if) for the bytes it sends, a list one latency per page of 1,000 keys, a delete one
latency. Each wrapper counts its learner's requests and bytes each way.

The model: 1M float32 parameters (``--params``), so one model's transfer takes 4 MB / 40 MB/s =
0.1 s, 1/20 of the default 2 s exchange interval. That transfer/interval ratio is a
300M-parameter float32 model (1.2 GB) on S3 at about 250 MB/s per stream (4.8 s) exchanging
every 96 s, or one at about 1 GB/s exchanging every 25 s (at 250 MB/s and 25 s the ratio is 0.19,
four times this benchmark's). Each learner steps 20 times a second (``--steps-per-s``) on an
absolute schedule: each step adds 1.0 to every parameter and calls ``session.step(samples=1)``,
``outer="average"``. Sessions join at times spread over one interval (unsynchronised nodes'
phases); nobody steps until all have joined; steps of different learners are spread over one
step period (not in lockstep, which would queue every thread on the GIL at once); all stop
together when the window closes.

Learners in several processes (``--processes P``, default 1): one process's ~200 threads (64
learners, their sessions' workers) queue on its interpreter lock, which the Session's own cost
cannot be told apart from. With P above 1, a row's L learners are dealt round-robin to P worker
processes (spawn; about L/P learner threads each, at most one process per learner) that share
one ``LocalMailbox`` in a fresh temporary directory (on ``/dev/shm`` when it is writable),
each learner still behind its own ``PacedMailbox``. The parent hands out absolute wall-clock
times (join, window start): nobody steps until every process's sessions have joined, every
process opens and closes the window together; at its end every process records its learners'
figures, the parent takes ``consensus`` once (before anybody waits or leaves), then every
process waits for its exchanges in flight, then every process leaves. The figures are computed
by the same code as the threads' (``cpu_per_wall``: the processes' CPU seconds summed; ``wait_s``,
``exit_s``: the slowest process); the store differs (files on tmpfs rather than a dict, a little
more CPU per request).

Usage: ``python -m benchmarks.session_scale [--quick] [--learners 4 16 64] [--seconds 20]
[--every 2] [--params 1000000] [--steps-per-s 20] [--latency-ms 15] [--bandwidth-mbs 40]
[--repeats K] [--processes P]``. The default run takes about 1.5 minutes when the exchanges keep up, longer
when they do not (the wait and the exits queue on the store: 5 to 6 minutes against the
Session that folds into one chain of whole-model versions); ``--quick`` (CI: 2 and 4 learners,
2 s, every 0.5 s, 10k parameters, 2 ms latency) a few seconds and judges nothing. With
``--repeats`` above 1 the figures are medians, the table shows the min-max spread and the JSON
line adds ``<figure>_range`` pairs. The last line printed is one JSON object.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import multiprocessing
import multiprocessing.connection
import os
import random
import shutil
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any, NamedTuple

import torch

from benchmarks._common import emit, median, parser, table, verdicts
from gradientmail import LocalMailbox, MemoryMailbox
from gradientmail.layout import FRAGMENTS_PREFIX
from gradientmail.mailbox.base import LIST_PAGE, Mailbox
from gradientmail.mailbox.wrappers import MailboxWrapper
from gradientmail.session import Session, consensus
from gradientmail.session import core as session_core
from gradientmail.session.schedule import Schedule

LEARNERS = (4, 16, 64)
QUICK = {"learners": [2, 4], "seconds": 2.0, "every": 0.5, "params": 10_000, "latency_ms": 2.0}
DEFAULTS = {
    "learners": list(LEARNERS),
    "seconds": 20.0,
    "every": 2.0,
    "params": 1_000_000,
    "steps_per_s": 20.0,
    "latency_ms": 15.0,
    "bandwidth_mbs": 40.0,
}
SHARED_MEMORY = "/dev/shm"  # tmpfs on Linux: the processes' store, when writable


class PacedMailbox(MailboxWrapper):
    """One learner's view of a far store: latency plus bytes / bandwidth per request, counted.

    Sleeps outside any lock, so requests from different threads overlap. A get is answered from
    the store at its start, a write lands at its end (after its transfer).
    """

    def __init__(self, inner: Mailbox, latency_s: float, bandwidth_bytes_s: float) -> None:
        super().__init__(inner)
        if latency_s < 0 or bandwidth_bytes_s <= 0:
            raise ValueError(f"latency must be >= 0 and bandwidth > 0, not {latency_s}, {bandwidth_bytes_s}")
        self.latency_s = latency_s
        self.bandwidth_bytes_s = bandwidth_bytes_s
        self.requests = 0
        self.bytes_read = 0
        self.bytes_written = 0
        self._lock = threading.Lock()

    def counters(self) -> tuple[int, int, int]:
        """``(requests, bytes_read, bytes_written)`` so far."""
        with self._lock:
            return self.requests, self.bytes_read, self.bytes_written

    def _pay(self, read: int = 0, written: int = 0) -> None:
        with self._lock:
            self.requests += 1
            self.bytes_read += read
            self.bytes_written += written
        time.sleep(self.latency_s + (read + written) / self.bandwidth_bytes_s)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        self._pay(written=len(data))
        return self.inner.put_if_absent(key, data)

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes | None:
        data = self.inner.get(key, max_bytes=max_bytes)
        self._pay(read=0 if data is None else len(data))
        return data

    def put(self, key: str, data: bytes) -> None:
        self._pay(written=len(data))
        self.inner.put(key, data)

    def delete(self, key: str) -> None:
        self._pay()
        self.inner.delete(key)

    def get_versioned(self, key: str, *, max_bytes: int | None = None) -> tuple[bytes, str] | None:
        found = self._versioned().get_versioned(key, max_bytes=max_bytes)
        self._pay(read=0 if found is None else len(found[0]))
        return found

    def replace_if(self, key: str, data: bytes, version: str) -> bool:
        inner = self._versioned()
        self._pay(written=len(data))
        return inner.replace_if(key, data, version)

    def list(self, prefix: str = "", start_after: str | None = None) -> Iterator[str]:
        self._pay()  # the first page is requested even when it comes back empty
        for seen, key in enumerate(self.inner.list(prefix, start_after), start=1):
            yield key
            if seen % LIST_PAGE == 0:
                self._pay()


@dataclass
class Config:
    learners: int
    seconds: float
    every: float
    params: int
    steps_per_s: float
    latency_s: float
    bandwidth_bytes_s: float
    phase_seed: int | None = None
    """Each learner's exchange phase drawn from ``phase_generator(phase_seed, index)`` (as
    ``session_sim`` can draw it, to compare the two runs); None: a random one, as ``Session`` draws."""


def phase_generator(seed: int, index: int) -> random.Random:
    """Where learner ``index``'s exchange phase comes from in a run of ``phase_seed`` ``seed``."""
    return random.Random(f"phases-{seed}-{index}")


_entering = threading.local()  # the index of the learner whose Session this thread enters


@contextlib.contextmanager
def seeded_phases(seed: int | None) -> Iterator[None]:
    """Within the block, a ``Session`` entered by ``enter`` draws its phase from
    ``phase_generator(seed, index)`` (None: changes nothing)."""
    if seed is None:
        yield
        return
    drawn = session_core.Schedule

    def schedule(*args: Any, **kwargs: Any) -> Schedule:
        return drawn(*args, **kwargs, rng=phase_generator(seed, _entering.index))

    session_core.Schedule = schedule  # type: ignore[assignment,misc]
    try:
        yield
    finally:
        session_core.Schedule = drawn  # type: ignore[misc]


@dataclass
class Learner:
    index: int
    model: torch.nn.Module
    box: PacedMailbox
    session: Session
    entered: bool = False
    steps: int = 0
    late_s: float = 0.0
    step_s: float = 0.0
    error: BaseException | None = None
    errors: list[BaseException] = field(default_factory=list)
    # Taken at the window's end (samples, fragments, at_end) and after its exchange in flight.
    before: tuple[int, int, int] = (0, 0, 0)
    after: tuple[int, int, int] = (0, 0, 0)
    samples: int = 0
    fragments: int = 1
    at_end: float = 0.0
    completed: float = 0.0
    conflicts: int = 0


@dataclass
class Record:
    """One learner's figures, as plain data (they cross from a worker process to the parent)."""

    index: int
    entered: bool
    errors: int
    steps: int
    late_s: float
    step_s: float
    before: tuple[int, int, int]
    after: tuple[int, int, int]
    samples: int
    fragments: int
    at_end: float
    completed: float
    conflicts: int


def record(learner: Learner) -> Record:
    return Record(
        index=learner.index,
        entered=learner.entered,
        errors=len(learner.errors),
        steps=learner.steps,
        late_s=learner.late_s,
        step_s=learner.step_s,
        before=learner.before,
        after=learner.after,
        samples=learner.samples,
        fragments=learner.fragments,
        at_end=learner.at_end,
        completed=learner.completed,
        conflicts=learner.conflicts,
    )


def make_model(params: int) -> torch.nn.Module:
    """A zeroed ``Linear`` with exactly ``params`` weights, as square as ``params`` allows."""
    rows = math.isqrt(params)
    while params % rows:
        rows -= 1
    model = torch.nn.Linear(params // rows, rows, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    return model


def make_learner(index: int, config: Config, store: Mailbox) -> Learner:
    model = make_model(config.params)
    box = PacedMailbox(store, config.latency_s, config.bandwidth_bytes_s)
    session = Session(
        model, mailbox=box, learner_id=f"learner-{index}", every=timedelta(seconds=config.every), outer="average"
    )
    return Learner(index, model, box, session)


def run_all(items: list[Learner], body: Callable[[Learner], None]) -> None:
    """``body(learner)`` on one thread per learner; returns when every one is done."""
    threads = [threading.Thread(target=body, args=(item,), name=f"bench-{item.index}") for item in items]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


# What each learner's thread does, in turn; the same whether the learners share one process or not.
def enter(learner: Learner, config: Config, joined: float) -> None:
    """Join at ``joined`` plus this learner's share of one interval (the exchanges' phases spread)."""
    time.sleep(max(0.0, joined + config.every * learner.index / config.learners - time.monotonic()))
    _entering.index = learner.index
    try:
        learner.session.__enter__()
        learner.entered = True
    except Exception as error:
        learner.errors.append(error)


def train(learner: Learner, config: Config, start: float, active: int) -> None:
    """Step on the absolute schedule from ``start`` until the window closes."""
    end = start + config.seconds
    intended = round(config.seconds * config.steps_per_s)
    parameters = list(learner.model.parameters())
    phase = learner.index / active  # nodes' steps are not in lockstep either
    try:
        for k in range(intended):
            due = start + (k + phase) / config.steps_per_s
            now = time.monotonic()
            if due > now:
                time.sleep(due - now)
            elif now >= end:
                break  # fallen behind past the window: stop with the others
            else:
                learner.late_s = max(learner.late_s, now - due)
            with torch.no_grad():
                for parameter in parameters:
                    parameter.add_(1.0)
            called = time.monotonic()
            learner.session.step(samples=1)
            learner.step_s = max(learner.step_s, time.monotonic() - called)
            learner.steps += 1
    except Exception as error:
        learner.error = error
        learner.errors.append(error)


def window_end(learner: Learner) -> None:
    """Where the run stands at the window's end, before anybody's exit folds the rest."""
    learner.samples = learner.session.samples
    learner.fragments = getattr(learner.session, "fragments", 1) or 1
    learner.at_end = learner.session.exchanges / learner.fragments


def finish_exchange(learner: Learner) -> None:
    if learner.error is None:
        try:
            learner.session.wait()
        except Exception as error:
            learner.error = error
            learner.errors.append(error)


def exchanges_done(learner: Learner) -> None:
    """The bytes and exchanges once the exchange in flight at the window's end is done."""
    learner.after = learner.box.counters()
    learner.completed = learner.session.exchanges / learner.fragments
    learner.conflicts = learner.session.conflicts


def leave(learner: Learner) -> None:
    if not learner.entered:
        return
    try:
        error = learner.error
        learner.session.__exit__(
            None if error is None else type(error), error, None if error is None else error.__traceback__
        )
    except Exception as exit_error:
        learner.errors.append(exit_error)


def measure(config: Config) -> dict[str, float]:
    """One run with ``config.learners`` learners as threads of this process; one row's figures."""
    store = MemoryMailbox(f"session-scale-{uuid.uuid4().hex}")
    learners = [make_learner(i, config, store) for i in range(config.learners)]
    try:
        joined = time.monotonic()
        with seeded_phases(config.phase_seed):
            run_all(learners, lambda learner: enter(learner, config, joined))
        active = [learner for learner in learners if learner.entered]
        for learner in active:
            learner.before = learner.box.counters()
        start = time.monotonic() + 0.05
        end = start + config.seconds
        cpu_start = time.process_time()
        run_all(active, lambda learner: train(learner, config, start, len(active)))
        wall = max(time.monotonic(), end) - start
        cpu = time.process_time() - cpu_start

        for learner in active:
            window_end(learner)
        folded = consensus(store, make_model(config.params))

        closed = time.monotonic()
        run_all(active, finish_exchange)
        waited = time.monotonic() - closed
        for learner in active:
            exchanges_done(learner)
    finally:
        leaving = time.monotonic()
        run_all(learners, leave)
        left = time.monotonic() - leaving
        after = settled(store, config)
        store.clear()
    return row_figures(config, [record(learner) for learner in learners], folded, cpu, wall, waited, left, after)


class Settled(NamedTuple):
    """The run once everyone left: each learner's samples in it, and the ledgers kept."""

    folded: dict[str, int]
    ledgers: int


def settled(store: Mailbox, config: Config) -> Settled:
    """What the store holds once every learner left (``consensus``, and ledger keys: a run of
    more than ``RECENT_LINES`` learners keeps each fragment's learners' lines in ledgers)."""
    ledgers = sum(1 for key in store.list(FRAGMENTS_PREFIX) if "/ledgers/" in key)
    return Settled(consensus(store, make_model(config.params)), ledgers)


def row_figures(
    config: Config,
    records: list[Record],
    folded: dict[str, int],
    cpu: float,
    wall: float,
    waited: float,
    left: float,
    after: Settled,
) -> dict[str, float]:
    """One row's figures (without suffixes) from every learner's record, however they were placed."""
    errors = float(sum(item.errors for item in records))
    active = [item for item in records if item.entered]
    if not active:
        return {"errors": errors}
    model_bytes = 4 * config.params
    intended = round(config.seconds * config.steps_per_s)
    intended_exchanges = config.seconds / config.every
    rates = [item.at_end / intended_exchanges for item in active]
    lags = [(item.samples - folded.get(f"learner-{item.index}", 0)) / config.steps_per_s for item in active]
    per_exchange = {
        name: [(item.after[column] - item.before[column]) / scale / max(item.completed, 1e-9) for item in active]
        for name, column, scale in (("requests", 0, 1), ("read", 1, model_bytes), ("written", 2, model_bytes))
    }
    total_exchanges = sum(item.completed for item in active)
    conflicts = sum(item.conflicts for item in active)
    return {
        "exchange_rate": min(rates),
        "exchange_rate_mean": sum(rates) / len(rates),
        "lag_intervals": max(lags) / config.every,
        "lag_intervals_mean": sum(lags) / len(lags) / config.every,
        "lag_s": max(lags),
        "lag_s_mean": sum(lags) / len(lags),
        "read_per_exchange": sum(per_exchange["read"]) / len(active),
        "read_per_exchange_max": max(per_exchange["read"]),
        "written_per_exchange": sum(per_exchange["written"]) / len(active),
        "written_per_exchange_max": max(per_exchange["written"]),
        "requests_per_exchange": sum(per_exchange["requests"]) / len(active),
        "conflicts": float(conflicts),
        "conflicts_per_exchange": conflicts / total_exchanges if total_exchanges else math.nan,
        "errors": errors,
        "cpu_per_wall": cpu / wall,
        "step_rate": min(item.steps for item in active) / intended,
        "late_ms": 1000 * max(item.late_s for item in active),
        "step_max_ms": 1000 * max(item.step_s for item in active),
        "wait_s": waited,
        "exit_s": left,
        "fragments": float(max(item.fragments for item in active)),
        "exact": float(all(after.folded.get(f"learner-{item.index}") == item.samples for item in active)),
        "ledgers": float(after.ledgers),
    }


# -- learners spread over processes -----------------------------------------------------------
def store_parent() -> str | None:
    """Where the processes' store goes: ``/dev/shm`` (tmpfs) when writable, else the default."""
    if os.path.isdir(SHARED_MEMORY) and os.access(SHARED_MEMORY, os.W_OK | os.X_OK):
        return SHARED_MEMORY
    return None


def monotonic_at(wall_clock: float) -> float:
    """This process's ``time.monotonic()`` at the absolute time ``wall_clock`` (``time.time()``)."""
    return time.monotonic() + (wall_clock - time.time())


def expect(conn: Connection, kind: str) -> tuple[Any, ...]:
    message = conn.recv()
    if message[0] != kind:
        raise RuntimeError(f"expected {kind!r} from the parent, got {message[0]!r}")
    return message[1:]


def worker(config: Config, indices: list[int], directory: str, conn: Connection) -> None:
    """A worker process: learners ``indices`` (of ``config.learners``) as threads, on the shared store.

    Talks to the parent over ``conn``: ``ready`` -> ``join`` (wall-clock time) -> ``entered`` ->
    ``start`` (wall-clock time, learners entered in all) -> ``window`` -> ``wait`` -> ``waited`` ->
    ``leave`` -> ``done`` (records, cpu, wall, waited, left), or ``failed`` (a traceback).
    """
    torch.set_num_threads(1)
    failure: str | None = None
    learners: list[Learner] = []
    cpu = wall = waited = left = 0.0
    try:
        store = LocalMailbox(directory, create=False)
        learners = [make_learner(i, config, store) for i in indices]
        conn.send(("ready",))
        (joined_at,) = expect(conn, "join")
        joined = monotonic_at(joined_at)
        run_all(learners, lambda learner: enter(learner, config, joined))
        active = [learner for learner in learners if learner.entered]
        for learner in active:
            learner.before = learner.box.counters()
        conn.send(("entered", len(active)))
        start_at, everyone = expect(conn, "start")
        start = monotonic_at(start_at)
        end = start + config.seconds
        cpu_start = time.process_time()
        run_all(active, lambda learner: train(learner, config, start, everyone))
        wall = max(time.monotonic(), end) - start
        cpu = time.process_time() - cpu_start
        for learner in active:
            window_end(learner)
        conn.send(("window",))
        expect(conn, "wait")  # the parent took consensus() meanwhile
        closed = time.monotonic()
        run_all(active, finish_exchange)
        waited = time.monotonic() - closed
        for learner in active:
            exchanges_done(learner)
        conn.send(("waited",))
        expect(conn, "leave")
    except BaseException:  # reported to the parent, which raises it
        failure = traceback.format_exc()
    finally:
        leaving = time.monotonic()
        run_all(learners, leave)
        left = time.monotonic() - leaving
    try:
        if failure is None:
            records = [dataclasses.asdict(record(learner)) for learner in learners]  # plain data: no class to import
            conn.send(("done", records, cpu, wall, waited, left))
        else:
            conn.send(("failed", failure))
    except OSError:
        pass  # the parent is gone (it raised): nobody to tell
    finally:
        conn.close()


def gather(workers: list[tuple[multiprocessing.process.BaseProcess, Connection]], kind: str) -> list[tuple[Any, ...]]:
    """One ``kind`` message from every worker, in order; raises when one failed or died."""
    answers: dict[int, tuple[Any, ...]] = {}
    while len(answers) < len(workers):
        pending = [number for number in range(len(workers)) if number not in answers]
        multiprocessing.connection.wait(
            [workers[number][1] for number in pending] + [workers[number][0].sentinel for number in pending]
        )
        for number in pending:
            process, conn = workers[number]
            if conn.poll():
                message = conn.recv()
                if message[0] == "failed":
                    raise RuntimeError(f"worker process {number} failed:\n{message[1]}")
                if message[0] != kind:
                    raise RuntimeError(f"expected {kind!r} from worker process {number}, got {message[0]!r}")
                answers[number] = message[1:]
            elif not process.is_alive():
                raise RuntimeError(f"worker process {number} exited ({process.exitcode}) before {kind!r}")
    return [answers[number] for number in range(len(workers))]


def send_all(workers: list[tuple[multiprocessing.process.BaseProcess, Connection]], *message: Any) -> None:
    for _, conn in workers:
        conn.send(message)


def measure_processes(config: Config, processes: int) -> dict[str, float]:
    """One run with ``config.learners`` learners dealt to ``processes`` worker processes; one row."""
    count = max(1, min(processes, config.learners))
    directory = tempfile.mkdtemp(prefix="session-scale-", dir=store_parent())
    context = multiprocessing.get_context("spawn")
    workers: list[tuple[multiprocessing.process.BaseProcess, Connection]] = []
    try:
        for number in range(count):
            mine, theirs = context.Pipe()
            process = context.Process(
                target=worker,
                args=(config, list(range(number, config.learners, count)), directory, theirs),
                name=f"session-scale-{number}",
                daemon=True,
            )
            process.start()
            theirs.close()
            workers.append((process, mine))
        gather(workers, "ready")  # every model and session built (imports, allocations) before anyone joins
        send_all(workers, "join", time.time() + 0.2)
        everyone = sum(answer[0] for answer in gather(workers, "entered"))
        send_all(workers, "start", time.time() + 0.2, max(everyone, 1))
        gather(workers, "window")
        folded = consensus(LocalMailbox(directory, create=False), make_model(config.params))
        send_all(workers, "wait")
        gather(workers, "waited")
        send_all(workers, "leave")
        done = gather(workers, "done")
        after = settled(LocalMailbox(directory, create=False), config)
    finally:
        for _, conn in workers:
            conn.close()  # a worker still waiting for the parent stops, leaves its sessions and exits
        for process, _ in workers:
            process.join(timeout=120)
            if process.is_alive():
                process.terminate()
                process.join()
        shutil.rmtree(directory, ignore_errors=True)
    records = sorted((Record(**item) for answer in done for item in answer[0]), key=lambda item: item.index)
    return row_figures(
        config,
        records,
        folded,
        cpu=sum(answer[1] for answer in done),
        wall=max(answer[2] for answer in done),
        waited=max(answer[3] for answer in done),
        left=max(answer[4] for answer in done),
        after=after,
    )


COLUMNS = (
    ("exchange_rate", "rate min", "{:.3f}"),
    ("exchange_rate_mean", "rate mean", "{:.3f}"),
    ("lag_intervals", "lag max (int.)", "{:.2f}"),
    ("lag_intervals_mean", "lag mean (int.)", "{:.2f}"),
    ("read_per_exchange", "read/exch", "{:.2f}"),
    ("read_per_exchange_max", "read max", "{:.2f}"),
    ("written_per_exchange", "written/exch", "{:.2f}"),
    ("written_per_exchange_max", "written max", "{:.2f}"),
    ("requests_per_exchange", "requests/exch", "{:.1f}"),
    ("conflicts", "conflicts", "{:.0f}"),
    ("conflicts_per_exchange", "confl/exch", "{:.2f}"),
    ("errors", "errors", "{:.0f}"),
    ("exact", "exact", "{:.0f}"),
    ("cpu_per_wall", "cpu/wall", "{:.2f}"),
    ("step_rate", "steps min", "{:.3f}"),
    ("late_ms", "late ms", "{:.0f}"),
    ("step_max_ms", "step max ms", "{:.0f}"),
    ("wait_s", "wait s", "{:.1f}"),
    ("exit_s", "exit s", "{:.1f}"),
)


def cell(values: list[float], shape: str) -> str:
    if not values:
        return "n/a"
    middle = shape.format(median(values))
    if len(values) == 1:
        return middle
    return f"{middle} ({shape.format(min(values))}-{shape.format(max(values))})"


def main(argv: list[str] | None = None, prefix: str = "scale") -> dict[str, object]:
    """Run the rows ``argv`` asks for; figures named ``{prefix}_{figure}_{learners}``."""
    command = parser(__doc__)
    command.add_argument("--learners", type=int, nargs="+", help="learner counts (default 4 16 64)")
    command.add_argument("--seconds", type=float, help="training window per learner count (default 20)")
    command.add_argument("--every", type=float, help="each session's exchange interval, seconds (default 2)")
    command.add_argument("--params", type=int, help="float32 parameters of the model (default 1,000,000)")
    command.add_argument("--steps-per-s", type=float, help="each learner's steps per second (default 20)")
    command.add_argument("--latency-ms", type=float, help="store latency per request, ms (default 15)")
    command.add_argument("--bandwidth-mbs", type=float, help="store bandwidth per request, MB/s (default 40)")
    command.add_argument("--repeats", type=int, default=1, help="runs per learner count (default 1)")
    command.add_argument(
        "--processes",
        type=int,
        default=1,
        help="worker processes the learners are dealt to, sharing a LocalMailbox (default 1: threads of this one)",
    )
    args = command.parse_args(argv)
    chosen = {**DEFAULTS, **(QUICK if args.quick else {})}
    for name in DEFAULTS:
        if getattr(args, name) is not None:
            chosen[name] = getattr(args, name)
    if args.repeats < 1:
        command.error("--repeats must be >= 1")
    if args.processes < 1:
        command.error("--processes must be >= 1")
    torch.set_num_threads(1)  # dozens of learner threads: no intra-op pool fighting over the cores

    results: dict[int, list[dict[str, float]]] = {}
    for count in chosen["learners"]:
        config = Config(
            learners=count,
            seconds=chosen["seconds"],
            every=chosen["every"],
            params=chosen["params"],
            steps_per_s=chosen["steps_per_s"],
            latency_s=chosen["latency_ms"] / 1000,
            bandwidth_bytes_s=chosen["bandwidth_mbs"] * 1e6,
        )
        if args.processes == 1:
            results[count] = [measure(config) for _ in range(args.repeats)]
        else:
            results[count] = [measure_processes(config, args.processes) for _ in range(args.repeats)]

    model_mb = 4 * chosen["params"] / 1e6
    if args.processes == 1:
        placed = "learners as threads"
    else:
        placed = (
            f"learners as threads dealt round-robin to {args.processes} processes (at most one per learner) "
            f"sharing one LocalMailbox in {store_parent() or tempfile.gettempdir()}"
        )
    print(
        f"Session at scale: {placed}, {chosen['params']:,} float32 parameters ({model_mb:g} MB), "
        f"{chosen['steps_per_s']:g} steps/s, every {chosen['every']:g} s, outer=average, {chosen['seconds']:g} s "
        f"window; store {chosen['latency_ms']:g} ms + bytes at {chosen['bandwidth_mbs']:g} MB/s per request; "
        f"{os.cpu_count()} CPUs{' (quick)' if args.quick else ''}"
        + (f"; median of {args.repeats} (min-max)" if args.repeats > 1 else "")
    )
    rows = []
    for count, runs in results.items():
        rows.append([str(count), *(cell([run[key] for run in runs if key in run], shape) for key, _, shape in COLUMNS)])
    print(table(["learners", *(header for _, header, _ in COLUMNS)], rows))
    print(
        "rate: completed exchanges / intended (window / every), min and mean over learners; lag: progress not "
        "yet in the run at the window's end, in exchange intervals; read, written: model sizes per completed "
        "exchange per learner; cpu/wall: cores busy; steps min: steps taken / intended, slowest learner; "
        "late ms: the latest a step started after its due time; step max ms: the longest session.step; wait s, exit s: the exchanges in flight at "
        "the window's end, then the exits"
    )

    figures: dict[str, object] = {}
    names = [key for key, _, _ in COLUMNS] + ["lag_s", "lag_s_mean", "fragments"]
    for count, runs in results.items():
        for key in names:
            values = [run[key] for run in runs if key in run]
            if not values:
                continue
            figures[f"{prefix}_{key}_{count}"] = median(values)
            if len(values) > 1:
                figures[f"{prefix}_{key}_{count}_range"] = [min(values), max(values)]
    for line in verdicts({name: value for name, value in figures.items() if isinstance(value, float)}):
        print(line)
    figures.update(
        learners=list(chosen["learners"]),
        seconds=chosen["seconds"],
        every_s=chosen["every"],
        params=chosen["params"],
        latency_ms=chosen["latency_ms"],
        bandwidth_mbs=chosen["bandwidth_mbs"],
        repeats=args.repeats,
        processes=args.processes,
    )
    emit(figures)
    return figures


if __name__ == "__main__":
    main()
