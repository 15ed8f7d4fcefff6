"""Train a small GPT on the Python standard library's source with GradientMail.

The documented loop, complete: work units through ``shared_queue``, progress through ``Session``,
the run's model from ``consensus`` at the end. Every process is one learner; a fast one simply
takes more units. Each run needs a fresh mailbox (claims are permanent).

    torchrun --standalone --nproc_per_node=2 examples/train_lm.py --mailbox /tmp/gm-run-1
    python examples/train_lm.py --mailbox s3://my-bucket/runs/exp-7 --rank 0 --world 3
    examples/launch_s3.sh     # several machines, one S3 bucket

``--group``: one learner per machine. The machine's processes train one model with DDP (NCCL
on GPUs, gloo on CPUs) and the run exchanges once per machine (``group=`` for the Session and
the queue). On machine i of M:

    torchrun --standalone --nproc_per_node=8 examples/train_lm.py --group --machine i --machines M --mailbox $RUN

CPU: runs unchanged (about a minute at the default sizes). CUDA: bf16 autocast, pinned memory.
"""

import argparse
import gc
import math
import os
import time
from datetime import timedelta
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gradientmail import Session, Unit, consensus, open_mailbox, rotated_order, unit_grid
from gradientmail.data import TokenReader, build_stdlib_corpus
from gradientmail.layout import progress_key
from gradientmail.patterns.shared_queue import shared_queue
from gradientmail.status import parse_progress


def parse_args() -> argparse.Namespace:
    env = os.environ.get
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mailbox", required=True, help="a directory or s3://bucket/prefix, fresh for each run")
    p.add_argument("--endpoint-url", default=None, help="S3-compatible endpoint (default: AWS)")
    p.add_argument("--data", default=None, help="train token file or URL (default: the stdlib corpus)")
    p.add_argument("--val-data", default=None, help="validation token file (default: the stdlib corpus)")
    p.add_argument("--vocab", type=int, default=256, help="vocabulary of --data (256: bytes)")
    p.add_argument("--data-dir", default=str(Path.home() / ".cache/gradientmail/stdlib"))
    p.add_argument("--rank", type=int, default=int(env("RANK", env("SLURM_PROCID", "0"))))
    p.add_argument(
        "--world",
        type=int,
        default=int(env("WORLD_SIZE", env("SLURM_NTASKS", "1"))),
        help="learners in the run: the lanes of each step (default: torchrun's WORLD_SIZE)",
    )
    p.add_argument("--machine", type=int, default=0, help="this machine's index, with torchrun per machine")
    p.add_argument("--machines", type=int, default=1, help="machines, each running --world processes")
    p.add_argument("--steps", type=int, default=480, help="dataset steps of the run, all learners together")
    p.add_argument("--batch", type=int, default=32, help="sequences per dataset step, all lanes together")
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--unit-steps", type=int, default=20, help="dataset steps per work unit")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--exchange-every", type=float, default=5.0, help="seconds between Session exchanges")
    p.add_argument("--group", action="store_true", help="one learner per machine: DDP inside, group= across")
    p.add_argument("--quick", action="store_true", help="a tiny model and run, for CI")
    args = p.parse_args()
    if args.quick:
        args.steps, args.batch, args.micro_batch, args.unit_steps = 16, 8, 8, 4
        args.seq_len, args.width, args.layers, args.exchange_every = 64, 64, 2, 1.0
    if args.group:  # the learners are the machines; this machine's processes split each batch
        args.rank, args.world = args.machine, args.machines
    else:
        args.rank, args.world = args.machine * args.world + args.rank, args.machines * args.world
    return args


class GPT(nn.Module):
    """A decoder-only transformer over byte tokens: embeddings, pre-norm causal blocks, a head."""

    def __init__(self, vocab: int, seq_len: int, width: int, layers: int) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, width), nn.Embedding(seq_len, width)
        block = nn.TransformerEncoderLayer(
            width, width // 32, 4 * width, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, vocab, bias=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device)
        h = self.tokens(x) + self.positions(torch.arange(x.shape[1], device=x.device))
        logits = self.head(self.norm(self.blocks(h, mask=mask, is_causal=True)))
        return nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def load_unit(reader: TokenReader, batch: int, unit: Unit):
    """The design note's loader: lane ``unit.lane`` of each of the unit's steps (module level: workers pickle it)."""
    share = batch // unit.lanes
    for step in range(unit.first, unit.first + unit.count):
        yield step, reader.sequences(step * batch + unit.lane * share, share)


def learning_rate(step: int, args: argparse.Namespace) -> float:
    warmup = max(1, args.steps // 10)
    return args.lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * step / args.steps)))


