"""The claim protocol's old path: now ``gradientmail.queue.claims`` (the protocol) and
``gradientmail.queue.claimer`` (which unit next); kept as a thin re-export."""

from __future__ import annotations

from gradientmail.errors import KeyTypeError
from gradientmail.queue.claim_index import ClaimIndex, PositionOrder
from gradientmail.queue.claimer import (
    DEFAULT_LISTING,
    LISTING_POLICIES,
    NEAR,
    RISK_LIMIT,
    RISK_MEMORY,
    UNSEEN_RISK,
    Claimer,
    Pick,
)
from gradientmail.queue.claims import (
    claim_body,
    claim_fields,
    parse_claim,
    read_claim,
    try_claim,
    validate_identifier,
    validate_identifiers,
    validate_learner_id,
)
from gradientmail.queue.crowd import CROWD_LIMIT, CROWD_MEMORY, JUMP_WINDOW, SPREAD, STRETCH

__all__ = [
    "CROWD_LIMIT",
    "CROWD_MEMORY",
    "ClaimIndex",
    "Claimer",
    "DEFAULT_LISTING",
    "JUMP_WINDOW",
    "KeyTypeError",
    "LISTING_POLICIES",
    "NEAR",
    "Pick",
    "PositionOrder",
    "RISK_LIMIT",
    "RISK_MEMORY",
    "SPREAD",
    "STRETCH",
    "UNSEEN_RISK",
    "claim_body",
    "claim_fields",
    "parse_claim",
    "read_claim",
    "try_claim",
    "validate_identifier",
    "validate_identifiers",
    "validate_learner_id",
]
