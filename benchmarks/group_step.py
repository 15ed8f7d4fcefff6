"""What ``Session.step`` costs in a group, against a training step of the training benchmark's model.

Two processes form one gloo group (one "machine"), the training benchmark's ``ByteMLP`` inside
DDP, batches of 32 contexts split between them. Timed, per call, over ``--steps``:

- ``train_step_s``: forward, backward (DDP's all-reduce), Adam, ``zero_grad`` (median);
- ``group_step_s``: ``session.step()`` with nothing due, the mean over every call but the
  first ``WARMUP`` (amortised: the word steps, which start one all-reduce of ``[samples,
  status, every, a flag per fragment]`` and read the previous one, and the counter steps between);
  ``group_step_ratio`` is its share of a training step (target < 0.01);
  ``group_step_max_s``: the dearest call;
- ``merge_share_s``: broadcasting the whole model from rank 0 (what a merge of every fragment
  costs at its step; a merge of one fragment costs its share of it).

Usage: ``python -m benchmarks.group_step [--steps N] [--quick]``; the last line is one JSON object.
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

from benchmarks._training_nodes import BATCH, CONTEXT, VOCAB, adam, make_model, train_step
from gradientmail import LocalMailbox, Session
from gradientmail.session.fragments import FragmentPlan
from gradientmail.session.group import GroupSync

SIZE = 2
WARMUP = 20
"""The first steps, not timed: the group's first collectives set up its connections."""
TARGET_GROUP_STEP_RATIO = 0.01


def rank_main(rank: int, port: int, mailbox: str, steps: int, results: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=SIZE)
    model = make_model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = adam(ddp)
    batch = torch.randint(0, VOCAB, (BATCH // SIZE, CONTEXT + 1), generator=torch.Generator().manual_seed(rank))
    trains, groups, shares = [], [], []
    every = timedelta(hours=1)  # nothing due: the per-step collective alone
    with Session(
        ddp, mailbox=LocalMailbox(mailbox), learner_id="machine", every=every, group=dist.group.WORLD
    ) as session:
        for _ in range(steps):
            began = time.perf_counter()
            train_step(ddp, optimizer, batch)
            middle = time.perf_counter()
            session.step(samples=len(batch))
            trains.append(middle - began)
            groups.append(time.perf_counter() - middle)
        sync, plan = GroupSync(dist.group.WORLD), FragmentPlan.of(model)
        for _ in range(max(3, steps // 10)):
            began = time.perf_counter()
            sync.share(model, plan.fragments)
            shares.append(time.perf_counter() - began)
    if rank == 0:
        train, group = statistics.median(trains), statistics.fmean(groups[WARMUP:])
        results.update(
            train_step_s=train,
            group_step_s=group,
            group_step_ratio=group / train,
            group_step_max_s=max(groups[WARMUP:]),
            merge_share_s=statistics.median(shares),
            target_group_step_ratio=TARGET_GROUP_STEP_RATIO,
        )
    dist.barrier()  # neither rank tears its connections down while the other still uses them
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--quick", action="store_true", help="a few steps: that it runs, not what it measures")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps = WARMUP + 40
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with tempfile.TemporaryDirectory() as mailbox, mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(rank_main, args=(port, mailbox, args.steps, results), nprocs=SIZE)
        figures = dict(results)
    for name, value in figures.items():
        print(f"{name:24s} {value:.6g}")
    print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    main()
