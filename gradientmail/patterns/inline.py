"""Old path of ``gradientmail.queue.inline``, kept as a thin re-export."""

from __future__ import annotations

from gradientmail.queue.inline import INLINE_BYTES, Inline, inline

__all__ = ["INLINE_BYTES", "Inline", "inline"]
