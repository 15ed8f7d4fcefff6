"""Two Session figures that need no training: ``drag`` and ``read_per_exchange``.

- ``drag``: a toy that shows lost or doubled progress, on the real ``Session``. Equal nodes (threads), each step moves the
  one parameter by +1, exchanges every few steps, staggered and not awaited (the exchange runs
  in each session's background thread while the next steps go on). The consensus' advance per
  node step: 1.0 means no progress was lost or doubled (averaging positions instead: 0.73).
  Measured with ``outer="average"``; the default ``delayed_nesterov`` adds a momentum step on
  top, so it advances more than 1.0 by design (reported as ``drag_delayed_nesterov``).
- ``read_per_exchange``: bytes a node reads per exchange, in model sizes (float32 parameter
  bytes), at 4, 16 and 64 learners, threads exchanging on a timer against one byte-counting
  in-memory mailbox, every node exchanging every 0.25 s. The run's state is one chain of
  versions, so a node reads the newest version (one model) plus one more per version lost to a
  concurrent writer, whatever N is.

Usage: ``python -m benchmarks.session_figures [--quick]``; ``benchmarks/training.py`` imports
``measure_drag`` and ``measure_read_per_exchange`` and puts them on its JSON line.
"""

from __future__ import annotations

import threading
import time
import uuid
from datetime import timedelta

import torch

from benchmarks._common import emit, parser
from gradientmail import MemoryMailbox
from gradientmail.mailbox.wrappers import CountingMailbox
from gradientmail.session import Session, consensus

LEARNER_COUNTS = (4, 16, 64)
EVERY_S = 0.25
"""Each node's exchange interval, as in ``benchmarks/training.py``. At 64 learners this keeps
one chain of versions busy most of the time (about 250 folds/s asked of it in one process), so
the figure includes the reads that losing versions to rivals costs."""


