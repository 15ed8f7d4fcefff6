"""Session and consensus in one process: the state format, the merge rule, enter/exit, failures.

Nodes are several ``Session`` objects on one ``MemoryMailbox`` (or ``LocalMailbox``); the real
multi-process runs are in ``test_session_processes.py``. Nothing here sleeps or measures time:
background work is awaited with ``Session.wait`` or gated with an ``Event`` the test controls.
Models are filled with small integers so that every expected value is exact.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from datetime import timedelta

import pytest
import torch
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save

import gradientmail
from gradientmail import DuplicateLearnerError, MailboxError, MailRejectedError, MemoryMailbox, SessionError
from gradientmail.layout import member_key, state_key
from gradientmail.mailbox.wrappers import CountingMailbox, DelayedMailbox, FaultyMailbox
from gradientmail.session import DelayedNesterov, Session, consensus
from gradientmail.session.chain import KEEP, TOMBSTONE, FragmentChain
from gradientmail.session.fragments import FragmentPlan, float_state, spec_of, to_wire
from gradientmail.session.mail import FORMAT, Contribution, StateHeader, decode, encode
from gradientmail.session.outer import resolve_outer

pytestmark = pytest.mark.timeout(60)


def linear(seed: int = 0, fill: float | None = None) -> torch.nn.Linear:
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    if fill is not None:
        with torch.no_grad():
            model.weight.fill_(fill)
            model.bias.fill_(fill)
    return model


def scalar(value: float = 0.0) -> torch.nn.Linear:
    """A one-parameter model: the toy of the issue (each step moves it by +1)."""
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


# -- the public names --------------------------------------------------------------------------
def test_lazy_names_resolve_to_the_session_module():
    assert gradientmail.Session is Session
    assert gradientmail.consensus is consensus


# -- the state format ------------------------------------------------------------------------
def test_state_is_safetensors_with_a_bounded_header_and_round_trips():
    model = linear(1)
    data = state_bytes(model, version=7, learner="node-1", learners={"node-1": (3, 9, 640, 1.5, False)})
    tensors = safetensors_load(data)  # plain safetensors, readable without gradientmail
    assert set(tensors) == {"weight", "bias"}
    state = decode(data, key=state_key(7), spec=spec_of(float_state(model)))
    assert state.header.version == 7 and state.header.learner == "node-1"
    assert state.header.learners == {"node-1": Contribution(seq=3, step=9, samples=640, time=1.5)}
    assert torch.equal(state.tensors["weight"], model.weight.detach())


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda data: b"", "truncated"),
        (lambda data: data[:5], "truncated"),
        (lambda data: data[: len(data) - 9], "corrupt"),
        (lambda data: b"\xff" * 8 + data[8:], "truncated or corrupt"),
        (lambda data: data[:8] + b"[" + data[9:], "corrupt"),
        (lambda data: b"\x80\x04K\x01." + data, "corrupt"),  # a pickle in front
    ],
    ids=["empty", "five-bytes", "cut-tensor-data", "huge-header-size", "broken-json", "pickle"],
)
def test_corrupt_or_truncated_state_is_rejected(corrupt, message):
    model = linear()
    data = corrupt(state_bytes(model))
    with pytest.raises(MailRejectedError, match=message):
        decode(data, key=state_key(0), spec=spec_of(float_state(model)))


@pytest.mark.parametrize(
    "other, message",
    [
        (torch.nn.Linear(4, 2), r"tensor 'weight' has shape \(2, 4\), expected \(2, 3\)"),
        (torch.nn.Linear(3, 2).double(), r"tensor 'weight' travels as torch.float64, expected torch.float32"),
        (torch.nn.Linear(3, 2, bias=False), r"missing tensors \['bias'\]"),
        (
            torch.nn.Sequential(torch.nn.Linear(3, 2)),
            r"missing tensors \['weight', 'bias'\].*unexpected tensors \['0.bias', '0.weight'\]",
        ),
    ],
    ids=["shape", "dtype", "missing", "names"],
)
def test_state_of_another_model_is_rejected_naming_writer_and_tensor(other, message):
    tensors = {k: v.detach().clone() for k, v in float_state(other).items()}
    data = encode(tensors, StateHeader(version=0, learner="node-9", time=1.0))
    with pytest.raises(MailRejectedError, match=message) as info:
        decode(data, key=state_key(0), spec=spec_of(float_state(linear())))
    assert "'node-9'" in str(info.value)


@pytest.mark.parametrize(
    "metadata, message",
    [
        ({"format": "gradientmail.session/99"}, "has format 'gradientmail.session/99'"),
        ({"format": "gradientmail.session/1", "learner": "a"}, "format 'gradientmail.session/1'.*fresh prefix"),
        (None, "no gradientmail metadata"),
        (
            {
                "format": FORMAT,
                "kind": "version",
                "fragment": "0/1",
                "version": "0",
                "learner": "w",
                "time": "1",
                "learners": "[" * 5000,
            },
            "unreadable metadata",
        ),
        (
            {
                "format": FORMAT,
                "kind": "version",
                "fragment": "0/1",
                "version": "0",
                "learner": "w",
                "time": "1",
                "learners": json.dumps({"..": [0, 0, 0, 1.0, False]}),
            },
            "not one key segment",
        ),
        (
            {
                "format": FORMAT,
                "kind": "version",
                "fragment": "0/1",
                "version": "0",
                "learner": "w",
                "time": "1",
                "learners": json.dumps({"a": [0, -1, 0, 1.0, False]}),
            },
            "not a count",
        ),
        (
            {
                "format": FORMAT,
                "kind": "version",
                "fragment": "0/1",
                "version": "0",
                "learner": "w",
                "time": "1",
                "learners": json.dumps({"a": [0, 0, 0, "soon", False]}),
            },
            "not a finite number",
        ),
        (
            {
                "format": FORMAT,
                "kind": "version",
                "fragment": "0/1",
                "version": "-3",
                "learner": "w",
                "time": "1",
                "learners": "{}",
            },
            "unreadable metadata",
        ),
        ({"format": FORMAT, "kind": "pending", "fragment": "0/1"}, "is not a version"),
        ({"format": FORMAT, "kind": "version", "fragment": "3/2"}, "fragment 3 of 2"),
        ({"format": FORMAT, "kind": "version", "fragment": "x"}, "unreadable fragment"),
        ({"format": "gradientmail.session/2", "version": "0"}, "format 'gradientmail.session/2'.*fresh prefix"),
    ],
    ids=[
        "unknown",
        "old",
        "none",
        "nested",
        "bad-learner",
        "negative",
        "bad-time",
        "bad-version",
        "pending-as-version",
        "bad-fragment",
        "unreadable-fragment",
        "v2",
    ],
)
def test_state_of_another_format_or_with_a_bad_header_is_rejected(metadata, message):
    model = linear()
    tensors = {k: v.detach().clone() for k, v in float_state(model).items()}
    data = safetensors_save(tensors, metadata=metadata)
    with pytest.raises(MailRejectedError, match=message):
        decode(data, key=state_key(0), spec=spec_of(float_state(model)))


def test_mail_of_the_old_format_in_the_prefix_is_refused_naming_it(memory_mailbox):
    tensors = {k: v.detach().clone() for k, v in float_state(linear()).items()}
    memory_mailbox.put(
        "session/node-1/000000000003.safetensors",
        safetensors_save(tensors, metadata={"format": "gradientmail.session/1"}),
    )
    with pytest.raises(
        MailRejectedError,
        match=r"'session/node-1/000000000003.safetensors'.*"
        r"gradientmail.session/1",
    ):
        with session(linear(), memory_mailbox):
            pytest.fail("entered a run of the old format")
    with pytest.raises(MailRejectedError, match="gradientmail.session/1"):
        consensus(memory_mailbox, linear())


def test_a_run_of_session_v2_is_refused_naming_its_format(memory_mailbox):
    tensors = {k: v.detach().clone() for k, v in float_state(linear()).items()}
    memory_mailbox.put(
        "session/state/000000000004.safetensors",
        safetensors_save(tensors, metadata={"format": "gradientmail.session/2", "version": "4"}),
    )
    with pytest.raises(MailRejectedError, match=r"'session/state/000000000004.safetensors'.*session/2.*fresh prefix"):
        with session(linear(), memory_mailbox):
            pytest.fail("entered a run of format 2")
    with pytest.raises(MailRejectedError, match="gradientmail.session/2"):
        consensus(memory_mailbox, linear())


# -- the merge rule: every learner's progress exactly once ----------------------------------------
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


# -- outer optimizers ------------------------------------------------------------------------------
def test_the_default_outer_is_delayed_nesterov(memory_mailbox):
    # Measured best by benchmarks/training.py; momentum moves the toy further than plain folds.
    model = scalar()
    with Session(model, mailbox=memory_mailbox, learner_id="me", every=None, every_steps=1):
        pass
    assert Session(model, mailbox=memory_mailbox, learner_id="x").outer == DelayedNesterov()
    assert run_toy(memory_mailbox, every_steps=1, rounds=8, outer=None) > 1.0


def test_outer_optimizer_is_chosen_by_name_or_object():
    assert resolve_outer("average").name == "average"
    assert resolve_outer("delayed_nesterov") == DelayedNesterov()
    custom = DelayedNesterov(lr=0.5, delay=2)
    assert resolve_outer(custom) is custom
    with pytest.raises(ValueError, match="expected one of"):
        resolve_outer("adam")
    with pytest.raises(TypeError, match="OuterOptimizer"):
        resolve_outer(3)
    with pytest.raises(ValueError, match="momentum"):
        DelayedNesterov(momentum=1.0)


def test_delayed_nesterov_adds_momentum_once_per_delay(memory_mailbox):
    model = scalar()
    outer = DelayedNesterov(lr=0.5, momentum=0.5, delay=2)
    with session(model, memory_mailbox, outer=outer) as s:
        exchange(s, model, 1.0)  # plain: +1
        assert value(model) == 1.0
        exchange(s, model, 1.0)  # +1, then m = 0.5*0 + (1+1)/2 = 1: + 0.5*0.5*1
        assert value(model) == 2.25
        exchange(s, model, 1.0)
        exchange(s, model, 1.0)  # +1, +1, then m = 0.5*1 + 1 = 1.5: + 0.25*1.5
        assert value(model) == 2.25 + 2.0 + 0.375


# -- enter, exit, progress records ------------------------------------------------------------------
def test_exit_folds_the_final_progress_and_leaves_the_member_list(local_mailbox):
    model = scalar()
    with session(model, local_mailbox, learner="node-0") as s:
        assert list(local_mailbox.list("session/members/"))[0].startswith("session/members/node-0.")
        for _ in range(5):
            exchange(s, model, 1.0, samples=16)
        push(model, 2.0)  # progress after the last exchange
    assert value(model) == 7.0
    assert list(local_mailbox.list("session/members/")) == []
    result = scalar()
    assert consensus(local_mailbox, result) == {"node-0": 80}
    assert value(result) == 7.0
    newest = FragmentChain(local_mailbox, 0, 1, {}).list_versions()[-1]
    header = decode(local_mailbox.get(state_key(newest)), key="k", spec=stored_spec(model)).header
    assert header.learners["node-0"].final and header.learners["node-0"].step == 5
    record = json.loads(local_mailbox.get("progress/node-0.json"))
    assert set(record) == {
        "learner",
        "steps",
        "samples",
        "samples_in_run",
        "samples_per_s",
        "units",
        "started",
        "last_seen",
        "finished",
    }
    assert record["learner"] == "node-0" and record["finished"] is True
    assert record["steps"] == 5 and record["samples"] == 80 and record["samples_per_s"] > 0
    assert record["samples_in_run"] == 80  # the final fold holds every sample
    assert record["started"] <= record["last_seen"]


def test_progress_is_written_at_each_exchange(memory_mailbox):
    with session(linear(), memory_mailbox, learner="n") as s:
        s.step(samples=3)
        s.wait()
        first = json.loads(memory_mailbox.get("progress/n.json"))
        s.step(samples=3)
        s.wait()
        second = json.loads(memory_mailbox.get("progress/n.json"))
    assert (first["steps"], first["samples"], first["finished"]) == (1, 3, False)
    assert (second["steps"], second["samples"]) == (2, 6)


def test_entering_writes_a_first_progress_record(memory_mailbox):
    # `gradientmail status` lists a learner from the start, not from its first exchange.
    with session(linear(), memory_mailbox, learner="n", every_steps=1000):
        record = json.loads(memory_mailbox.get("progress/n.json"))
    assert (record["learner"], record["steps"], record["finished"]) == ("n", 0, False)


def test_a_learner_counts_once_in_n_whatever_member_keys_earlier_incarnations_left(memory_mailbox):
    memory_mailbox.put(member_key("n", time.time() - 1), b"{}")  # left by a crashed run of "n"
    model, peer_model = scalar(), scalar()
    with session(model, memory_mailbox, learner="n") as s, session(peer_model, memory_mailbox, "peer"):
        assert len(list(memory_mailbox.list("session/members/n."))) == 2  # nothing of it deleted
        exchange(s, model, 4.0)
        assert value(model) == 2.0  # N = 2: "n" and "peer", not 3


def test_a_second_session_under_a_live_learner_id_is_refused_before_it_writes_anything(memory_mailbox):
    live_model, peer_model = scalar(), scalar()
    with session(live_model, memory_mailbox, "live") as live, session(peer_model, memory_mailbox, "peer") as peer:
        keys = set(memory_mailbox.list())
        with pytest.raises(DuplicateLearnerError, match="'live' is already running in this process: a Session"):
            with session(scalar(), memory_mailbox, "live"):
                pytest.fail("a second Session of a live learner entered")
        assert set(memory_mailbox.list()) == keys  # nothing written, nothing deleted
        exchange(peer, peer_model, 4.0)
        assert value(peer_model) == 2.0  # N is still 2: the live learner counts
        exchange(live, live_model)


# -- the training loop is never slowed or blocked ---------------------------------------------
def test_step_returns_while_the_exchange_is_in_flight(memory_mailbox):
    gated = GatedMailbox(memory_mailbox)
    counting = CountingMailbox(gated)
    with session(linear(), counting, every_steps=1) as s:
        gated.armed.set()
        s.step(samples=1)
        assert gated.waiting.wait(10)
        requests = counting.requests
        for _ in range(200):  # every one would be due; none may wait or start another exchange
            s.step(samples=1)
        assert s.in_flight and s.exchanges == 0 and counting.requests == requests
        gated.open()
        s.wait()
        assert s.exchanges == 1 and s.steps == 201


def test_steps_between_exchanges_make_no_requests(memory_mailbox):
    counting = CountingMailbox(memory_mailbox)
    with session(linear(), counting, every_steps=50) as s:
        before = counting.requests
        for _ in range(49):
            s.step(samples=1)
        assert counting.requests == before and not s.in_flight
        s.step(samples=1)
        assert s.in_flight
        s.wait()


@pytest.mark.slow
def test_delayed_mailbox_exchange_runs_behind_the_training_loop(memory_mailbox):
    slow = DelayedMailbox(memory_mailbox, latency=0.25)
    model, peer_model = scalar(), scalar()
    with session(peer_model, memory_mailbox, "peer") as peer, session(model, slow, every_steps=1) as s:
        exchange(peer, peer_model, 4.0)  # run: 2
        s.step(samples=10)
        s.step(samples=10)  # its listing alone takes 0.25 s: still in flight, and this step returned
        assert s.in_flight and s.exchanges == 0
        s.wait()
        assert value(model) == 2.0


# -- background failures -----------------------------------------------------------------------
def test_background_failure_is_raised_at_next_step_wrapped_in_session_error(memory_mailbox):
    broken = threading.Event()

    def fault(operation, key):
        failing = broken.is_set() and operation == "put_if_absent" and key.startswith("session/")
        return OSError("disk full") if failing else None

    with session(linear(), FaultyMailbox(memory_mailbox, fault), every_steps=1) as s:
        broken.set()
        s.step(samples=1)
        s.wait(timedelta(seconds=10), apply=False)  # failed in the background: raised at the step
        with pytest.raises(SessionError, match="disk full") as info:
            s.step(samples=1)
        assert isinstance(info.value.__cause__, OSError)
        s.step(samples=1)  # starts the next exchange, which fails the same way
        with pytest.raises(SessionError):
            s.wait()
        # ... and exit raises it too instead of losing it
        s.step(samples=1)
        with pytest.raises(SessionError, match="disk full"):
            s.__exit__(None, None, None)


def test_gradientmail_errors_from_the_background_are_raised_as_themselves(memory_mailbox):
    def fault(operation, key):
        return MailboxError("throttled", operation=operation, key=key) if operation == "list" else None

    s = session(linear(), FaultyMailbox(memory_mailbox, fault), catch_up=False)
    with pytest.raises(MailboxError, match="throttled"):
        with s:
            pass  # enter lists the run's state


def test_exit_raises_background_failure_of_the_last_exchange(memory_mailbox):
    broken = threading.Event()

    def fault(operation, key):
        return OSError("gone") if broken.is_set() and operation == "get" else None

    peer_model = scalar()
    with session(peer_model, memory_mailbox, "peer") as peer:
        with pytest.raises(SessionError, match="gone"):
            with session(scalar(), FaultyMailbox(memory_mailbox, fault)) as s:
                exchange(peer, peer_model, 1.0)  # a newer version to read
                broken.set()
                s.step(samples=1)  # the exchange fails reading it; exit must say so
        header = decode(memory_mailbox.get(state_key(1)), key="k", spec=stored_spec(peer_model)).header
        assert "me" not in header.learners  # nothing of "me" was folded
        assert FragmentChain(memory_mailbox, 0, 1, {}).list_versions()[-1] == 1


def test_body_exception_propagates_unmasked_and_no_final_mail_is_sent(memory_mailbox):
    broken = threading.Event()

    def fault(operation, key):
        failing = broken.is_set() and operation == "put_if_absent" and key.startswith("session/")
        return OSError("store down") if failing else None

    before = set(threading.enumerate())
    with pytest.raises(KeyError, match="from the body") as info:
        with session(linear(), FaultyMailbox(memory_mailbox, fault)) as s:
            broken.set()
            s.step(samples=1)
            raise KeyError("from the body")
    assert any("store down" in note for note in getattr(info.value, "__notes__", []))
    assert list(memory_mailbox.list("session/")) == [state_key(0)]  # the base; nothing folded
    assert not [t for t in threading.enumerate() if t not in before and t.name.startswith("gradientmail-session-")]


@pytest.mark.timeout(30)
def test_a_store_that_never_answers_fails_exit_within_the_timeout(memory_mailbox):
    gated = GatedMailbox(memory_mailbox)
    s = session(linear(), gated, timeout=timedelta(seconds=0.2))
    try:
        with pytest.raises(SessionError, match="not answering"):
            with s:
                gated.armed.set()
                s.step(samples=1)
                assert gated.waiting.wait(10)
    finally:
        gated.open()


def test_step_outside_the_context_and_double_enter_are_errors(memory_mailbox):
    s = session(linear(), memory_mailbox)
    with pytest.raises(SessionError, match="inside"):
        s.step(samples=1)
    with s:
        with pytest.raises(SessionError, match="already entered"):
            s.__enter__()
    with pytest.raises(SessionError, match="inside"):
        s.step(samples=1)


# -- arguments -----------------------------------------------------------------------------------
@pytest.mark.parametrize("learner", ["a/b", "", ".hidden", "tab\t", 3])
def test_learner_id_must_be_one_key_segment(memory_mailbox, learner):
    with pytest.raises((ValueError, TypeError)):
        Session(linear(), mailbox=memory_mailbox, learner_id=learner)


@pytest.mark.parametrize("length", [200, 230, 231, 240, 482, 600])
def test_a_learner_id_too_long_for_any_key_it_will_write_is_refused_up_front(memory_mailbox, length):
    learner = "n" * length
    try:
        s = Session(linear(), mailbox=memory_mailbox, learner_id=learner)
    except ValueError as error:
        assert "512 bytes" in str(error) or "255 bytes" in str(error)
        return
    with s:  # accepted: then every key it writes fits, from enter to exit
        s.step(samples=1)


def test_arguments_are_checked(memory_mailbox):
    with pytest.raises(TypeError, match="Mailbox"):
        Session(linear(), mailbox=object(), learner_id="a")
    with pytest.raises(ValueError, match="never exchange"):
        Session(linear(), mailbox=memory_mailbox, learner_id="a", every=None)
    with pytest.raises(ValueError, match="every_steps"):
        Session(linear(), mailbox=memory_mailbox, learner_id="a", every_steps=0)
    with pytest.raises(TypeError, match="timedelta"):
        Session(linear(), mailbox=memory_mailbox, learner_id="a", every=10)
    with pytest.raises(ValueError, match="positive"):
        Session(linear(), mailbox=memory_mailbox, learner_id="a", max_staleness=timedelta(0))
    with session(linear(), memory_mailbox) as s:
        with pytest.raises(ValueError, match=">= 0"):
            s.step(samples=-1)
        with pytest.raises(TypeError):
            s.step(samples=1.5)
        s.step(samples=torch.tensor(3))
        assert s.samples == 3


def test_environment_overrides_the_arguments(memory_mailbox, monkeypatch):
    monkeypatch.setenv("GRADIENTMAIL_SESSION_EVERY_S", "none")
    monkeypatch.setenv("GRADIENTMAIL_SESSION_EVERY_STEPS", "7")
    monkeypatch.setenv("GRADIENTMAIL_SESSION_MAX_STALENESS_S", "90")
    s = Session(linear(), mailbox=memory_mailbox, learner_id="a", every=timedelta(seconds=1))
    assert (s.every, s.every_steps, s.max_staleness) == (None, 7, timedelta(seconds=90))
    monkeypatch.setenv("GRADIENTMAIL_SESSION_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="GRADIENTMAIL_SESSION_TIMEOUT_S"):
        Session(linear(), mailbox=memory_mailbox, learner_id="a")


# -- consensus -----------------------------------------------------------------------------------
def test_consensus_holds_every_learners_progress(memory_mailbox):
    models = {name: scalar() for name in ("a", "b", "c")}
    sessions = {name: session(m, memory_mailbox, name) for name, m in models.items()}
    for s in sessions.values():
        s.__enter__()
    exchange(sessions["a"], models["a"], 3.0, samples=300)
    exchange(sessions["b"], models["b"], 6.0, samples=100)
    sessions["c"].__exit__(None, None, None)  # finished without progress
    result = scalar(-1.0)
    assert consensus(memory_mailbox, result) == {"a": 300, "b": 100, "c": 0}
    assert value(result) == 1.0 + 2.0  # each contribution / 3, during the run
    for name in ("a", "b"):
        sessions[name].__exit__(None, None, None)


def test_consensus_rejects_another_model_without_touching_it(memory_mailbox):
    with session(linear(), memory_mailbox, "a", every_steps=100):
        pass
    other = torch.nn.Linear(2, 2)
    before = params(other)
    with pytest.raises(MailRejectedError, match="'a'"):
        consensus(memory_mailbox, other)
    assert same(params(other), before)
    with pytest.raises(LookupError, match="no run state"):
        consensus(MemoryMailbox(f"empty-{uuid.uuid4().hex}"), linear())


def test_sessions_in_lockstep_end_as_one_model(memory_mailbox):
    models = [linear(seed=i) for i in range(3)]
    sessions = [session(m, memory_mailbox, learner=f"n{i}") for i, m in enumerate(models)]
    for s in sessions:
        s.__enter__()
    for _step in range(30):
        for i, s in enumerate(sessions):
            exchange(s, models[i], 0.01 * (i + 1))
    for s in sessions:
        exchange(s)
    spread = max((m.weight - models[0].weight).abs().max().item() for m in models)
    for s in sessions:
        s.__exit__(None, None, None)
    assert spread < 1e-5
    result = linear()
    consensus(memory_mailbox, result)
    assert torch.allclose(result.weight, models[-1].weight, atol=1e-5)


def test_joining_exchanging_and_leaving_are_logged(memory_mailbox, caplog):
    model = linear()
    with caplog.at_level("DEBUG", logger="gradientmail"):
        with session(model, memory_mailbox, "logged") as s:
            exchange(s, model, 1.0)
    messages = [record.getMessage() for record in caplog.records if record.name == "gradientmail.session"]
    assert any(m.startswith("logged joined the run") for m in messages), messages
    assert any(m.startswith("logged exchange 1: version") for m in messages), messages
    assert any(m.startswith("logged left the run") for m in messages), messages


def test_the_outer_optimizer_can_be_chosen_by_environment(memory_mailbox, monkeypatch):
    monkeypatch.setenv("GRADIENTMAIL_SESSION_OUTER", "average")
    assert Session(linear(), mailbox=memory_mailbox, learner_id="a").outer.name == "average"
    monkeypatch.setenv("GRADIENTMAIL_SESSION_OUTER", "momentum")
    with pytest.raises(ValueError, match="outer='momentum'"):
        Session(linear(), mailbox=memory_mailbox, learner_id="a")


@pytest.mark.parametrize("exchanges", [1, 3, 6, 9])
def test_a_learner_that_leaves_pays_the_retirements_it_owed(memory_mailbox, monkeypatch, exchanges):
    # A lone writer builds on the versions it holds and downloads only every KEEP folds: the
    # versions it wrote since then were not yet proved superseded. Leaving pays them, so the
    # store keeps the last KEEP versions, as documented, however the last folds fell.
    monkeypatch.setenv("GRADIENTMAIL_SESSION_RETIRE_AFTER_S", "0")
    model = scalar()
    with session(model, memory_mailbox, "alone") as s:
        for _ in range(exchanges):
            exchange(s, model, 1.0)
    versions = FragmentChain(memory_mailbox, 0, 1, {}).list_versions()
    live = [v for v in versions if memory_mailbox.get(state_key(v)) != TOMBSTONE]
    assert live == versions[-KEEP:]


def test_the_progress_record_holds_what_the_learners_queue_hands_over(memory_mailbox):
    # The queue reports its figures to the Session through their shared FoldGate: the record
    # shows no units before this learner has a queue on the store, then the units it claimed.
    from gradientmail import SharedQueueDataset

    learner = f"counted-{uuid.uuid4().hex[:8]}"  # units_claimed_by counts per learner id, process-wide
    model = scalar()
    with session(model, memory_mailbox, learner) as s:
        exchange(s, model, 1.0)
        assert json.loads(memory_mailbox.get(f"progress/{learner}.json"))["units"] is None
        units = {f"u{i}": i for i in range(3)}
        dataset = SharedQueueDataset(
            units, mailbox=memory_mailbox, learner_id=learner, load=lambda i: [(i, torch.zeros(1))]
        )
        assert [step for step, _ in dataset] == [0, 1, 2]
        exchange(s, model, 1.0)
        record = json.loads(memory_mailbox.get(f"progress/{learner}.json"))
    assert record["units"] == 3
