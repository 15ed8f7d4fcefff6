"""The model a Session is given: compiled or DDP-wrapped, it exchanges under its plain names
(``consensus`` into the plain model works, wrapped and unwrapped learners share one run); trained
without ``session.step()``, the learner is told it counts nothing."""

from __future__ import annotations

import pytest
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


def test_a_loop_that_never_steps_the_session_is_told_so(memory_mailbox):
    """Forgetting ``session.step()`` leaves status and consensus at 0 samples: said on leaving."""
    net = model()
    with pytest.warns(UserWarning, match="session.step\\(\\) was never called"):
        with Session(net, mailbox=memory_mailbox, learner_id="forgetful", every=None, every_steps=100):
            with torch.no_grad():
                net[0].weight.add_(1.0)  # trained, never stepped


def test_a_session_left_untrained_is_not_warned_about(memory_mailbox, recwarn):
    with Session(model(), mailbox=memory_mailbox, learner_id="idle", every=None, every_steps=100):
        pass
    assert not [w for w in recwarn if "session.step" in str(w.message)]
