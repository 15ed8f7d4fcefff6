"""Old home of ``gradientmail demo``, now in ``gradientmail.cli.demo``; re-exported here."""

from gradientmail.cli.demo import READY_TIMEOUT, START_DELAY, run_demo
from gradientmail.cli.demo_plan import DEFAULT_SPEEDS, Plan, make_plan, makespan, node_names, simulate
from gradientmail.cli.demo_views import NodeState
from gradientmail.errors import DemoError

__all__ = [
    "DEFAULT_SPEEDS",
    "READY_TIMEOUT",
    "START_DELAY",
    "DemoError",
    "NodeState",
    "Plan",
    "make_plan",
    "makespan",
    "node_names",
    "run_demo",
    "simulate",
]
