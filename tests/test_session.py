"""Session and consensus in one process: mail format, merge rule, enter/exit, failures.

Nodes are several ``Session`` objects on one ``MemoryMailbox`` (or ``LocalMailbox``); the real
multi-process runs are in ``test_session_processes.py``. Nothing here sleeps or measures time:
background work is awaited with ``Session.wait`` or gated with an ``Event`` the test controls.
"""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta

import pytest
import torch
from safetensors.torch import load as safetensors_load

import gradientmail
from gradientmail import MailboxError, MailRejectedError, MemoryMailbox, SessionError
from gradientmail.mailbox.wrappers import CountingMailbox, DelayedMailbox, FaultyMailbox
from gradientmail.session import KEEP_MAIL, Session, consensus
from gradientmail.session.mail import MailHeader, decode, encode, final_key, float_state, mail_key, spec_of

pytestmark = pytest.mark.timeout(60)


def linear(seed: int = 0, fill: float | None = None) -> torch.nn.Linear:
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    if fill is not None:
        with torch.no_grad():
            model.weight.fill_(fill)
            model.bias.fill_(fill)
    return model


def params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def mail_bytes(model: torch.nn.Module, learner: str, *, seq: int = 0, samples: int = 10,
               total: int | None = None, sent: float | None = None, final: bool = False) -> bytes:
    snapshot = {k: v.detach().clone() for k, v in float_state(model).items()}
    header = MailHeader(
        learner=learner, seq=seq, step=seq + 1, samples_total=samples if total is None else total,
        samples_since_previous=samples, time=time.time() if sent is None else sent, final=final,
    )
    return encode(snapshot, header)


def post(mailbox, model, learner, **kwargs) -> None:
    seq = kwargs.get("seq", 0)
    key = final_key(learner) if kwargs.get("final") else mail_key(learner, seq)
    mailbox.put(key, mail_bytes(model, learner, **kwargs))


def session(model, mailbox, learner="me", **kwargs) -> Session:
    kwargs.setdefault("every", None)
    kwargs.setdefault("every_steps", 1)
    return Session(model, mailbox=mailbox, learner_id=learner, **kwargs)


class GatedMailbox(DelayedMailbox):
    """A slow store whose latency is an ``Event``: parameter mail waits until ``open()``."""

    def __init__(self, inner) -> None:
        super().__init__(inner, latency=0)
        self.gate = threading.Event()
        self.waiting = threading.Event()

    def open(self) -> None:
        self.gate.set()

    def put(self, key: str, data: bytes) -> None:
        if key.startswith("session/"):
            self.waiting.set()
            if not self.gate.wait(30):
                raise TimeoutError("the test never opened the gate")
        self.inner.put(key, data)


# -- the public names --------------------------------------------------------------------------
def test_lazy_names_resolve_to_the_session_module():
    assert gradientmail.Session is Session
    assert gradientmail.consensus is consensus


# -- mail format -----------------------------------------------------------------------------
def test_mail_is_safetensors_with_metadata_and_round_trips():
    model = linear(1)
    data = mail_bytes(model, "node-1", seq=7, samples=64, total=640)
    tensors = safetensors_load(data)  # plain safetensors, readable without gradientmail
    assert set(tensors) == {"weight", "bias"}
    mail = decode(data, key=mail_key("node-1", 7), spec=spec_of(float_state(model)), learner="node-1")
    assert mail.header.seq == 7 and mail.header.samples_total == 640
    assert mail.header.samples_since_previous == 64 and mail.header.learner == "node-1"
    assert torch.equal(mail.tensors["weight"], model.weight.detach())


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
def test_corrupt_or_truncated_mail_is_rejected(corrupt, message):
    model = linear()
    data = corrupt(mail_bytes(model, "peer"))
    with pytest.raises(MailRejectedError, match=message):
        decode(data, key="session/peer/000000000000.safetensors", spec=spec_of(float_state(model)))


