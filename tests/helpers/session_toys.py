"""Small models and one-process Sessions shared by the Session tests: exact arithmetic, gated stores.

Nodes are several ``Session`` objects on one mailbox in one process (the multi-process runs are in
``test_session_processes.py``); nothing sleeps or measures time: background work is awaited with
``Session.wait`` or gated by the test. Models hold small integers, so expected values are exact.
"""

from __future__ import annotations

import threading
import time

import torch
from safetensors.torch import save as safetensors_save

from gradientmail.mailbox.wrappers import DelayedMailbox
from gradientmail.session import Session, consensus
from gradientmail.session.fragments import FragmentPlan, float_state
from gradientmail.session.mail import Contribution, StateHeader, encode


def linear(seed: int = 0, fill: float | None = None) -> torch.nn.Linear:
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    if fill is not None:
        with torch.no_grad():
            model.weight.fill_(fill)
            model.bias.fill_(fill)
    return model


def scalar(value: float = 0.0) -> torch.nn.Linear:
    """A one-parameter model for the toy run: each step moves it by +1."""
    model = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(value)
    return model


def value(model: torch.nn.Module) -> float:
    return float(next(model.parameters()).detach().flatten()[0])


def push(model: torch.nn.Module, amount: float = 1.0) -> None:
    """Local training progress: move every parameter by ``amount``."""
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(amount)


def params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def state_bytes(
    model: torch.nn.Module,
    *,
    version: int = 0,
    learner: str = "w",
    learners: dict | None = None,
    metadata: dict | None = None,
) -> bytes:
    tensors = {k: v.detach().float().clone() for k, v in float_state(model).items()}
    header = StateHeader(
        version=version,
        learner=learner,
        time=time.time(),
        learners={k: Contribution(*v) for k, v in (learners or {}).items()},
    )
    if metadata is not None:
        return safetensors_save(tensors, metadata=metadata)
    return encode(tensors, header)


def stored_spec(model: torch.nn.Module) -> dict:
    """What a stored version of a one-fragment run of ``model`` holds: flat pieces, float32."""
    return FragmentPlan.of(model, 1).stored_spec(0, None)


def session(model, mailbox, learner="me", **kwargs) -> Session:
    """A session exchanging at every step; the plain outer rule, so that arithmetic is exact."""
    kwargs.setdefault("every", None)
    kwargs.setdefault("every_steps", 1)
    kwargs.setdefault("outer", "average")
    return Session(model, mailbox=mailbox, learner_id=learner, **kwargs)


def exchange(s: Session, model: torch.nn.Module | None = None, amount: float = 0.0, samples: int = 1) -> None:
    """One step (with ``amount`` of local progress first) that exchanges, awaited."""
    if model is not None and amount:
        push(model, amount)
    s.step(samples=samples)
    s.wait()


class GatedMailbox(DelayedMailbox):
    """A slow store: once armed, folds into the run's state wait until ``open()``."""

    def __init__(self, inner) -> None:
        super().__init__(inner, latency=0)
        self.armed = threading.Event()
        self.gate = threading.Event()
        self.waiting = threading.Event()

    def open(self) -> None:
        self.gate.set()

    def _hold(self, key: str) -> None:
        if self.armed.is_set() and key.startswith("session/fragments/"):
            self.waiting.set()
            if not self.gate.wait(30):
                raise TimeoutError("the test never opened the gate")

    def put(self, key: str, data: bytes) -> None:
        self._hold(key)
        self.inner.put(key, data)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        self._hold(key)
        return self.inner.put_if_absent(key, data)


def run_toy(mailbox, *, nodes: int = 4, every_steps: int = 4, rounds: int = 40, outer: str | None = "average") -> float:
    """Equal nodes, each step +1, exchanges staggered: the consensus advance per node step.
    ``outer=None``: the session's default outer optimizer."""
    models = [scalar(0.0) for _ in range(nodes)]
    options = {} if outer is None else {"outer": outer}
    sessions = [
        Session(m, mailbox=mailbox, learner_id=f"n{i}", every=None, every_steps=every_steps, **options)
        for i, m in enumerate(models)
    ]
    for s in sessions:
        s.__enter__()
    steps = [0] * nodes

    def one(i: int) -> None:
        exchange(sessions[i], models[i], 1.0)
        steps[i] += 1

    for i in range(nodes):  # stagger: node i starts i steps ahead
        for _ in range(i % every_steps):
            one(i)
    for _ in range(rounds):
        for i in range(nodes):
            one(i)
    for s in sessions:
        s.__exit__(None, None, None)
    result = scalar()
    consensus(mailbox, result)
    return value(result) / (sum(steps) / nodes)
