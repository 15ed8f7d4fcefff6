"""A compiled or DDP-wrapped model exchanges under its plain names: ``consensus`` into the plain
model works, and a wrapped and an unwrapped learner share one run."""

from __future__ import annotations

import torch

from gradientmail.session import Session, consensus
from gradientmail.session.fragments import float_state, plain_module


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))


def train_one_step(session: Session, net: torch.nn.Module) -> None:
    with torch.no_grad():
        for parameter in net.parameters():
            parameter.add_(0.5)
    session.step(samples=2)


def test_compiled_and_plain_learners_share_one_run_under_plain_names(memory_mailbox):
    compiled = torch.compile(model(), backend="eager")  # never called here: no compiler needed
    assert set(float_state(compiled)) == set(model().state_dict()), "no _orig_mod. prefix"
    plain = model()
    with Session(compiled, mailbox=memory_mailbox, learner_id="compiled", every=None, every_steps=100) as a:
        with Session(plain, mailbox=memory_mailbox, learner_id="plain", every=None, every_steps=100) as b:
            train_one_step(a, compiled)
            train_one_step(b, plain)
    result = model()
    assert consensus(memory_mailbox, result) == {"compiled": 2, "plain": 2}  # into the plain model
    assert not torch.equal(result[0].weight, model()[0].weight), "their progress is in it"


def test_a_ddp_wrapped_model_exchanges_under_its_module_s_names(memory_mailbox, tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        inner = model()
        wrapped = torch.nn.parallel.DistributedDataParallel(inner)
        assert plain_module(torch.compile(wrapped, backend="eager")) is inner
        with Session(
            wrapped, mailbox=memory_mailbox, learner_id="ddp", every=None, every_steps=100, outer="average"
        ) as session:
            train_one_step(session, wrapped)
        result = model()
        assert consensus(memory_mailbox, result) == {"ddp": 2}
        assert torch.allclose(result[0].weight, inner[0].weight)
    finally:
        dist.destroy_process_group()