@pytest.mark.parametrize(
    "other, message",
    [
        (torch.nn.Linear(4, 2), r"tensor 'weight' has shape \(2, 4\), expected \(2, 3\)"),
        (torch.nn.Linear(3, 2).double(), r"tensor 'weight' has dtype torch.float64, expected torch.float32"),
        (torch.nn.Linear(3, 2, bias=False), r"missing tensors \['bias'\]"),
        (
            torch.nn.Sequential(torch.nn.Linear(3, 2)),
            r"missing tensors \['weight', 'bias'\].*unexpected tensors \['0.bias', '0.weight'\]",
        ),
    ],
    ids=["shape", "dtype", "missing", "names"],
)
def test_mail_from_another_model_is_rejected_naming_learner_and_tensor(other, message):
    data = mail_bytes(other, "node-9")
    with pytest.raises(MailRejectedError, match=message) as info:
        decode(data, key="session/node-9/000000000000.safetensors", spec=spec_of(float_state(linear())))
    assert "'node-9'" in str(info.value)


def test_mail_with_other_format_or_sender_is_rejected():
    model = linear()
    spec = spec_of(float_state(model))
    snapshot = {k: v.detach().clone() for k, v in float_state(model).items()}
    from safetensors.torch import save

    with pytest.raises(MailRejectedError, match="format"):
        decode(save(snapshot, metadata={"format": "gradientmail.session/99"}), key="k", spec=spec)
    with pytest.raises(MailRejectedError, match="no gradientmail metadata"):
        decode(save(snapshot), key="k", spec=spec)
    with pytest.raises(MailRejectedError, match="lies under 'b'"):
        decode(mail_bytes(model, "a"), key="k", spec=spec, learner="b")


# -- the merge rule --------------------------------------------------------------------------
def test_merge_is_sample_weighted_and_keeps_local_progress(memory_mailbox):
    """theta_now += (w_s*theta_s + w_p*theta_p)/(w_s + w_p) - theta_s, applied at a step."""
    peer = linear(fill=4.0)
    post(memory_mailbox, peer, "peer", samples=30)
    gated = GatedMailbox(memory_mailbox)
    model = linear(fill=0.0)
    with session(model, gated, catch_up=False) as s:
        s.step(samples=10)  # due: snapshot (all zeros) handed to the background, which blocks
        assert gated.waiting.wait(10) and s.in_flight
        with torch.no_grad():  # local progress made while the exchange is in flight
            model.weight.add_(1.0)
        s.step(samples=10)
        s.step(samples=10)
        assert s.merges == 0 and torch.equal(model.weight, torch.ones(2, 3))  # nothing applied yet
        gated.open()
        s.wait()
        # merged = (10 * 0 + 30 * 4) / 40 = 3; delta = 3 - 0 on top of the local progress
        assert torch.allclose(model.weight, torch.full((2, 3), 4.0))
        assert torch.allclose(model.bias, torch.full((2,), 3.0))
        assert s.merges == 1 and s.last_weights == {"peer": 30, "me": 10}


def test_merge_is_applied_at_a_step_boundary_not_by_the_thread(memory_mailbox):
    post(memory_mailbox, linear(fill=2.0), "peer", samples=10)
    model = linear(fill=0.0)
    gated = GatedMailbox(memory_mailbox)
    with session(model, gated, catch_up=False) as s:
        s.step(samples=10)
        gated.open()
        # The background finishes, but the model changes only inside the next step().
        deadline = time.monotonic() + 10
        while s._job is not None and not s._job.done.is_set():
            assert time.monotonic() < deadline
            s._job.done.wait(0.1)
        assert torch.equal(model.weight, torch.zeros(2, 3))
        s.step(samples=10)
        assert torch.allclose(model.weight, torch.ones(2, 3))


