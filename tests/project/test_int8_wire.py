"""``benchmarks._int8_wire``: the simulated 8-bit wire rounds as the encoding would, and only state."""

from __future__ import annotations

import doctest

import torch

import benchmarks._int8_wire as int8_wire
from benchmarks._int8_wire import BLOCK, Int8Wire, encoded_bytes, round_trip
from gradientmail import MemoryMailbox, Session, consensus


def test_the_module_examples_run() -> None:
    result = doctest.testmod(int8_wire)
    assert result.attempted > 0 and result.failed == 0


def test_rounding_stays_within_one_step_of_each_block() -> None:
    torch.manual_seed(0)
    values = torch.randn(10 * BLOCK) * torch.linspace(0.01, 10, 10 * BLOCK)
    rounded = round_trip(values)
    steps = values.view(-1, BLOCK).abs().amax(dim=1, keepdim=True) / 127
    assert bool(((rounded - values).view(-1, BLOCK).abs() <= steps * (1 + 1e-6)).all())
    assert len(torch.unique(rounded.view(-1, BLOCK)[0])) <= 255  # 8 bits' worth of levels


def test_a_change_below_one_step_survives_in_expectation() -> None:
    """Round-to-nearest would return the block unchanged every time; stochastic rounding keeps it."""
    torch.manual_seed(1)
    block = torch.zeros(BLOCK)
    block[0] = 127.0  # step 1.0
    block[1] = 0.25  # a quarter step
    mean = torch.stack([round_trip(block) for _ in range(4000)]).mean(dim=0)
    assert abs(float(mean[1]) - 0.25) < 0.05
    assert float(mean[0]) == 127.0  # the block's largest value is exact


def test_only_state_fragments_are_rounded_and_counted() -> None:
    box = MemoryMailbox("int8-wire-test")
    box.clear()
    wire = Int8Wire(box)
    wire.put("queue/claims/u1", b"not safetensors")
    assert box.get("queue/claims/u1") == b"not safetensors" and wire.bytes_sent == 0
    model = torch.nn.Linear(64, 8)
    with Session(model, mailbox=wire, learner_id="node-0", every_steps=1, fragments=2) as session:
        for _ in range(3):
            with torch.no_grad():
                model.weight.add_(0.01)
            session.step(samples=4)
        session.wait()
    assert consensus(box, torch.nn.Linear(64, 8)) == {"node-0": 12}  # nothing lost, read unchanged
    values = sum(p.numel() for p in model.parameters())
    assert wire.bytes_sent > 4 * values  # several fragments, versions and headers were written
    assert wire.bytes_int8 < wire.bytes_sent / 2
    assert encoded_bytes(values) == values + 4 * -(-values // BLOCK)
