"""What a sharded group's Session costs: ``step()`` and each rank's traffic, against the whole model.

Two processes form one gloo group (one "machine") training the training benchmark's
``ByteMLP`` sharded with FSDP2 (``fully_shard`` on a CPU mesh), batches of 32 contexts split
between them. Reported (rank 0's figures over ``--steps``):

- ``train_step_s``: forward, backward (FSDP's all-gathers and reduce-scatters), Adam (median);
- ``shard_step_s``: ``session.step()`` with nothing due, the mean over every call but the
  first ``WARMUP`` (amortised: the word steps, which read the previous sample sum and start
  the next, and the counter steps between); ``shard_step_ratio`` is its share of a training
  step (target < 0.01);
- ``written_models_per_interval``: the bytes rank 0 wrote of the run's state per exchange
  interval (every fragment once), in whole-model sizes: about ``1 / ranks``, since each rank
  exchanges its own shard only (alone in the run, it reads nothing back).

Usage: ``python -m benchmarks.shard_step [--steps N] [--quick]``; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from benchmarks._training_nodes import BATCH, CONTEXT, VOCAB, adam, make_model, train_step
from gradientmail import LocalMailbox, Session

SIZE = 2
INTERVAL_STEPS = 10
WARMUP = 20
"""The first steps, not timed: the group's first collectives set up its connections."""
TARGET_SHARD_STEP_RATIO = 0.01


class Metered(LocalMailbox):
    """A ``LocalMailbox`` that counts the bytes of the run's state written."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.written = 0

    def put(self, key, data, *args, **kwargs):
        if key.startswith("session/fragments/"):
            self.written += len(data)
        return super().put(key, data, *args, **kwargs)

    def put_if_absent(self, key, data, *args, **kwargs):
        if key.startswith("session/fragments/"):
            self.written += len(data)
        return super().put_if_absent(key, data, *args, **kwargs)


def sharded_model() -> torch.nn.Module:
    mesh = init_device_mesh("cpu", (SIZE,))
    model = make_model()
    for layer in (model.embed, model.hidden, model.out):
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def rank_main(rank: int, port: int, mailbox: str, steps: int, intervals: int, results: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=SIZE)
    model = sharded_model()
    whole_bytes = 4 * sum(p.numel() for p in model.parameters())  # float32, as the run stores it
    optimizer = adam(model)
    batch = torch.randint(0, VOCAB, (BATCH // SIZE, CONTEXT + 1), generator=torch.Generator().manual_seed(rank))
    trains, shards = [], []
    with Session(
        model, mailbox=LocalMailbox(mailbox), learner_id="still", every=timedelta(hours=1), group=dist.group.WORLD
    ) as session:
        for _ in range(steps):
            began = time.perf_counter()
            train_step(model, optimizer, batch)
            middle = time.perf_counter()
            session.step(samples=len(batch))
            trains.append(middle - began)
            shards.append(time.perf_counter() - middle)
    box = Metered(mailbox)
    with Session(
        model, mailbox=box, learner_id="moving", every=None, every_steps=INTERVAL_STEPS, group=dist.group.WORLD
    ) as session:
        box.written = 0  # joining writes nothing of an interval
        for _ in range(intervals * INTERVAL_STEPS):
            train_step(model, optimizer, batch)
            session.step(samples=len(batch))
        session.wait()
        written = box.written
    if rank == 0:
        train, shard = statistics.median(trains), statistics.fmean(shards[WARMUP:])
        results.update(
            train_step_s=train,
            shard_step_s=shard,
            shard_step_ratio=shard / train,
            target_shard_step_ratio=TARGET_SHARD_STEP_RATIO,
            written_models_per_interval=written / intervals / whole_bytes,
            ranks=SIZE,
        )
    dist.barrier()  # neither rank tears its connections down while the other still uses them
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--quick", action="store_true", help="a few steps: that it runs, not what it measures")
    args = parser.parse_args(argv)
    steps, intervals = (WARMUP + 10, 1) if args.quick else (args.steps, 3)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with tempfile.TemporaryDirectory() as mailbox, mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(rank_main, args=(port, mailbox, steps, intervals, results), nprocs=SIZE)
        figures = dict(results)
    for name, value in figures.items():
        print(f"{name:28s} {value:.6g}")
    print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    main()
