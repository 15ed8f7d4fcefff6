"""Whether this learner still owns the units it trains: the checks before a fold lands.

With leases, peers take over the units of a node they judge dead (its lease record stood still a
whole lease). The node may only be frozen or slow; before it folds batches of those units into
the run, it must find their claims still its own (else ``LeaseLostError``: it stops, and the
taker trains those batches once). ``check`` reads the claims; ``confirm`` also marks each one
(``fold_beat``, a compare-and-swap), so that no peer takes it over until the claim stood still
a whole lease again: a fold that starts right after lands first, unless it takes longer than a
lease (see docs/elastic.md).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from gradientmail.claim_record import ClaimRecord
from gradientmail.errors import LeaseLostError
from gradientmail.layout import claim_key
from gradientmail.queue.claims import load_claim

__all__ = ["CONFIRM_ATTEMPTS", "UnitOwnership"]

CONFIRM_ATTEMPTS = 3
"""Compare-and-swap attempts of ``confirm`` on one claim (only its owner rewrites it)."""


class UnitOwnership:
    """Checks the claims of ``units()`` (unit -> the claim token this learner holds)."""

    def __init__(
        self, mailbox: Any, learner_id: str, lease_s: float | None, units: Callable[[], Mapping[str, str]]
    ) -> None:
        self.mailbox = mailbox
        self.learner_id = learner_id
        self.lease_s = lease_s
        self.units = units

    def check(self, paused_s: float | None = None) -> None:
        """Raise ``LeaseLostError`` if a peer took one of the units over (one read each)."""
        for unit, owned in self.units().items():
            claim = load_claim(self.mailbox.get(claim_key(unit)))
            if claim is not None and claim.token != owned:
                raise self.lost(unit, claim, paused_s)

    def confirm(self) -> None:
        """``check``, and a fresh ``fold_beat`` in each claim (a read and a compare-and-swap).

        A peer takes a unit over only once its claim stood still a whole lease (``ElasticClaimer``
        keys that by token and beat); without the mark, a node judged dead while merely slow could
        fold batches a peer had just taken over and trains again (counted twice).
        """
        for unit, owned in self.units().items():
            key = claim_key(unit)
            for _ in range(CONFIRM_ATTEMPTS):
                got = self.mailbox.get_versioned(key)
                claim = None if got is None else load_claim(got[0])
                if got is None or claim is None:
                    break  # no readable claim: nothing to take over, nothing to mark
                if claim.token != owned:
                    raise self.lost(unit, claim)
                beat = claim.fields.get("fold_beat")
                beat = beat + 1 if isinstance(beat, int) and not isinstance(beat, bool) else 1
                if self.mailbox.replace_if(key, claim.replace(fold_beat=beat).to_bytes(), got[1]):
                    break
            else:  # the claim kept changing under the same token: not ours to vouch for
                raise LeaseLostError(
                    f"learner {self.learner_id!r}: the claim of unit {unit!r} kept changing while this "
                    f"process marked it before a fold ({CONFIRM_ATTEMPTS} attempts); it stops so that no "
                    "batch is trained twice"
                )

    def lost(self, unit: str, claim: ClaimRecord, paused_s: float | None = None) -> LeaseLostError:
        """The error of a unit taken over by ``claim``'s learner."""
        why = (
            f"while this process stood still for {paused_s:.1f} s"
            if paused_s is not None
            else "because its lease record lagged (a slow store, a stalled process or a pause)"
        )
        lease = f"lease {self.lease_s:g} s" if self.lease_s is not None else "no lease"
        return LeaseLostError(
            f"learner {self.learner_id!r}: unit {unit!r} was taken over by {claim.learner!r} {why} "
            f"({lease}: its peers judged it dead); it stops so that no batch is trained twice. "
            "Restart it with resume=True to continue the run; give it a longer lease if such pauses "
            "are expected"
        )