def wait_for_learners(box, learners: list[str], timeout: float = 600.0) -> bool:
    """Wait until every learner wrote its final progress record, so consensus holds the whole run."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        records = [parse_progress(learner, box.get(progress_key(learner))) for learner in learners]
        if all(record is not None and record.finished for record in records):
            return True
        time.sleep(0.5)
    return False


@torch.no_grad()
def validation_loss(model: GPT, val: TokenReader, device: torch.device, count: int = 64) -> float:
    starts = torch.linspace(0, len(val) - 1, count).long().tolist()  # spread over the held-out files
    batch = torch.cat([val.sequences(start, 1) for start in starts]).to(device)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        return model(batch[:, :-1], batch[:, 1:]).item()


def main() -> None:
    args = parse_args()
    cuda = torch.cuda.is_available()
    local_rank, local_world = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    device = torch.device("cuda", local_rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if not cuda:  # processes on one machine share its cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    if args.data:
        train_url, val_url, vocab = args.data, args.val_data or args.data, args.vocab
    else:  # every process builds or reuses the same files (written whole, renamed into place)
        corpus = build_stdlib_corpus(args.data_dir)
        train_url, val_url, vocab = corpus.train, corpus.validation, corpus.vocab_size
    endpoint = {"endpoint_url": args.endpoint_url} if args.endpoint_url else {}
    store = {"storage_options": endpoint} if str(train_url).startswith("s3://") else {}  # for s3fs
    train = TokenReader(train_url, seq_len=args.seq_len, vocab_size=vocab, **store)
    val = TokenReader(val_url, seq_len=args.seq_len, vocab_size=vocab, **store)
    if args.batch % args.world:
        raise SystemExit(f"--batch {args.batch} does not split into {args.world} lanes")
    if args.steps * args.batch > len(train):
        raise SystemExit(f"--steps x --batch is {args.steps * args.batch:,} sequences, {train_url} has {len(train):,}")

    torch.manual_seed(0)  # the first learner's model becomes the run's base; the others catch up to it
    model = GPT(vocab, args.seq_len, args.width, args.layers).to(device)
    trained, group, leads = model, None, True
    if args.group:  # this machine's processes: one model in lockstep, one learner of the run
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(minutes=5))
        group, leads = dist.group.WORLD, dist.get_rank() == 0
        trained = DistributedDataParallel(model)  # gradients averaged over the machine's ranks
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    box = open_mailbox(args.mailbox, **endpoint)
    learner = f"node-{args.rank}"
    units = unit_grid(steps=args.steps, unit_steps=args.unit_steps, lanes=args.world)

    started, batches = time.time(), 0
    every = timedelta(seconds=args.exchange_every)
    session = Session(trained, mailbox=box, learner_id=learner, every=every, group=group)
    with (
        session,
        shared_queue(
            units,
            mailbox=box,
            learner_id=learner,
            load=partial(load_unit, train, args.batch),
            prefetch=4,
            pin_memory=cuda,
            order=rotated_order(units, args.rank, args.world),
            group=group,  # with a group: each rank gets its rows of every step
        ) as queue,
    ):
        for step, batch in queue:
            batch = batch.to(device, non_blocking=True)
            for param_group in optimizer.param_groups:
                param_group["lr"] = learning_rate(step, args)
            total = torch.zeros((), device=device)
            for chunk in batch.split(args.micro_batch):  # gradient accumulation: the batch's mean loss
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                    loss = trained(chunk[:, :-1], chunk[:, 1:]) * len(chunk) / len(batch)
                loss.backward()
                total += loss.detach()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            session.step(samples=len(batch))
            batches += 1
            if batches % 10 == 0 and leads:
                print(f"[{learner}] step {step:5d}  loss {total.item():.3f}", flush=True)
    if leads:
        print(f"[{learner}] done: {batches} batches in {time.time() - started:.1f}s", flush=True)
    if group is not None:
        # Tear the group down only once nothing of it is in flight on either rank (gloo aborts a
        # process whose group goes away under a collective's thread), and free the DDP wrapper
        # first: freed after, it destroys the group holding the GIL, which can hang with gloo.
        del trained
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()

    if args.rank == 0 and leads:
        if not wait_for_learners(box, [f"node-{rank}" for rank in range(args.world)]):
            print("not every learner finished within 10 minutes: the consensus is the run so far")
        samples = consensus(box, model)
        print(
            f"validation loss {validation_loss(model, val, device):.4f} (consensus of {len(samples)} "
            f"learners, {sum(samples.values()):,} sequences, {time.time() - started:.1f}s)",
            flush=True,
        )


if __name__ == "__main__":
    main()
