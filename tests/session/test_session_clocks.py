"""Progress counts once whatever the machines' clocks say: nodes in processes whose wall clocks
disagree by minutes and hours, and the liveness rule for ``N`` on an injected clock.

Nothing here sleeps or measures time: the processes' steps are driven in turn over pipes
(``clock_nodes.run_lockstep``), and the rule's clock is a number the test sets.
"""

from __future__ import annotations

import pytest
import torch
from clock_nodes import ClockNode, run_lockstep  # tests/helpers/ is on sys.path (tests/conftest.py)

from gradientmail import LocalMailbox, consensus

OFFSETS_S = (0.0, 600.0, -600.0, 3600.0, -3600.0)
"""The nodes' wall clocks: right, 10 minutes ahead and behind, an hour ahead and behind."""


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_each_nodes_progress_counts_once_whatever_its_clock_says(tmp_path):
    nodes = [ClockNode(f"clock{offset:+.0f}", offset, i) for i, offset in enumerate(OFFSETS_S)]
    rounds = 4
    # Every node is in the run for every step, so N = 5 for every fold: a push of 5 per step
    # adds exactly 1 to the node's own parameter of the run.
    run_lockstep(tmp_path / "box", nodes, rounds, push=float(len(nodes)))
    result = torch.nn.Linear(len(nodes), 1, bias=False)
    samples = consensus(LocalMailbox(tmp_path / "box"), result)
    assert samples == {node.learner: rounds for node in nodes}
    counted = {node.learner: float(result.weight.detach()[0, node.parameter]) / rounds for node in nodes}
    assert counted == {node.learner: 1.0 for node in nodes}  # each node's progress counted once
