"""Old path of ``gradientmail.queue.batches``, kept as a thin re-export."""

from __future__ import annotations

from gradientmail.queue.batches import MAX_DEPTH, TensorTree, first_non_tensor, map_tensors, to_device

__all__ = ["MAX_DEPTH", "TensorTree", "first_non_tensor", "map_tensors", "to_device"]
