"""One rank of ``test_group_teardown.py``'s exit check: ``python tests/helpers/teardown_nodes.py RANK DIR ROUNDS``.

Each round forms a gloo group of two over ``DIR/store-ROUND``, enters a ``Session(group=)`` of
a DDP model, steps, leaves, destroys the group and only then frees the model: the order of a
script whose model lives until ``main`` returns. Freeing it drops the group's last reference
while holding the GIL, so a gloo thread that still needed the GIL to let go of a collective
of the Session's would hang this process there. Prints ``done ROUNDS`` at the end.
"""

from __future__ import annotations

import gc
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from gradientmail import LocalMailbox, Session

torch.set_num_threads(1)  # two processes share two cores


def main(rank: int, base: Path, rounds: int) -> None:
    for round_ in range(rounds):
        dist.init_process_group(
            "gloo",
            init_method=f"file://{base / f'store-{round_}'}",
            rank=rank,
            world_size=2,
            timeout=timedelta(seconds=60),
        )
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
        box = LocalMailbox(base / f"mailbox-{round_}")
        with Session(model, mailbox=box, learner_id="machine", group=dist.group.WORLD) as session:
            for _ in range(3):
                session.step(samples=1)
        dist.barrier()
        dist.destroy_process_group()
        del model, session
        gc.collect()
    print(f"done {rounds}", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]))
