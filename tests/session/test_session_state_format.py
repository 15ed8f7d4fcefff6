"""The public names and the state format: safetensors with a bounded header, versions of
another model or format refused naming what differs.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save
from session_toys import (  # tests/helpers/ is on sys.path (tests/conftest.py)
    linear,
    session,
    state_bytes,
)

import gradientmail
from gradientmail import MailRejectedError
from gradientmail.layout import state_key
from gradientmail.session import Session, consensus
from gradientmail.session.fragments import float_state, spec_of
from gradientmail.session.mail import FORMAT, Contribution, StateHeader, decode, encode

pytestmark = pytest.mark.timeout(60)


def test_lazy_names_resolve_to_the_session_module():
    assert gradientmail.Session is Session
    assert gradientmail.consensus is consensus


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
