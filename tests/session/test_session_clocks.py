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
from gradientmail.layout import member_key
from gradientmail.session.mail import Contribution
from gradientmail.session.members import Members, SignsOfLife

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


# -- the rule, on a clock the test sets ----------------------------------------------------------
class Clock:
    """This learner's clock: a number the test moves."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def members_of(joined: dict[str, float]) -> Members:
    members = Members()
    for learner, at in joined.items():
        members.add(member_key(learner, at))
    return members


def line(seq: int, time: float, *, final: bool = False) -> Contribution:
    return Contribution(seq=seq, step=seq, samples=seq, time=time, final=final)


def counted(life: SignsOfLife, members: Members, lines: dict[str, Contribution], since: float) -> set[str]:
    return life.counted(members, lines, staleness=300.0, since=since, now=life.clock())


@pytest.mark.parametrize("offset_s", [0.0, 600.0, -600.0, 3600.0, -3600.0, 32_503_680_000.0, -1.6e9])
def test_peers_dates_never_decide_who_counts(offset_s):
    # The same run seen twice: once with the peers' dates right, once with every date a peer
    # wrote shifted by its clock's error. Who counts depends only on what this learner watched.
    def watch(shift: float) -> list[set[str]]:
        clock = Clock()
        life = SignsOfLife("me", clock)
        wall = 1.7e9 + shift  # the peers' wall clock
        members = members_of({"me": 1.7e9, "busy": wall - 10, "quiet": wall - 20})
        lines = {"busy": line(1, wall - 5), "quiet": line(4, wall - 15)}
        life.listed(members, clock())
        life.read(0, lines, clock())
        seen = [counted(life, members, lines, since=clock())]
        for _ in range(3):  # "busy" folds every 120 s; "quiet" has stopped
            clock.now += 120.0
            wall += 120.0
            lines = {**lines, "busy": line(lines["busy"].seq + 1, wall)}
            life.listed(members, clock())
            life.read(0, lines, clock())
            seen.append(counted(life, members, lines, since=clock() - 120.0))
        return seen

    assert watch(offset_s) == watch(0.0) == [{"me", "busy", "quiet"}] * 3 + [{"me", "busy"}]


def test_a_key_nobody_is_behind_counts_until_watched_for_staleness_without_a_sign_of_life():
    # A key left by a node that crashed before this learner joined, or forged in the year 3000:
    # it weighs this learner's progress a little less for ``staleness``, then not at all.
    clock = Clock()
    life = SignsOfLife("me", clock)
    members = members_of({"me": 1.7e9, "crashed": 1.7e9 - 86_400, "ghost": 32_503_680_000.0})
    life.listed(members, clock())
    assert counted(life, members, {}, since=clock()) == {"me", "crashed", "ghost"}
    clock.now += 300.0
    life.listed(members, clock())  # listed again: the same keys are no sign of life
    assert counted(life, members, {}, since=clock()) == {"me", "crashed", "ghost"}
    clock.now += 1.0
    assert counted(life, members, {}, since=clock()) == {"me"}
    restarted = members_of({"me": 1.7e9, "crashed": 1.7e9 + 60, "ghost": 32_503_680_000.0})
    life.listed(restarted, clock())  # a new key of "crashed": it came back
    assert counted(life, restarted, {}, since=clock()) == {"me", "crashed"}


def test_a_slot_closed_by_a_peer_is_no_sign_of_life():
    # A peer that judged "dead" dead closes its next slot: the seq advances, its date does not.
    clock = Clock()
    life = SignsOfLife("me", clock)
    members = members_of({"me": 1.7e9, "dead": 1.7e9})
    life.listed(members, clock())
    life.read(0, {"dead": line(3, 1.7e9 + 5)}, clock())
    clock.now += 301.0
    life.read(0, {"dead": line(4, 1.7e9 + 5)}, clock())
    assert counted(life, members, {"dead": line(4, 1.7e9 + 5)}, since=clock() - 30) == {"me"}


def test_a_learner_that_left_counts_for_the_progress_made_while_it_was_there():
    clock = Clock()
    life = SignsOfLife("me", clock)
    members = members_of({"me": 1.7e9, "left": 1.7e9 + 3600})  # its clock an hour ahead
    before = {"left": line(2, 1.7e9 + 3700)}
    life.listed(members, clock())
    life.read(0, before, clock())
    since = clock.now = clock.now + 30.0  # this learner's snapshot: the progress to count began
    clock.now += 5.0
    after = {"left": line(3, 1.7e9 + 3740, final=True)}  # its last fold, then its key is deleted
    gone = members_of({"me": 1.7e9})
    life.listed(gone, clock())
    life.read(0, after, clock())
    assert counted(life, gone, after, since=since) == {"me", "left"}  # it was there: N = 2
    assert counted(life, gone, after, since=clock() + 1) == {"me"}  # progress made after it left
    assert counted(life, members, after, since=clock() + 1) == {"me"}  # its key still listed, all the same


def test_a_learner_found_finished_at_the_first_read_does_not_count():
    clock = Clock()
    life = SignsOfLife("me", clock)
    lines = {"left": line(9, 1.7e9 - 7200, final=True)}
    life.listed(members_of({"me": 1.7e9}), clock())
    life.read(0, lines, clock())
    assert counted(life, members_of({"me": 1.7e9}), lines, since=clock() - 60) == {"me"}
