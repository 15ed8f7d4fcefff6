"""The merge rule: every learner's progress is applied exactly once, scaled by the learners in
the run, whatever the timing of exchanges, joins, restarts and crashes.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch
from safetensors.torch import load as safetensors_load
from session_toys import (  # tests/helpers/ is on sys.path (tests/conftest.py)
    GatedMailbox,
    exchange,
    linear,
    push,
    run_toy,
    scalar,
    session,
    state_bytes,
    stored_spec,
    value,
)

from gradientmail import MailRejectedError
from gradientmail.layout import state_key
from gradientmail.mailbox.wrappers import CountingMailbox
from gradientmail.session import consensus
from gradientmail.session.chain import KEEP, TOMBSTONE, FragmentChain
from gradientmail.session.fragments import to_wire
from gradientmail.session.mail import decode

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("every_steps", [1, 4, 16])
def test_no_progress_is_lost_or_doubled_in_the_toy(memory_mailbox, every_steps):
    # The old rule (averaging positions of different ages) advanced 0.73 per step here.
    assert run_toy(memory_mailbox, every_steps=every_steps, rounds=4 * every_steps) == pytest.approx(1.0)


def test_each_learners_progress_is_applied_once_scaled_by_the_learners_in_the_run(memory_mailbox):
    a_model, b_model = scalar(), scalar()
    with session(a_model, memory_mailbox, "a") as a, session(b_model, memory_mailbox, "b") as b:
        exchange(a, a_model, 2.0)  # run: 0 + 2/2
        assert value(a_model) == 1.0 and a.version == 1
        exchange(b, b_model, 4.0)  # run: 1 + 4/2; b also receives a's progress
        assert value(b_model) == 3.0 and b.last_weights == {"a": 1, "b": 1}
        exchange(a, a_model)  # nothing new from a: a receives b's progress, once
        assert value(a_model) == 3.0 and a.merges == 1
        exchange(a, a_model)
        assert value(a_model) == 3.0 and a.merges == 1  # b's progress is not applied twice
    result = scalar()
    assert consensus(memory_mailbox, result) == {"a": 3, "b": 1}
    assert value(result) == 3.0


def test_progress_made_while_an_exchange_is_in_flight_is_kept(memory_mailbox):
    gated = GatedMailbox(memory_mailbox)
    model, peer_model = scalar(), scalar()
    with session(peer_model, memory_mailbox, "peer") as peer, session(model, gated) as s:
        gated.armed.set()
        push(model, 4.0)
        s.step(samples=1)  # snapshot at 4 handed to the background, which blocks
        assert gated.waiting.wait(10) and s.in_flight
        push(model, 1.0)  # local progress while the exchange is in flight
        s.step(samples=1)
        assert value(model) == 5.0  # nothing applied yet
        gated.open()
        s.wait()
        assert value(model) == 2.0 + 1.0  # run: 0 + 4/2, plus the progress made meanwhile
        exchange(peer, peer_model, 6.0)
        assert value(peer_model) == 2.0 + 3.0


def test_the_merge_is_applied_at_a_step_boundary_not_by_the_thread(memory_mailbox):
    model, peer_model = scalar(), scalar()
    with session(peer_model, memory_mailbox, "peer") as peer, session(model, memory_mailbox) as s:
        exchange(peer, peer_model, 4.0)  # run: 2
        s.step(samples=1)
        assert s.in_flight
        s.wait(timedelta(seconds=10), apply=False)  # the background finished ...
        assert s.in_flight and value(model) == 0.0  # ... and the model changes only at a step
        s.step(samples=1)
        assert value(model) == 2.0


def test_a_late_joiner_loads_the_run_and_counts_from_then_on(memory_mailbox):
    first = scalar(0.0)
    with session(first, memory_mailbox, "first") as s:
        for _ in range(3):
            exchange(s, first, 1.0)  # alone: N = 1, full progress
        assert value(first) == 3.0
        late = scalar(-50.0)
        with session(late, memory_mailbox, "late") as t:
            assert value(late) == 3.0  # caught up on enter
            exchange(t, late, 2.0)  # N = 2 now
            assert value(late) == 4.0
            exchange(s, first, 2.0)
            assert value(first) == 5.0


def test_the_first_node_sets_the_base_and_every_node_starts_from_it(memory_mailbox):
    a, b = scalar(7.0), scalar(-7.0)
    with session(a, memory_mailbox, "a", every_steps=100), session(b, memory_mailbox, "b", every_steps=100):
        assert value(a) == value(b) == 7.0
    cold = scalar(-1.0)
    with session(cold, memory_mailbox, "cold", catch_up=False, every_steps=100):
        assert value(cold) == -1.0  # catch_up=False keeps its own parameters until it exchanges


def test_a_restarted_learner_continues_its_totals_and_keeps_its_progress(memory_mailbox):
    model = scalar()
    with session(model, memory_mailbox, "n") as s:
        for _ in range(3):
            exchange(s, model, 1.0, samples=10)
    again = scalar(-9.0)
    with session(again, memory_mailbox, "n") as s:
        assert (s.steps, s.samples) == (3, 30)
        assert value(again) == 3.0
        exchange(s, again, 1.0, samples=10)
    result = scalar()
    assert consensus(memory_mailbox, result) == {"n": 40}
    assert value(result) == 4.0
    members = [k for k in memory_mailbox.list("session/members/")]
    assert members == []  # each incarnation left cleanly


def test_exchanging_less_often_than_max_staleness_does_not_make_peers_look_stale(memory_mailbox):
    # max_staleness far below the time between a learner's exchanges (as every=10 min with the
    # default 5 min would be): a peer that folded since this learner's previous exchange is alive.
    short = {"max_staleness": timedelta(microseconds=1)}
    a_model, b_model = scalar(), scalar()
    with session(a_model, memory_mailbox, "a", **short) as a, session(b_model, memory_mailbox, "b", **short) as b:
        exchange(a, a_model, 2.0)  # b joined within three of a's rounds: N = 2, run: 1
        exchange(b, b_model, 2.0)  # run: 2
        exchange(a, a_model, 2.0)  # b folded since a's previous exchange: N = 2, run: 3
        assert value(a_model) == 3.0


def test_a_crashed_peers_progress_stays_and_it_stops_counting(memory_mailbox):
    crashed, model = scalar(), scalar()
    with pytest.raises(RuntimeError, match="crash"):
        with session(crashed, memory_mailbox, "crashed") as c:
            exchange(c, crashed, 4.0)  # folded: stays in the run
            raise RuntimeError("crash")
    assert not any("crashed" in key for key in memory_mailbox.list("session/members/"))
    with session(model, memory_mailbox) as s:
        assert value(model) == 4.0
        exchange(s, model, 2.0)  # alone now: N = 1
        assert value(model) == 6.0


def test_integer_buffers_stay_local_and_float_buffers_are_exchanged(memory_mailbox):
    peer, model = torch.nn.BatchNorm1d(3), torch.nn.BatchNorm1d(3)
    with session(peer, memory_mailbox, "peer") as p, session(model, memory_mailbox) as s:
        with torch.no_grad():
            peer.running_mean.fill_(4.0)
            peer.num_batches_tracked.fill_(100)
        exchange(p)
        exchange(s)
    assert torch.allclose(model.running_mean, torch.full((3,), 2.0))
    assert model.num_batches_tracked.item() == 0


def test_tied_weights_travel_once_and_are_merged_once(memory_mailbox):
    def tied():
        embed = torch.nn.Embedding(4, 2)
        head = torch.nn.Linear(2, 4, bias=False)
        head.weight = embed.weight
        model = torch.nn.Sequential(embed, head)
        with torch.no_grad():
            embed.weight.zero_()
        return model

    model = tied()
    with session(model, memory_mailbox) as s:
        with torch.no_grad():
            model[0].weight.add_(3.0)
        exchange(s)
    assert torch.allclose(model[0].weight, torch.full((4, 2), 3.0))  # once, not twice
    assert model[1].weight is model[0].weight
    assert set(safetensors_load(memory_mailbox.get(state_key(1)))) == {"0.weight"}


def test_half_precision_models_are_summed_in_float32(memory_mailbox):
    model = linear(fill=0.0).to(torch.bfloat16)
    with session(model, memory_mailbox) as s:
        for _ in range(4):
            with torch.no_grad():
                model.weight.add_(0.001)
            exchange(s)
    state = decode(memory_mailbox.get(state_key(4)), key="k", spec=stored_spec(model))
    assert state.tensors["weight"].dtype == torch.float32
    assert model.weight.dtype == torch.bfloat16


def test_bfloat16_wire_halves_the_bytes_and_rounds_without_bias(memory_mailbox):
    model = torch.nn.Linear(64, 64)
    with session(model, memory_mailbox, wire_dtype=torch.bfloat16) as s:
        exchange(s, model, 0.5)
    stored = safetensors_load(memory_mailbox.get(state_key(1)))
    assert stored["weight"].dtype == torch.bfloat16
    result = torch.nn.Linear(64, 64)
    consensus(memory_mailbox, result)  # a bfloat16 run is read by any node
    torch.manual_seed(0)
    values = torch.full((200_000,), 1.0 + 2**-10)  # between two bfloat16 steps (2**-7 apart)
    rounded = to_wire(values, torch.bfloat16).float()
    assert set(rounded.unique().tolist()) == {1.0, 1.0 + 2**-7}
    assert rounded.mean().item() == pytest.approx(1.0 + 2**-10, abs=2e-5)
    with pytest.raises(MailRejectedError, match="travels as torch.bfloat16"):
        with session(torch.nn.Linear(64, 64), memory_mailbox, "f32"):
            pass


def test_concurrent_writers_fold_every_contribution_exactly_once(memory_mailbox, monkeypatch):
    # Eight threads fold at once into one store: versions are lost to each other and re-folded.
    monkeypatch.setenv("GRADIENTMAIL_SESSION_RETIRE_AFTER_S", "0")  # retire as soon as it is safe
    nodes, exchanges = 8, 6
    models = [scalar() for _ in range(nodes)]
    sessions = [session(m, memory_mailbox, f"t{i}") for i, m in enumerate(models)]
    for s in sessions:
        s.__enter__()
    start = threading.Barrier(nodes)

    def train(i: int) -> None:
        start.wait()
        for _ in range(exchanges):
            exchange(sessions[i], models[i], 8.0)

    threads = [threading.Thread(target=train, args=(i,)) for i in range(nodes)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    for s in sessions:
        s.__exit__(None, None, None)
    result = scalar()
    consensus(memory_mailbox, result)
    assert value(result) == nodes * exchanges * 8.0 / nodes  # every contribution once, at 1/N
    versions = FragmentChain(memory_mailbox, 0, 1, {}).list_versions()
    assert versions == list(range(len(versions)))  # each version created once, none skipped
    # A fold that lost the race left its contribution pending instead of folding again: fewer
    # versions than contributions, and no learner ever waited for the chain.
    assert len(versions) <= 1 + nodes * exchanges + nodes
    live = [v for v in versions if memory_mailbox.get(state_key(v)) != TOMBSTONE]
    assert live == versions[-KEEP:]  # older versions retired, never created twice


@pytest.mark.parametrize("learners", [2, 8])
def test_an_exchange_reads_about_one_state_whatever_the_number_of_learners(memory_mailbox, learners):
    model_bytes = len(state_bytes(torch.nn.Linear(32, 32)))
    counting = CountingMailbox(memory_mailbox)
    models = [torch.nn.Linear(32, 32) for _ in range(learners)]
    sessions = [session(m, counting, f"n{i}") for i, m in enumerate(models)]
    for s in sessions:
        s.__enter__()
    before = counting.bytes_read
    for _ in range(3):
        for model, s in zip(models, sessions):
            exchange(s, model, 0.01)
    reads = (counting.bytes_read - before) / model_bytes / (3 * learners)
    for s in sessions:
        s.__exit__(None, None, None)
    assert reads <= 1.05  # one state per exchange (its header grows a line per learner)
