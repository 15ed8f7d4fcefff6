"""The run's state as fragments with pending contributions: small deterministic cases.

A fold that loses the race for a version leaves its contribution pending instead of folding
again; the next writer absorbs it. These tests force each path with a store wrapper the test
controls (no sleeps, no timing) and check the arithmetic exactly: models hold small integers.
"""

from __future__ import annotations

import math
import random
import threading
import time
import warnings
from datetime import timedelta

import pytest
import torch
from session_toys import push  # tests/helpers/ is on sys.path (tests/conftest.py)

from gradientmail import MailRejectedError, MailSkippedWarning, MemoryMailbox
from gradientmail.layout import fold_claim_key, member_key, pending_key, pending_prefix, state_key, versions_prefix
from gradientmail.mailbox.wrappers import DelayedMailbox, FaultyMailbox
from gradientmail.session import Session, consensus
from gradientmail.session.chain import FragmentChain
from gradientmail.session.fragments import FragmentPlan, auto_fragments
from gradientmail.session.mail import Contribution, PendingHeader, encode
from gradientmail.session.schedule import Schedule

pytestmark = pytest.mark.timeout(60)


def vector(size: int = 6, fill: float = 0.0) -> torch.nn.Linear:
    """A model of ``size`` parameters, all ``fill``: one weight row, no bias."""
    model = torch.nn.Linear(size, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(fill)
    return model


def values(model: torch.nn.Module) -> list[float]:
    return model.weight.detach().flatten().tolist()


def session(model, mailbox, learner: str, fragments: int = 3, **kwargs) -> Session:
    kwargs.setdefault("every", None)
    kwargs.setdefault("every_steps", 1)
    return Session(model, mailbox=mailbox, learner_id=learner, outer="average", fragments=fragments, **kwargs)


def exchange(s: Session, model: torch.nn.Module | None = None, amount: float = 0.0, samples: int = 1) -> None:
    if model is not None and amount:
        push(model, amount)
    s.step(samples=samples)
    s.wait()


class RivalFirst(DelayedMailbox):
    """Once armed, this learner's next fold waits at its claim of the next version until the
    test lets it through: the test has a rival fold that version first, so this fold finds it
    claimed and leaves its contribution pending."""

    def __init__(self, inner) -> None:
        super().__init__(inner, latency=0)
        self.armed = threading.Event()
        self.reached = threading.Event()
        self.gate = threading.Event()

    def put_if_absent(self, key: str, data: bytes) -> bool:
        if self.armed.is_set() and "/claims/" in key:
            self.armed.clear()
            self.reached.set()
            if not self.gate.wait(30):
                raise TimeoutError("the test never opened the gate")
        return self.inner.put_if_absent(key, data)


class AlwaysLose(DelayedMailbox):
    """Every version create loses, as if a rival always got there first."""

    def __init__(self, inner) -> None:
        super().__init__(inner, latency=0)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        return (
            False
            if "/versions/" in key and not key.endswith("/000000000000.safetensors")
            else super().put_if_absent(key, data)
        )


# -- the cut -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("fragments", [1, 2, 3, 7, 64])
def test_the_cut_covers_every_value_once_in_near_equal_contiguous_fragments(fragments):
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
    plan = FragmentPlan.of(model, fragments)
    total = sum(p.numel() for p in model.parameters())
    assert len(plan) == min(fragments, total)
    sizes = [fragment.size for fragment in plan.fragments]
    assert sum(sizes) == total and max(sizes) - min(sizes) <= 1
    covered = {name: [] for name, _ in model.named_parameters()}
    for fragment in plan.fragments:
        for piece in fragment.pieces:
            covered[piece.name].append((piece.start, piece.stop))
    for name, parameter in model.named_parameters():
        ranges = sorted(covered[name])
        assert ranges[0][0] == 0 and ranges[-1][1] == parameter.numel()
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))  # contiguous, no overlap
    assert FragmentPlan.of(model, fragments) == plan  # every node cuts the same model the same way


