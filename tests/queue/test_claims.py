"""The claim protocol: one create, read back; claim bodies; identifiers and learner ids checked."""

from __future__ import annotations

import json
import random

import pytest
import torch

from gradientmail import MemoryMailbox
from gradientmail.errors import InvalidKeyError, KeyTypeError, UnsafeStoreError
from gradientmail.layout import CLAIMS_PREFIX
from gradientmail.queue import claims
from gradientmail.queue.claimer import Claimer
from gradientmail.queue.claims import claim_body, read_claim, try_claim, validate_identifier, validate_learner_id

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def box():
    mailbox = MemoryMailbox(f"claims-{random.getrandbits(64):x}")
    yield mailbox
    mailbox.clear()


def test_claim_body_is_the_documented_json():
    body = json.loads(claim_body("node-1", "abc", worker=2))
    assert body["learner"] == "node-1" and body["token"] == "abc" and body["worker"] == 2
    assert isinstance(body["pid"], int) and body["host"] and body["claimed_at"] > 0


def test_exactly_one_claimer_wins(box):
    assert try_claim(box, "u1", "node-0") is True
    assert try_claim(box, "u1", "node-1") is False
    assert try_claim(box, "u1", "node-0") is False, "a restarted learner does not reclaim its unit"
    assert read_claim(box, "u1")["learner"] == "node-0"
    assert read_claim(box, "u2") is None


def test_tokens_do_not_come_from_random(box):
    random.seed(0)
    torch.manual_seed(0)
    try_claim(box, "a", "n")
    random.seed(0)
    torch.manual_seed(0)
    try_claim(box, "b", "n")
    assert read_claim(box, "a")["token"] != read_claim(box, "b")["token"]


class ForeignReadBack(MemoryMailbox):
    """A broken store: the create "succeeds" but the value read back is someone else's."""

    def get(self, key, *, max_bytes=None):
        value = super().get(key, max_bytes=max_bytes)
        if value is not None and key.startswith(CLAIMS_PREFIX):
            claim = json.loads(value)
            claim["token"] = "someone else"
            return json.dumps(claim).encode()
        return value


class LosesWrites(MemoryMailbox):
    def get(self, key, *, max_bytes=None):
        return None


def test_read_back_with_another_token_is_not_ours():
    mailbox = ForeignReadBack("claims-foreign")
    try:
        assert try_claim(mailbox, "u", "node-0") is False
        claimer = Claimer(mailbox, ["u", "v"], "node-0")
        assert claimer.claim_next() is None, "a claim that reads back foreign is never loaded"
        assert claimer.stats["conflicts"] == 1  # "u" was seen claimed in the listing
    finally:
        mailbox.clear()


def test_a_claim_read_back_byte_for_byte_is_not_parsed_again(monkeypatch):
    """The read-back compares bytes first: the body just written holds the token (parsing a
    claim cost the simulator about a sixth of its time); other bytes are parsed as before."""
    mailbox = MemoryMailbox("claims-byte-exact")
    try:
        monkeypatch.setattr(claims, "load_claim", lambda data: pytest.fail("the claim was parsed"))
        assert try_claim(mailbox, "u", "node-0") is True
        monkeypatch.undo()
        foreign = ForeignReadBack("claims-byte-exact-foreign")
        try:
            assert try_claim(foreign, "u", "node-0") is False
        finally:
            foreign.clear()
    finally:
        mailbox.clear()


def test_claim_that_cannot_be_read_back_is_an_unsafe_store():
    mailbox = LosesWrites("claims-lost")
    try:
        with pytest.raises(UnsafeStoreError, match="cannot be read back"):
            try_claim(mailbox, "u", "node-0")
    finally:
        mailbox.clear()


def test_identifier_and_learner_validation():
    assert validate_identifier("000001-2.json") == "000001-2.json"
    with pytest.raises(KeyTypeError, match="int"):
        validate_identifier(7)
    with pytest.raises(InvalidKeyError, match="'../x'"):
        validate_identifier("../x")
    assert validate_learner_id("node-0") == "node-0"
    with pytest.raises(InvalidKeyError, match="without '/'"):
        validate_learner_id("a/b")
