"""Node processes for ``test_duplicate_session.py``: a ``Session`` under the default learner id,
alone or beside the user's own ``DataLoader(SharedQueueDataset(...))``.

Every node clears the launcher's rank variables, so two nodes on this host both default to
``{host}-0``, as two copies of one script started by hand do. A node reports on ``events``:
``("entered", pid)`` once inside its ``with session:`` block (after its first batch), then
``("finished", pid, trained)``; or ``("refused", pid, message, written)`` when its Session raised
``DuplicateLearnerError``, with the keys it wrote before that (``written``).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from gradientmail import DuplicateLearnerError, LocalMailbox, Session, SharedQueueDataset
from gradientmail.learner_id import ENV_LEARNER_ID, RANK_VARIABLES
from gradientmail.mailbox.wrappers import MailboxWrapper

UNITS, STEPS = 10, 2
"""The dataset of the ``dataloader`` nodes: 20 batches, one sample each."""
SESSION_STEPS = 20
"""The steps of a node without a dataset, one sample each."""


class WrittenKeys(MailboxWrapper):
    """Records every key this process writes or deletes (what a refused node must not touch)."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.written: list[str] = []

    def put_if_absent(self, key: str, data: bytes) -> bool:
        self.written.append(key)
        return self.inner.put_if_absent(key, data)

    def put(self, key: str, data: bytes) -> None:
        self.written.append(key)
        self.inner.put(key, data)

    def delete(self, key: str) -> None:
        self.written.append(key)
        self.inner.delete(key)

    def replace_if(self, key: str, data: bytes, version: str) -> bool:
        self.written.append(key)
        return self._versioned().replace_if(key, data, version)


def load(identifier: str) -> Iterator[tuple[int, torch.Tensor]]:
    for step in range(STEPS):
        yield step, torch.tensor([int(identifier), step])


@dataclass(frozen=True)
class SessionNode:
    box: str
    mode: str  # "session" (a Session alone) or "dataloader" (beside DataLoader(SharedQueueDataset))
    events: Any
    go: Any = None  # when set: wait for it after the first batch (the test starts another node)
    kill_after_entering: bool = False  # SIGKILL itself once inside (after reporting "entered")


def run(node: SessionNode) -> None:
    for name in (*RANK_VARIABLES, ENV_LEARNER_ID):
        os.environ.pop(name, None)  # two copies of one script on one host: both `{host}-0`
    torch.set_num_threads(1)
    box = WrittenKeys(LocalMailbox(node.box))
    model = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    session = Session(model, mailbox=box, every=timedelta(milliseconds=20))
    trained = 0
    try:
        with session:
            if node.mode == "dataloader":
                units = {f"{i:03d}": f"{i:03d}" for i in range(UNITS)}
                dataset = SharedQueueDataset(units, mailbox=box, load=load)
                batches: Iterator[Any] = iter(torch.utils.data.DataLoader(dataset, batch_size=None))
            else:
                batches = iter(range(SESSION_STEPS))
            for _batch in batches:
                with torch.no_grad():
                    model.weight.add_(1.0)
                session.step(samples=1)
                trained += 1
                if trained == 1:
                    node.events.put(("entered", os.getpid()))
                    if node.kill_after_entering:
                        node.events.close()
                        node.events.join_thread()  # the report reaches the test before the kill
                        os.kill(os.getpid(), signal.SIGKILL)
                    if node.go is not None:
                        node.go.wait(60)
    except DuplicateLearnerError as exc:
        node.events.put(("refused", os.getpid(), str(exc), box.written))
        return
    node.events.put(("finished", os.getpid(), trained))
