"""Old path of ``gradientmail.queue.claim_ahead``, kept as a thin re-export."""

from __future__ import annotations

from gradientmail.queue.claim_ahead import DEFAULT_CLAIM_AHEAD, SMOOTHING, TIED_S, BufferGauge, ClaimAhead, DepthGauge

__all__ = ["BufferGauge", "ClaimAhead", "DEFAULT_CLAIM_AHEAD", "DepthGauge", "SMOOTHING", "TIED_S"]