def test_peer_mail_counts_once_and_stale_or_empty_mail_never(memory_mailbox):
    model = linear(fill=0.0)
    post(memory_mailbox, linear(fill=8.0), "old", samples=10, sent=time.time() - 3600)
    post(memory_mailbox, linear(fill=8.0), "idle", samples=0)
    post(memory_mailbox, linear(fill=2.0), "peer", samples=10)
    with session(model, memory_mailbox, catch_up=False, max_staleness=timedelta(minutes=1)) as s:
        s.step(samples=10)
        s.wait()
        assert s.last_weights == {"peer": 10, "me": 10}
        assert torch.allclose(model.weight, torch.ones(2, 3))
        s.step(samples=10)  # the same peer mail again: nothing new, nothing applied
        s.wait()
        assert s.merges == 1 and torch.allclose(model.weight, torch.ones(2, 3))
        post(memory_mailbox, linear(fill=5.0), "peer", seq=1, samples=30)
        s.step(samples=10)
        s.wait()
        assert s.merges == 2 and s.last_weights == {"peer": 30, "me": 10}
        assert torch.allclose(model.weight, torch.full((2, 3), (10 * 1 + 30 * 5) / 40))


def test_integer_buffers_stay_local_and_float_buffers_are_averaged(memory_mailbox):
    peer = torch.nn.BatchNorm1d(3)
    with torch.no_grad():
        peer.running_mean.fill_(2.0)
        peer.num_batches_tracked.fill_(100)
    post(memory_mailbox, peer, "peer", samples=10)
    model = torch.nn.BatchNorm1d(3)
    with session(model, memory_mailbox, catch_up=False) as s:
        s.step(samples=10)
        s.wait()
    assert torch.allclose(model.running_mean, torch.ones(3))
    assert model.num_batches_tracked.item() == 0


def test_tied_weights_travel_once_and_are_merged_once(memory_mailbox):
    def tied(fill):
        embed = torch.nn.Embedding(4, 2)
        head = torch.nn.Linear(2, 4, bias=False)
        head.weight = embed.weight
        model = torch.nn.Sequential(embed, head)
        with torch.no_grad():
            embed.weight.fill_(fill)
        return model

    post(memory_mailbox, tied(2.0), "peer", samples=10)
    model = tied(0.0)
    with session(model, memory_mailbox, catch_up=False) as s:
        s.step(samples=10)
        s.wait()
    assert torch.allclose(model[0].weight, torch.ones(4, 2))  # once, not twice
    assert model[1].weight is model[0].weight


def test_half_precision_models_merge_in_float32(memory_mailbox):
    post(memory_mailbox, linear(fill=1.0).to(torch.bfloat16), "peer", samples=1)
    model = linear(fill=0.0).to(torch.bfloat16)
    with session(model, memory_mailbox, catch_up=False) as s:
        s.step(samples=3)
        s.wait()
    assert model.weight.dtype == torch.bfloat16
    assert torch.allclose(model.weight.float(), torch.full((2, 3), 0.25))


# -- rejected mail ---------------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["incompatible", "corrupt"])
def test_rejected_peer_mail_is_raised_at_next_step_and_model_untouched(memory_mailbox, bad):
    if bad == "incompatible":
        post(memory_mailbox, torch.nn.Linear(5, 2), "wrong")
    else:
        memory_mailbox.put(mail_key("wrong", 0), mail_bytes(linear(), "wrong")[:-7])
    post(memory_mailbox, linear(fill=3.0), "fine", samples=10)
    model = linear(fill=1.0)
    before = params(model)
    with session(model, memory_mailbox, catch_up=False) as s:
        s.step(samples=10)  # starts the exchange
        with pytest.raises(MailRejectedError, match="'wrong'"):
            s.wait()
        assert same(params(model), before)
        s.step(samples=10)  # the same bad mail is raised once, not at every exchange
        s.wait()
        assert "wrong" not in s.last_weights


def test_incompatible_mail_on_enter_raises_and_leaves_model_untouched(memory_mailbox):
    post(memory_mailbox, torch.nn.Linear(3, 5), "wrong")
    model = linear()
    before = params(model)
    with pytest.raises(MailRejectedError, match=r"'wrong'.*shape \(5, 3\), expected \(2, 3\)"):
        with session(model, memory_mailbox):
            pytest.fail("entered")
    assert same(params(model), before)