def _scalar(size: int = 1) -> torch.nn.Module:
    model = torch.nn.Linear(size, 1, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    return model


def _push(model: torch.nn.Module, amount: float) -> None:
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(amount)


def _run_threads(sessions: list[Session], body) -> None:
    """Enter every session first (all members known), run ``body(i)`` on one thread each, and
    exit once every body is done (equal nodes: nobody trains on alone after the others left)."""
    for session in sessions:
        session.__enter__()
    errors: list[BaseException] = []
    finished = threading.Barrier(len(sessions))

    def guarded(i: int) -> None:
        try:
            body(i)
            finished.wait()
            sessions[i].__exit__(None, None, None)
        except BaseException as error:  # reported on the main thread
            errors.append(error)

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(len(sessions))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


def drag_once(
    nodes: int,
    every_steps: int,
    steps: int,
    outer: str = "average",
    *,
    fragments: int = 1,
    speeds: tuple[int, ...] | None = None,
) -> float:
    """Consensus advance per node step on the toy (threads, exchanges not awaited). The plain
    rule by default: the default ``delayed_nesterov`` adds momentum on purpose (advance > 1).

    ``fragments`` > 1 cuts a model of that many parameters into as many fragments; ``speeds``
    (e.g. 1:2:2:4) makes node ``i`` take ``speeds[i]`` times the steps of the slowest in the
    same time, so that fast nodes' exchanges interleave with slow nodes' as in a real run.
    """
    box = MemoryMailbox(f"drag-{uuid.uuid4().hex}")
    models = [_scalar(fragments) for _ in range(nodes)]
    sessions = [
        Session(
            model,
            mailbox=box,
            learner_id=f"n{i}",
            every=None,
            every_steps=every_steps,
            outer=outer,
            fragments=fragments,
        )
        for i, model in enumerate(models)
    ]
    speeds = speeds or (1,) * nodes
    fastest = max(speeds)
    done = [0] * nodes

    def train(i: int) -> None:
        for _ in range(i % every_steps):  # stagger: node i's exchanges fall i steps later
            _push(models[i], 1.0)
            sessions[i].step(samples=1)
            done[i] += 1
        for _ in range(steps * speeds[i] // fastest):
            _push(models[i], 1.0)
            sessions[i].step(samples=1)
            done[i] += 1
            time.sleep(0.0002 * fastest / speeds[i])  # a step's worth of time: exchanges overlap steps

    _run_threads(sessions, train)
    result = _scalar(fragments)
    consensus(box, result)
    # Each step moves every parameter by +1, and each node's progress counts 1/N.
    return float(result.weight.mean().item()) / (sum(done) / nodes)


def measure_drag(quick: bool = False) -> float:
    """The smallest advance per step over ``every_steps`` 1, 4 and 16 (4 equal nodes)."""
    steps = 48 if quick else 192
    return min(drag_once(4, every_steps, steps) for every_steps in (1, 4, 16))


def read_once(learners: int, exchanges: int, width: int = 256, every_s: float = EVERY_S) -> float:
    """Model sizes read per node per exchange, ``learners`` threads exchanging every ``every_s``."""
    counting = CountingMailbox(MemoryMailbox(f"read-{uuid.uuid4().hex}"))
    torch.manual_seed(0)
    models = [torch.nn.Linear(width, width) for _ in range(learners)]
    model_bytes = sum(p.numel() * 4 for p in models[0].parameters())
    sessions = [
        Session(model, mailbox=counting, learner_id=f"n{i}", every=None, every_steps=1, timeout=timedelta(seconds=120))
        for i, model in enumerate(models)
    ]
    for session in sessions:
        session.__enter__()
    before = counting.bytes_read
    start = time.monotonic()

    def train(i: int) -> None:
        # Start times spread over one interval, as unsynchronised nodes' would be.
        time.sleep(every_s * i / learners)
        for round_ in range(exchanges):
            _push(models[i], 1e-3)
            sessions[i].step(samples=1)
            sessions[i].wait()
            time.sleep(max(0.0, start + every_s * (round_ + 1 + i / learners) - time.monotonic()))

    threads = [threading.Thread(target=train, args=(i,)) for i in range(learners)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    read = counting.bytes_read - before
    for session in sessions:
        session.__exit__(None, None, None)
    return read / model_bytes / (learners * exchanges)


def read_figures(quick: bool = False) -> dict[int, float]:
    exchanges = 3 if quick else 10
    return {learners: read_once(learners, exchanges) for learners in LEARNER_COUNTS}


def measure_read_per_exchange(quick: bool = False) -> float:
    """The largest of the figures at 4, 16 and 64 learners (the target holds at every N)."""
    return max(read_figures(quick).values())


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parser(__doc__).parse_args(argv)
    figures: dict[str, float] = {}
    steps = 48 if args.quick else 192
    for every_steps in (1, 4, 16):
        figures[f"drag_every_{every_steps}"] = drag_once(4, every_steps, steps)
        print(f"drag, 4 equal nodes, every_steps={every_steps}: {figures[f'drag_every_{every_steps}']:.4f}")
    for learners, reads in read_figures(args.quick).items():
        figures[f"read_per_exchange_{learners}"] = reads
        print(f"model sizes read per node per exchange, {learners} learners: {reads:.3f}")
    figures["drag_fragments_unequal"] = drag_once(4, 4, steps, fragments=8, speeds=(1, 2, 2, 4))
    print(f"drag, 8 fragments, speeds 1:2:2:4, every_steps=4: {figures['drag_fragments_unequal']:.4f}")
    figures["drag"] = min(v for k, v in figures.items() if k.startswith("drag_"))
    figures["drag_delayed_nesterov"] = drag_once(4, 4, steps, outer="delayed_nesterov")
    print(
        f"advance per step with the default outer (momentum on top), every_steps=4: "
        f"{figures['drag_delayed_nesterov']:.4f}"
    )
    figures["read_per_exchange"] = max(v for k, v in figures.items() if k.startswith("read_per_exchange_"))
    emit(figures)
    return figures


if __name__ == "__main__":
    main()
