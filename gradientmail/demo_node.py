"""Old home of one demo node, now in ``gradientmail.cli.demo_node``; re-exported here."""

from gradientmail.cli.demo_node import (
    BATCH,
    EXCHANGE_EVERY,
    FEATURES,
    HIDDEN,
    VALIDATION,
    NodeConfig,
    consensus_process,
    make_model,
    node_process,
    run_node,
    synthetic_batch,
    validation_loss,
)

__all__ = [
    "BATCH",
    "EXCHANGE_EVERY",
    "FEATURES",
    "HIDDEN",
    "VALIDATION",
    "NodeConfig",
    "consensus_process",
    "make_model",
    "node_process",
    "run_node",
    "synthetic_batch",
    "validation_loss",
]