# -- catch-up, exit, cleanup -----------------------------------------------------------------
def test_enter_catches_up_to_the_sample_weighted_average(memory_mailbox):
    post(memory_mailbox, linear(fill=1.0), "a", samples=5, total=100)
    post(memory_mailbox, linear(fill=5.0), "b", samples=5, total=300, seq=3)
    post(memory_mailbox, linear(fill=9.0), "c", samples=5, total=999, seq=0)
    post(memory_mailbox, linear(fill=0.0), "c", samples=5, total=0, seq=1, final=True)
    model = linear(fill=-1.0)
    with session(model, memory_mailbox, every_steps=100):
        # (100 * 1 + 300 * 5 + 0 * 0) / 400: c's final (newest) mail counts, not its numbered one
        assert torch.allclose(model.weight, torch.full((2, 3), 4.0))
    cold = linear(fill=-1.0)
    with session(cold, memory_mailbox, learner="cold", catch_up=False, every_steps=100):
        assert torch.allclose(cold.weight, torch.full((2, 3), -1.0))


def test_catch_up_marks_peer_mail_as_read(memory_mailbox):
    post(memory_mailbox, linear(fill=2.0), "peer", samples=10)
    model = linear(fill=0.0)
    with session(model, memory_mailbox) as s:
        assert torch.allclose(model.weight, torch.full((2, 3), 2.0))
        s.step(samples=10)
        s.wait()
        assert s.merges == 0  # already part of the model; not merged a second time


def test_exit_mails_final_state_and_progress_and_deletes_numbered_mail(local_mailbox):
    model = linear()
    with session(model, local_mailbox, learner="node-0") as s:
        for _ in range(5):
            s.step(samples=16)
            s.wait()
            numbered = [k for k in local_mailbox.list("session/node-0/") if "final" not in k]
            assert 1 <= len(numbered) <= KEEP_MAIL
        with torch.no_grad():
            model.weight.fill_(7.0)
    assert list(local_mailbox.list("session/")) == ["session/node-0/final.safetensors"]
    final = decode(local_mailbox.get(final_key("node-0")), key="final", spec=spec_of(float_state(model)))
    assert final.header.final and final.header.samples_total == 80 and final.header.step == 5
    assert torch.equal(final.tensors["weight"], torch.full((2, 3), 7.0))
    record = json.loads(local_mailbox.get("progress/node-0.json"))
    assert set(record) == {"learner", "steps", "samples", "samples_per_s", "units", "started", "last_seen",
                           "finished"}
    assert record["learner"] == "node-0" and record["finished"] is True
    assert record["steps"] == 5 and record["samples"] == 80 and record["samples_per_s"] > 0
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


def test_restarted_learner_continues_sequence_and_totals(memory_mailbox):
    model = linear(fill=3.0)
    with session(model, memory_mailbox, learner="n") as s:
        for _ in range(3):
            s.step(samples=10)
        s.wait()
    first = decode(memory_mailbox.get(final_key("n")), key="f", spec=spec_of(float_state(model))).header
    peer = linear(fill=0.0)
    with session(peer, memory_mailbox, learner="peer", every_steps=1000):
        pass
    again = linear(fill=0.0)
    with session(again, memory_mailbox, learner="n") as s:
        assert (s.steps, s.samples) == (3, 30)
        assert torch.allclose(again.weight, torch.full((2, 3), 3.0))  # peer has no samples
        assert final_key("n") not in set(memory_mailbox.list("session/"))
        s.step(samples=10)
        s.wait()
    final = decode(memory_mailbox.get(final_key("n")), key="f", spec=spec_of(float_state(again)))
    assert final.header.samples_total == 40 and final.header.seq > first.seq + 1


# -- the training loop is never slowed or blocked ---------------------------------------------
def test_step_returns_while_the_exchange_is_in_flight(memory_mailbox):
    gated = GatedMailbox(memory_mailbox)
    counting = CountingMailbox(gated)
    with session(linear(), counting, every_steps=1) as s:
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


