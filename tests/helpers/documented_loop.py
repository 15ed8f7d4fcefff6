"""The documented loop (the design note's ``shared-queue.txt``), verbatim, once for every test that runs it."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch


def run_documented_loop(
    *,
    units: Mapping[str, Any],
    box: Any,
    rank: int,
    nodes: int,
    BATCH: int,  # noqa: N803  (the design note's name)
    load_unit: Callable[[Any], Any],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    session: Any,
    learning_rate: Callable[[int], float],
    device: Any,
) -> torch.Tensor | None:
    """Run the documented loop as written, with the names it uses; returns the last loss (None: no unit)."""
    loss = None
    # ---- the documented loop, verbatim -------------------------------------------------------------
    from gradientmail.patterns.shared_queue import shared_queue

    micro_batch = 8
    share = BATCH // nodes
    accumulation = share // micro_batch

    with (
        session,
        shared_queue(
            units,
            mailbox=box,
            learner_id=f"node-{rank}",
            load=load_unit,
            prefetch=8,
        ) as batches,
    ):
        for step, batch in batches:
            batch = batch.to(device)

            for group in optimizer.param_groups:
                group["lr"] = learning_rate(step)

            for chunk in batch.split(micro_batch):
                with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
                    loss = model(chunk[:, :-1], chunk[:, 1:]) / accumulation
                loss.backward()

            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            session.step(samples=share * 2048)
    # ---- end of the documented loop -------------------------------------------------------------
    return loss