def test_the_fragment_count_follows_the_state_size():
    assert auto_fragments(10) == 1
    assert auto_fragments(64 * 1024 // 4) == 1 and auto_fragments(64 * 1024 // 4 + 1) == 2
    assert auto_fragments(10**10) == 16  # at most 16 by default: each costs requests per interval


def test_each_fragment_is_its_own_chain_and_travels_alone(memory_mailbox):
    model = vector(6)
    with session(model, memory_mailbox, "a") as s:
        assert s.fragments == 3
        exchange(s, model, 1.0)
        assert s.exchanges == 3  # one step exchanged each fragment once
    for index in range(3):
        chain = FragmentChain(memory_mailbox, index, 3, {})
        assert chain.list_versions()[0] == 0
        view = FragmentChain(memory_mailbox, index, 3, FragmentPlan.of(model, 3).fragments[index].spec).view()
        assert set(view.base.tensors["weight"].tolist()) == {1.0}  # one step's progress, then the final fold
        assert view.base.tensors["weight"].numel() == 2


# -- group commit: a lost race leaves the contribution pending -----------------------------------------
def test_a_fold_that_loses_the_race_leaves_its_contribution_pending_and_the_next_writer_absorbs_it(
    memory_mailbox,
):
    rival = RivalFirst(memory_mailbox)
    a_model, b_model = vector(6), vector(6)
    with session(a_model, memory_mailbox, "a", fragments=1) as a, session(b_model, rival, "b", fragments=1) as b:
        rival.armed.set()
        push(b_model, 4.0)
        b.step(samples=1)  # b read version 0 and waits to create version 1 ...
        assert rival.reached.wait(10)
        exchange(a, a_model, 2.0)  # ... which a creates first: run 0 + 2/2
        rival.gate.set()
        b.wait()  # b found version 1 claimed: its contribution is pending, never folded twice
        assert b.conflicts == 0  # and no upload was lost to a race
        assert list(memory_mailbox.list(pending_prefix(0))) == [pending_key(0, "b", 0)]
        assert values(b_model) == [2.0] * 6  # b's own 4/2 on the version it read (a's comes next time)
        result = vector(6)
        assert consensus(memory_mailbox, result) == {"a": 1, "b": 1}  # pending counts
        assert values(result) == [3.0] * 6
        exchange(a, a_model)  # a's next fold absorbs b's pending contribution
        assert list(memory_mailbox.list(pending_prefix(0))) == []
        assert values(a_model) == [3.0] * 6
        exchange(b, b_model)
        assert values(b_model) == [3.0] * 6
    result = vector(6)
    consensus(memory_mailbox, result)
    assert values(result) == [3.0] * 6


def test_a_learner_whose_peer_is_folding_the_next_version_leaves_its_contribution_pending_at_once(
    memory_mailbox,
):
    model = vector(4)
    with session(model, memory_mailbox, "me", fragments=1) as s:
        newest = FragmentChain(memory_mailbox, 0, 1, {}).list_versions()[-1]
        memory_mailbox.put(fold_claim_key(0, newest + 1), b"peer")  # a peer is folding it now
        exchange(s, model, 2.0)
        assert s.conflicts == 0  # no race was run, no upload lost
        assert FragmentChain(memory_mailbox, 0, 1, {}).list_versions()[-1] == newest
        assert list(memory_mailbox.list(pending_prefix(0))) == [pending_key(0, "me", 0)]
        assert values(model) == [2.0] * 4
        result = vector(4)
        assert consensus(memory_mailbox, result) == {"me": 1}
        assert values(result) == [2.0] * 4
        # The claim still stands at this learner's next fold and the chain has not moved: the
        # peer died or stalled; this learner folds that version itself, its pending one included.
        exchange(s, model, 1.0)
        assert FragmentChain(memory_mailbox, 0, 1, {}).list_versions()[-1] == newest + 1
        assert list(memory_mailbox.list(pending_prefix(0))) == []
        assert values(model) == [3.0] * 4
    result = vector(4)
    assert consensus(memory_mailbox, result) == {"me": 2}  # two steps, one sample each
    assert values(result) == [3.0] * 4


def test_a_learner_that_always_loses_never_stops_training_and_loses_nothing(memory_mailbox):
    loser = AlwaysLose(memory_mailbox)
    model = vector(4)
    with session(model, loser, "unlucky", fragments=2) as s:
        for _ in range(5):
            exchange(s, model, 1.0)  # no error: each lost fold stays pending
        assert s.conflicts == 10  # 5 exchanges x 2 fragments
        assert values(model) == [5.0] * 4
        result = vector(4)
        assert consensus(memory_mailbox, result) == {"unlucky": 5}
        assert values(result) == [5.0] * 4
    assert len(list(memory_mailbox.list("session/fragments/0000/pending/"))) == 6  # 5 + the final


def test_fragments_folded_in_different_orders_end_exact(memory_mailbox, monkeypatch):
    # One fragment per step (every_steps=3, 3 fragments), each learner starting at another one.
    starts = iter([0, 1, 2])
    monkeypatch.setattr(random.Random, "randrange", lambda rng, n: next(starts) % n)
    models = [vector(6) for _ in range(3)]
    sessions = [session(m, memory_mailbox, f"n{i}", every_steps=3) for i, m in enumerate(models)]
    for s in sessions:
        s.__enter__()
    for _ in range(6):
        for model, s in zip(models, sessions):
            exchange(s, model, 1.0)
    for s in sessions:
        s.__exit__(None, None, None)
    result = vector(6)
    assert consensus(memory_mailbox, result) == {"n0": 6, "n1": 6, "n2": 6}
    assert values(result) == [6.0] * 6  # 3 learners x 6 steps x 1 / N=3


def test_a_late_joiner_catches_up_with_versions_and_pending_contributions(memory_mailbox):
    loser = AlwaysLose(memory_mailbox)
    first = vector(4)
    with session(first, loser, "first", fragments=2) as s:
        exchange(s, first, 3.0)  # left pending in both fragments
        late = vector(4, fill=-50.0)
        with session(late, memory_mailbox, "late", fragments=2) as t:
            assert values(late) == [3.0] * 4  # base + the pending contributions
            exchange(t, late, 2.0)  # N = 2 now; absorbs first's pending contributions
            assert values(late) == [4.0] * 4
            assert list(memory_mailbox.list(pending_prefix(0))) == []


def test_a_restarted_learner_continues_after_contributions_its_crashed_process_left_pending(memory_mailbox):
    loser = AlwaysLose(memory_mailbox)
    model = vector(4)
    with pytest.raises(RuntimeError, match="crash"):
        with session(model, loser, "n", fragments=2) as s:
            exchange(s, model, 1.0, samples=10)
            exchange(s, model, 1.0, samples=10)  # both folds left pending
            raise RuntimeError("crash")
    again = vector(4, fill=-9.0)
    with session(again, memory_mailbox, "n", fragments=2) as s:
        assert (s.steps, s.samples) == (2, 20)  # from its pending contributions
        assert values(again) == [2.0] * 4
        exchange(s, again, 1.0, samples=10)  # no clash with its own pending sequence numbers
    result = vector(4)
    assert consensus(memory_mailbox, result) == {"n": 30}
    assert values(result) == [3.0] * 4


# -- failures ------------------------------------------------------------------------------------------
def test_a_corrupt_pending_contribution_is_skipped_with_a_warning_and_the_chain_goes_on(memory_mailbox):
    loser = AlwaysLose(memory_mailbox)
    a_model, b_model = vector(2), vector(2)
    with session(a_model, memory_mailbox, "a", fragments=1) as a, session(b_model, loser, "b", fragments=1) as b:
        exchange(b, b_model, 4.0)  # pending: b.0
        key = pending_key(0, "b", 0)
        memory_mailbox.put(key, memory_mailbox.get(key)[:-3])  # truncated in the store
        with pytest.warns(MailSkippedWarning, match="'session/fragments/0000/pending/b.000000000000"):
            exchange(a, a_model, 2.0)
        assert values(a_model) == [1.0] * 2  # 2 / N=2; b's lost contribution counts as nothing
        assert list(memory_mailbox.list(pending_prefix(0))) == []  # absorbed (as nothing), removed
        result = vector(2)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # nobody warns about it again
            consensus(memory_mailbox, result)
        assert values(result) == [1.0] * 2


def test_a_corrupt_version_of_one_fragment_is_skipped_and_the_others_are_untouched(memory_mailbox):
    model = vector(4)
    with session(model, memory_mailbox, "a", fragments=2) as s:
        exchange(s, model, 1.0)
        newest = FragmentChain(memory_mailbox, 1, 2, {}).list_versions()[-1]
        memory_mailbox.put(f"{versions_prefix(1)}{newest + 1:012d}.safetensors", b"corrupt")
        with pytest.warns(MailSkippedWarning, match="fragments/0001/versions"):
            exchange(s, model, 1.0)
        assert values(model) == [2.0] * 4
    result = vector(4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MailSkippedWarning)
        consensus(memory_mailbox, result)
    assert values(result) == [2.0] * 4


def test_nodes_that_cut_the_state_differently_are_refused(memory_mailbox):
    with session(vector(6), memory_mailbox, "a", fragments=3, every_steps=100):
        with pytest.raises(MailRejectedError, match="cut into 3 fragments.*cuts it into 2"):
            with session(vector(6), memory_mailbox, "b", fragments=2):
                pytest.fail("joined a run cut another way")


def test_a_fold_whose_outcome_was_unknown_is_counted_once(memory_mailbox):
    # The create lands but the answer is lost (a timeout after the write): the next exchange
    # must find it in the run instead of folding that progress again.
    lose_answer = threading.Event()

    class LostAnswer(DelayedMailbox):
        def put_if_absent(self, key, data):
            created = self.inner.put_if_absent(key, data)
            if lose_answer.is_set() and "/versions/" in key:
                lose_answer.clear()
                raise TimeoutError("the answer was lost")
            return created

    model = vector(2)
    with session(model, LostAnswer(memory_mailbox, latency=0), "a", fragments=1) as s:
        lose_answer.set()
        push(model, 3.0)
        s.step(samples=1)
        s.wait(timedelta(seconds=10), apply=False)
        with pytest.raises(Exception, match="answer was lost"):
            s.step(samples=1)  # the loop catches it and goes on
        exchange(s, model, 1.0)
        assert values(model) == [4.0] * 2
    result = vector(2)
    consensus(memory_mailbox, result)
    assert values(result) == [4.0] * 2  # 3 once, not twice


def test_a_fold_that_failed_before_landing_is_folded_by_the_next_exchange(memory_mailbox):
    broken = threading.Event()

    def fault(operation, key):
        return OSError("disk full") if broken.is_set() and operation == "put_if_absent" else None

    model = vector(2)
    with session(model, FaultyMailbox(memory_mailbox, fault), "a", fragments=1) as s:
        broken.set()
        push(model, 3.0)
        s.step(samples=1)
        s.wait(timedelta(seconds=10), apply=False)
        with pytest.raises(Exception, match="disk full"):
            s.step(samples=1)
        broken.clear()
        exchange(s, model, 1.0)
    result = vector(2)
    consensus(memory_mailbox, result)
    assert values(result) == [4.0] * 2  # the 3 not lost: it travels with the next exchange


def test_a_writer_stalled_until_its_version_number_was_retired_leaves_its_contribution_pending(
    memory_mailbox, monkeypatch
):
    # A frozen VM: b's create of version 1 lands after the chain moved on and retired that
    # number (RETIRE versions later; 2 here). Nobody would read it: b must notice, not lose it.
    monkeypatch.setattr("gradientmail.session.chain.RETIRE", 2)
    monkeypatch.setattr("gradientmail.session.chain.KEEP", 1)
    monkeypatch.setattr("gradientmail.session.chain.STALLED_S", 0.0)  # every create is checked
    monkeypatch.setenv("GRADIENTMAIL_SESSION_RETIRE_AFTER_S", "0")  # retired as soon as it is safe
    rival = RivalFirst(memory_mailbox)
    a_model, b_model = vector(2), vector(2)
    with session(a_model, memory_mailbox, "a", fragments=1) as a, session(b_model, rival, "b", fragments=1) as b:
        rival.armed.set()
        push(b_model, 4.0)
        b.step(samples=1)  # b read version 0 and is frozen before creating version 1
        assert rival.reached.wait(10)
        folds = 0
        while folds < 3 or (memory_mailbox.get(state_key(1, 0)) is not None and folds < 12):
            exchange(a, a_model, 2.0)  # versions 1, 2, 3, ...: a later one retires version 1
            folds += 1
        assert memory_mailbox.get(state_key(1, 0)) is None
        rival.gate.set()
        b.wait()  # b recreated version 1, found the chain without it, and left it pending
        assert memory_mailbox.get(state_key(1, 0)) is None
        assert b.conflicts == 1
        result = vector(2)
        consensus(memory_mailbox, result)
        assert values(result) == [folds * 1.0 + 2.0] * 2  # a's folds x 2/2 and b's 4/2, each once


@pytest.mark.slow
def test_a_learner_far_from_the_store_lands_every_contribution_while_near_ones_fold_fast(memory_mailbox):
    # Its reads take longer than its peers take to write new versions: it loses most races,
    # and each lost fold is left pending instead of retried until a timeout.
    far = DelayedMailbox(memory_mailbox, latency=0.02)
    models = [vector(2) for _ in range(3)]
    sessions = [
        session(models[0], far, "far", fragments=1),
        session(models[1], memory_mailbox, "near-1", fragments=1),
        session(models[2], memory_mailbox, "near-2", fragments=1),
    ]
    for s in sessions:
        s.__enter__()
    steps = [5, 30, 30]

    def train(i: int) -> None:
        for _ in range(steps[i]):
            exchange(sessions[i], models[i], 1.0)

    threads = [threading.Thread(target=train, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    for s in sessions:
        s.__exit__(None, None, None)
    result = vector(2)
    assert consensus(memory_mailbox, result) == {"far": 5, "near-1": 30, "near-2": 30}
    assert values(result) == pytest.approx([sum(steps) / 3] * 2, rel=1e-5)  # each progress once, / N=3


def test_a_peer_whose_clock_is_ten_minutes_behind_counts_from_the_first_fold(memory_mailbox):
    # The peer's member key and contributions carry its own clock, ten minutes behind: by
    # those times it looks stale; by what this learner watches in the store (a new member key,
    # then its contributions advancing), it is alive from the first fold on.
    skewed = time.time() - 600

    def peer_contributes(seq: int) -> None:
        header = PendingHeader("late-clock", Contribution(seq, seq + 1, seq + 1, skewed + seq), 0, 1)
        memory_mailbox.put(pending_key(0, "late-clock", seq), encode({"weight": torch.zeros(2)}, header))

    model = vector(2)
    with session(model, memory_mailbox, "me", fragments=1) as s:
        memory_mailbox.put(member_key("late-clock", skewed), b"{}")
        peer_contributes(0)
        exchange(s, model, 2.0)  # the peer's key is new to this learner: N = 2
        assert values(model) == [1.0] * 2
        peer_contributes(1)
        exchange(s, model, 2.0)  # it advanced since: N = 2 whatever its clock says
        assert values(model) == [2.0] * 2


# -- cadence -------------------------------------------------------------------------------------------
def test_the_first_exchange_falls_at_a_random_phase_of_the_first_slot(memory_mailbox, monkeypatch):
    drawn = []

    def uniform(rng, low, high):
        drawn.append((low, high))
        return low

    monkeypatch.setattr(random.Random, "uniform", uniform)
    with Session(vector(6), mailbox=memory_mailbox, learner_id="a", every=timedelta(hours=1), fragments=3) as s:
        s.step(samples=1)  # the drawn phase is 0: due at once
        assert s.in_flight
        s.wait()
    assert drawn == [(0, 1200.0)]  # within one slot: an hour / 3 fragments


def test_learners_that_join_together_keep_their_own_phases_however_late_they_fold():
    # Eight learners join at the same instant; the store is slow, so each first step and every
    # fold after it comes several slots late. Each keeps folding on its own grid (its phase), so
    # they never line up behind the same slow moments into lock-step.
    now = [0.0]
    every, count = 8.0, 4
    slot = every / count
    plans = [
        Schedule(count, every_s=every, every_steps=math.inf, steps=0, clock=lambda: now[0], rng=random.Random(seed))
        for seed in range(8)
    ]
    phases = [plan.phase_s for plan in plans]
    assert len(set(phases)) == len(plans) and all(0 <= phase < slot for phase in phases)
    busy = [5.0] * len(plans)  # the first step comes 5 s (2.5 slots) after joining, for everyone
    for _ in range(20):
        for index, plan in enumerate(plans):
            now[0] = max(busy[index], plan.due_time)
            assert plan.due(steps=0)
            plan.take(steps=0)
            busy[index] = now[0] + 3 * slot + 0.5  # each fold takes 3.25 slots of a slow store
            assert plan.due_time > now[0]
            on_grid = (plan.due_time - plan.origin - plan.phase_s) / slot
            assert math.isclose(on_grid, round(on_grid), abs_tol=1e-9)  # still on its own phase
    assert len({plan.due_time for plan in plans}) == len(plans)  # no two fold together


def test_a_learner_whose_steps_are_longer_than_a_slot_still_folds_every_fragment_once_per_interval():
    # 64 fragments every 64 s: a slot of 1 s. The learner steps every 1.3 s and a fold takes
    # 0.7 s: one fold per step would exchange each fragment every 83 s instead of 64.
    now = [0.0]
    every, count, step_s, fold_s = 64.0, 64, 1.3, 0.7
    plan = Schedule(count, every_s=every, every_steps=math.inf, steps=0, clock=lambda: now[0], rng=random.Random(5))
    folded = [0] * count
    busy_until = 0.0
    for step in range(1, round(10 * every / step_s)):  # ten intervals
        now[0] = step * step_s
        if now[0] < busy_until or not plan.due(steps=step):
            continue  # the job in flight ends at a later step
        fragments = plan.take(steps=step)
        assert len(fragments) == len(set(fragments))  # a fragment at most once per job
        for fragment in fragments:
            folded[fragment] += 1
        busy_until = now[0] + fold_s * len(fragments)
    assert min(folded) >= 9 and max(folded) <= 10, folded  # once per interval, each


def test_a_session_reads_and_writes_no_more_than_the_fragments_it_exchanges():
    box = MemoryMailbox("fragments-bytes")
    box.clear()
    from gradientmail.mailbox.wrappers import CountingMailbox

    counting = CountingMailbox(box)
    model = vector(3000)
    with session(model, counting, "a", fragments=4, every_steps=4) as s:
        before_read, before_written = counting.bytes_read, counting.bytes_written
        for _ in range(4):  # one fragment per step: one round
            exchange(s, model, 1.0)
        read, written = counting.bytes_read - before_read, counting.bytes_written - before_written
    model_bytes = 3000 * 4
    assert s.exchanges >= 4
    assert written < 1.2 * model_bytes  # one round writes the model once, a fragment at a time
    assert read < 0.2 * model_bytes  # alone: its own versions, never downloaded again
    box.clear()


def test_a_learner_lists_the_members_at_its_first_fold_then_once_per_round_with_fragment_0(monkeypatch):
    """The first fold lists the members (who joined meanwhile counts in N at once); then each
    round lists them with fragment 0, whose slot falls anywhere in the round (a round's first
    fragment is drawn), not with the round's first fold: learners that started together do not
    all list them in the same slot, round after round."""
    from gradientmail.layout import MEMBERS_PREFIX
    from gradientmail.mailbox.wrappers import MailboxWrapper

    class Events(MailboxWrapper):
        def __init__(self, inner) -> None:
            super().__init__(inner)
            self.events: list[str] = []

        def list(self, prefix: str = "", start_after: str | None = None):
            if prefix == MEMBERS_PREFIX:
                self.events.append("members")
            return super().list(prefix, start_after)

        def put_if_absent(self, key: str, data: bytes) -> bool:
            self.events.append(key)
            return super().put_if_absent(key, data)

    monkeypatch.setattr(random.Random, "randrange", lambda rng, stop: 2)  # each round starts at fragment 2
    box = MemoryMailbox("fragments-member-listings")
    box.clear()
    recorder = Events(box)
    model = vector(8)
    with session(model, recorder, "a", fragments=4, every_steps=4) as s:
        recorder.events.clear()
        for _ in range(8):  # one fragment per step: two rounds, 2 3 0 1 2 3 0 1
            exchange(s, model, 1.0)
        events = list(recorder.events)
    assert s.exchanges >= 8
    written, listed = [], False  # (fragment, whether its fold listed the members)
    for event in events:
        if event == "members":
            listed = True
        elif "/versions/" in event:
            written.append((event.split("fragments/")[1][:4], listed))
            listed = False
    assert [fragment for fragment, _ in written] == ["0002", "0003", "0000", "0001"] * 2
    assert [fragment for fragment, listed in written if listed] == ["0002", "0000", "0000"]
    box.clear()


def test_a_job_folds_its_fragments_concurrently_and_exactly_once(monkeypatch):
    """The fragments of one job fold on as many threads at once as ``FoldLanes`` says: two of
    its folds' creates wait for each other here, which folds one after another would never do."""
    from gradientmail.mailbox.wrappers import MailboxWrapper
    from gradientmail.session.exchange import FOLD_LANES, FoldLanes

    assert FOLD_LANES >= 2
    slots: list[float] = []

    def all_lanes(self, folds: int, slot_s: float) -> int:
        slots.append(slot_s)
        return min(FOLD_LANES, folds)

    monkeypatch.setattr(FoldLanes, "for_job", all_lanes)

    class MeetingCreates(MailboxWrapper):
        def __init__(self, inner) -> None:
            super().__init__(inner)
            self.meet = threading.Barrier(2)
            self.met = 0
            self.armed = False

        def put_if_absent(self, key: str, data: bytes) -> bool:
            if self.armed and "/versions/" in key:
                try:
                    self.meet.wait(timeout=20)
                    self.met += 1
                except threading.BrokenBarrierError:
                    pass
            return super().put_if_absent(key, data)

    box = MemoryMailbox("fragments-concurrent-folds")
    box.clear()
    meeting = MeetingCreates(box)
    model = vector(8)
    with session(model, meeting, "a", fragments=4, every_steps=1) as s:  # every step: all 4 due
        meeting.armed = True
        exchange(s, model, 1.0)
        meeting.armed = False
        exchange(s, model, 1.0)
    assert meeting.met >= 2  # two creates of one job were in flight together
    assert consensus(box, vector(8)) == {"a": 2}
    assert values(model) == [2.0] * 8  # each fragment's progress once
    # By steps, a slot's seconds come from the pace stepped since the previous job.
    assert slots[0] == float("inf") and 0 < slots[1] < float("inf"), slots
    box.clear()


def test_folds_overlap_only_when_one_at_a_time_they_would_fall_behind():
    """A job folds one fragment at a time while folds take under half a slot, and up to
    ``FOLD_LANES`` at once as they grow past it (never more than it has folds)."""
    from gradientmail.session.exchange import FOLD_LANES, FoldLanes

    lanes = FoldLanes()
    assert lanes.for_job(16, 0.1) == 1  # nothing measured yet
    lanes.folded(0.01)
    assert lanes.for_job(16, 0.1) == 1  # a near store: a fifth of a slot
    assert lanes.for_job(16, float("inf")) == 1  # no pace to keep
    lanes = FoldLanes()
    lanes.folded(0.06)
    assert lanes.for_job(16, 0.1) == 2
    assert lanes.for_job(1, 0.1) == 1
    lanes = FoldLanes()
    lanes.folded(0.178)  # 1B in bfloat16 over 512 fragments on S3, every 60 s: a slot of 117 ms
    assert lanes.for_job(16, 60 / 512) == FOLD_LANES == 4
    assert lanes.for_job(3, 60 / 512) == 3