def test_delayed_mailbox_exchange_runs_behind_the_training_loop(memory_mailbox):
    slow = DelayedMailbox(memory_mailbox, latency=0.25)
    post(memory_mailbox, linear(fill=2.0), "peer", samples=10)
    model = linear(fill=0.0)
    with session(model, slow, catch_up=False, every_steps=1) as s:
        s.step(samples=10)
        s.step(samples=10)  # its put alone takes 0.25 s: still in flight, and this step returned
        assert s.in_flight and s.exchanges == 0
        s.wait()
    assert torch.allclose(model.weight, torch.ones(2, 3))


# -- background failures -----------------------------------------------------------------------
def test_background_failure_is_raised_at_next_step_wrapped_in_session_error(memory_mailbox):
    def fault(operation, key):
        return OSError("disk full") if operation == "put" and key.startswith("session/") else None

    with session(linear(), FaultyMailbox(memory_mailbox, fault), every_steps=1) as s:
        s.step(samples=1)
        s._job.done.wait(10)
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
            pass  # enter lists this learner's own mail


def test_exit_raises_background_failure_of_the_last_exchange(memory_mailbox):
    broken = threading.Event()

    def fault(operation, key):
        return OSError("gone") if broken.is_set() and operation == "get" else None

    post(memory_mailbox, linear(fill=1.0), "peer", seq=0)
    with pytest.raises(SessionError, match="gone"):
        with session(linear(), FaultyMailbox(memory_mailbox, fault), catch_up=False) as s:
            broken.set()
            s.step(samples=1)  # the exchange fails reading the peer; exit must say so
    assert final_key("me") not in set(memory_mailbox.list("session/"))


def test_body_exception_propagates_unmasked_and_no_final_mail_is_sent(memory_mailbox):
    def fault(operation, key):
        return OSError("store down") if operation == "put" and key.startswith("session/") else None

    with pytest.raises(KeyError, match="from the body") as info:
        with session(linear(), FaultyMailbox(memory_mailbox, fault)) as s:
            s.step(samples=1)
            raise KeyError("from the body")
    assert any("store down" in note for note in getattr(info.value, "__notes__", []))
    assert list(memory_mailbox.list("session/")) == []
    assert not s._worker._thread.is_alive()


@pytest.mark.timeout(30)
def test_a_store_that_never_answers_fails_exit_within_the_timeout(memory_mailbox):
    gated = GatedMailbox(memory_mailbox)
    s = session(linear(), gated, timeout=timedelta(seconds=0.2))
    try:
        with pytest.raises(SessionError, match="not answering"):
            with s:
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
def test_consensus_is_the_samples_total_weighted_average_of_final_states(memory_mailbox):
    post(memory_mailbox, linear(fill=1.0), "a", total=300, final=True, seq=9)
    post(memory_mailbox, linear(fill=5.0), "b", total=100, seq=4)  # never finished: newest mail
    post(memory_mailbox, linear(fill=100.0), "b", total=50, seq=3)
    model = linear(fill=0.0)
    assert consensus(memory_mailbox, model) == {"a": 300, "b": 100}
    assert torch.allclose(model.weight, torch.full((2, 3), 2.0))


def test_consensus_rejects_another_model_without_touching_it(memory_mailbox):
    post(memory_mailbox, linear(fill=1.0), "a", final=True)
    other = torch.nn.Linear(2, 2)
    before = params(other)
    with pytest.raises(MailRejectedError, match="'a'"):
        consensus(memory_mailbox, other)
    assert same(params(other), before)
    with pytest.raises(LookupError, match="no parameter mail"):
        consensus(MemoryMailbox("empty-consensus"), linear())


def test_sessions_in_lockstep_converge_to_one_model(memory_mailbox):
    models = [linear(fill=float(i)) for i in range(3)]
    sessions = [session(m, memory_mailbox, learner=f"n{i}", catch_up=False) for i, m in enumerate(models)]
    for s in sessions:
        s.__enter__()
    for _ in range(30):
        for s in sessions:
            s.step(samples=8)
            s.wait()
    spread = max((m.weight - models[0].weight).abs().max().item() for m in models)
    for s in sessions:
        s.__exit__(None, None, None)
    assert spread < 1e-3
    result = linear()
    consensus(memory_mailbox, result)
    assert torch.allclose(result.weight, models[0].weight, atol=1e-3)
