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

Usage: ``python -m benchmarks.session_scale [--quick] [--learners 4 16 64] [--seconds 20]
[--every 2] [--params 1000000] [--steps-per-s 20] [--latency-ms 15] [--bandwidth-mbs 40]
[--repeats K]``. The default run takes about 1.5 minutes when the exchanges keep up, longer
when they do not (the wait and the exits queue on the store: 5 to 6 minutes against the
Session that folds into one chain of whole-model versions); ``--quick`` (CI: 2 and 4 learners,
2 s, every 0.5 s, 10k parameters, 2 ms latency) a few seconds and judges nothing. With
``--repeats`` above 1 the figures are medians, the table shows the min-max spread and the JSON
line adds ``<figure>_range`` pairs. The last line printed is one JSON object.
"""

from __future__ import annotations

import math
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta

import torch

from benchmarks._common import emit, median, parser, table, verdicts
from gradientmail import MemoryMailbox
from gradientmail.mailbox.base import LIST_PAGE, Mailbox
from gradientmail.mailbox.wrappers import MailboxWrapper
from gradientmail.session import Session, consensus

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

    def get(self, key: str) -> bytes | None:
        data = self.inner.get(key)
        self._pay(read=0 if data is None else len(data))
        return data

    def put(self, key: str, data: bytes) -> None:
        self._pay(written=len(data))
        self.inner.put(key, data)

    def delete(self, key: str) -> None:
        self._pay()
        self.inner.delete(key)

    def get_versioned(self, key: str) -> tuple[bytes, str] | None:
        found = self._versioned().get_versioned(key)
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


def make_model(params: int) -> torch.nn.Module:
    """A zeroed ``Linear`` with exactly ``params`` weights, as square as ``params`` allows."""
    rows = math.isqrt(params)
    while params % rows:
        rows -= 1
    model = torch.nn.Linear(params // rows, rows, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    return model


def run_all(items: list[Learner], body: Callable[[Learner], None]) -> None:
    """``body(learner)`` on one thread per learner; returns when every one is done."""
    threads = [threading.Thread(target=body, args=(item,), name=f"bench-{item.index}") for item in items]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def measure(config: Config) -> dict[str, float]:
    """One run with ``config.learners`` learners; the figures of one row (without suffixes)."""
    store = MemoryMailbox(f"session-scale-{uuid.uuid4().hex}")
    every = timedelta(seconds=config.every)
    learners = []
    for i in range(config.learners):
        model = make_model(config.params)
        box = PacedMailbox(store, config.latency_s, config.bandwidth_bytes_s)
        session = Session(model, mailbox=box, learner_id=f"learner-{i}", every=every, outer="average")
        learners.append(Learner(i, model, box, session))
    model_bytes = 4 * config.params
    try:
        # Join at times spread over one interval, so that the exchanges' phases are spread too.
        joined = time.monotonic()

        def enter(learner: Learner) -> None:
            time.sleep(max(0.0, joined + config.every * learner.index / config.learners - time.monotonic()))
            try:
                learner.session.__enter__()
                learner.entered = True
            except Exception as error:
                learner.errors.append(error)

        run_all(learners, enter)
        active = [learner for learner in learners if learner.entered]
        before = {learner.index: learner.box.counters() for learner in active}
        start = time.monotonic() + 0.05
        end = start + config.seconds
        intended = round(config.seconds * config.steps_per_s)
        cpu_start = time.process_time()

        def train(learner: Learner) -> None:
            parameters = list(learner.model.parameters())
            phase = learner.index / len(active)  # nodes' steps are not in lockstep either
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

        run_all(active, train)
        wall = max(time.monotonic(), end) - start
        cpu = time.process_time() - cpu_start

        # Where the run stands at the window's end, before anybody's exit folds the rest.
        samples = {learner.index: learner.session.samples for learner in active}
        fragments = {learner.index: getattr(learner.session, "fragments", 1) or 1 for learner in active}
        at_end = {learner.index: learner.session.exchanges / fragments[learner.index] for learner in active}
        folded = consensus(store, make_model(config.params))

        def finish_exchange(learner: Learner) -> None:
            if learner.error is None:
                try:
                    learner.session.wait()
                except Exception as error:
                    learner.error = error
                    learner.errors.append(error)

        closed = time.monotonic()
        run_all(active, finish_exchange)
        waited = time.monotonic() - closed
        after = {learner.index: learner.box.counters() for learner in active}
        completed = {learner.index: learner.session.exchanges / fragments[learner.index] for learner in active}
        conflicts = sum(learner.session.conflicts for learner in active)
    finally:
        leaving = time.monotonic()

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

        run_all(learners, leave)
        left = time.monotonic() - leaving
        store.clear()

    if not active:
        return {"errors": float(sum(len(learner.errors) for learner in learners))}
    intended_exchanges = config.seconds / config.every
    rates = [at_end[i] / intended_exchanges for i in at_end]
    lags = [(samples[i] - folded.get(f"learner-{i}", 0)) / config.steps_per_s for i in samples]
    per_exchange = {
        name: [(after[i][column] - before[i][column]) / scale / max(completed[i], 1e-9) for i in after]
        for name, column, scale in (("requests", 0, 1), ("read", 1, model_bytes), ("written", 2, model_bytes))
    }
    total_exchanges = sum(completed.values())
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
        "errors": float(sum(len(learner.errors) for learner in learners)),
        "cpu_per_wall": cpu / wall,
        "step_rate": min(learner.steps for learner in active) / intended,
        "late_ms": 1000 * max(learner.late_s for learner in active),
        "step_max_ms": 1000 * max(learner.step_s for learner in active),
        "wait_s": waited,
        "exit_s": left,
        "fragments": float(max(fragments.values())),
    }


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


def main(argv: list[str] | None = None) -> dict[str, object]:
    command = parser(__doc__)
    command.add_argument("--learners", type=int, nargs="+", help="learner counts (default 4 16 64)")
    command.add_argument("--seconds", type=float, help="training window per learner count (default 20)")
    command.add_argument("--every", type=float, help="each session's exchange interval, seconds (default 2)")
    command.add_argument("--params", type=int, help="float32 parameters of the model (default 1,000,000)")
    command.add_argument("--steps-per-s", type=float, help="each learner's steps per second (default 20)")
    command.add_argument("--latency-ms", type=float, help="store latency per request, ms (default 15)")
    command.add_argument("--bandwidth-mbs", type=float, help="store bandwidth per request, MB/s (default 40)")
    command.add_argument("--repeats", type=int, default=1, help="runs per learner count (default 1)")
    args = command.parse_args(argv)
    chosen = {**DEFAULTS, **(QUICK if args.quick else {})}
    for name in DEFAULTS:
        if getattr(args, name) is not None:
            chosen[name] = getattr(args, name)
    if args.repeats < 1:
        command.error("--repeats must be >= 1")
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
        results[count] = [measure(config) for _ in range(args.repeats)]

    model_mb = 4 * chosen["params"] / 1e6
    print(
        f"Session at scale: learners as threads, {chosen['params']:,} float32 parameters ({model_mb:g} MB), "
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
            figures[f"scale_{key}_{count}"] = median(values)
            if len(values) > 1:
                figures[f"scale_{key}_{count}_range"] = [min(values), max(values)]
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
    )
    emit(figures)
    return figures


if __name__ == "__main__":
    main()
