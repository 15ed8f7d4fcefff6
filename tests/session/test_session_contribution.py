"""A batch counts as done only once the progress trained on it is in the run.

The elastic queue records consumed batches so that another node continues a dead node's units;
with a ``Session`` in the same process those records wait (``gradientmail.fold_gate``) until
every fragment has folded a snapshot taken after the batch. A learner that fails before its
next fold leaves its units where the run's state ends, and the batches it trained since are
trained again, so the run's samples (``consensus``) equal the dataset's: none lost, none
counted twice. Deterministic: folds happen where the loop calls ``session.wait()``.
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from datetime import timedelta

import pytest
import torch
from elastic_nodes import ElasticSpec, consumed_pairs, run_elastic_nodes, written_steps
from queue_nodes import named_units

from gradientmail import LocalMailbox, Session, consensus
from gradientmail.layout import WORK_PREFIX, state_key
from gradientmail.mailbox.wrappers import MailboxWrapper
from gradientmail.meeting_point import meeting_point
from gradientmail.patterns.shared_queue import shared_queue
from gradientmail.queue.progress import ProgressTracker
from gradientmail.status import read_run

STEPS = {"a": 6, "b": 6}
"""Unit -> its batches (steps 0..n-1)."""
UNITS = {name: name for name in STEPS}


def load(identifier: str):
    for step in range(STEPS[identifier]):
        yield step, torch.tensor([ord(identifier), step])


class Crash(Exception):
    """The training loop fails (the process would die): no clean exit, no final fold."""


def train(box, learner: str, consumed: list, *, crash_after: int | None = None, fold_at: tuple[int, ...] = ()):
    """The documented loop on ``box``; each batch trained adds 1 to the model (one sample).

    ``fold_at``: batch counts after which the loop waits for an exchange to land; the Session
    exchanges every 4 steps (one fragment), so batch 4 starts one.
    """
    model = torch.nn.Linear(2, 1)
    session = Session(model, mailbox=box, learner_id=learner, every=None, every_steps=4, fragments=1)
    try:
        with (
            session,
            shared_queue(UNITS, mailbox=box, learner_id=learner, load=load, workers=0, resume=True) as batches,
        ):
            for count, (step, batch) in enumerate(batches, start=1):
                consumed.append((chr(int(batch[0])), step))
                with torch.no_grad():
                    model.bias.add_(1.0)
                session.step(samples=1)
                if count in fold_at:
                    session.wait()
                if count == crash_after:
                    raise Crash(f"{learner} fails after {count} batches")
    except Crash:
        pass


def test_batches_trained_after_the_last_fold_are_trained_again_after_a_failure(memory_mailbox):
    """Before the gate, the failed learner's batches 5-6 (unit a's last two) were recorded as
    done: the unit was finished, nobody trained them again, and the run held 10 of 12 samples."""
    consumed: list = []
    train(memory_mailbox, "node-0", consumed, crash_after=6, fold_at=(4,))
    assert consensus(memory_mailbox, torch.nn.Linear(2, 1)) == {"node-0": 4}  # the fold of batches 1-4
    halfway = read_run(memory_mailbox)
    assert not halfway.done, "unit a's last batches are not in the run: it is not done"
    assert "a" in halfway.released  # (b too, when the loader had claimed it ahead)

    train(memory_mailbox, "node-1", consumed)  # another node continues the run (resume)
    assert sum(consensus(memory_mailbox, torch.nn.Linear(2, 1)).values()) == sum(STEPS.values())
    counts = Counter(consumed)
    assert set(counts) == {(u, s) for u, n in STEPS.items() for s in range(n)}
    assert {pair for pair, n in counts.items() if n > 1} == {("a", 4), ("a", 5)}  # trained, never folded
    assert len(read_run(memory_mailbox).done) == len(UNITS)


class HeldFold(MailboxWrapper):
    """The Session's store: the create of its first fold (after the base) waits for ``go``."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.started, self.go = threading.Event(), threading.Event()

    def put_if_absent(self, key: str, data: bytes) -> bool:
        if "/versions/" in key and not key.endswith(state_key(0, 0).rsplit("/", 1)[1]) and not self.started.is_set():
            self.started.set()
            assert self.go.wait(30), "the queue never closed"
        return super().put_if_absent(key, data)


def test_a_fold_in_flight_when_the_loop_raises_counts_before_the_units_are_released(memory_mailbox, monkeypatch):
    """The loop raises while a fold of batches 1-4 is on its way to the store; it lands as the
    queue stops. The queue first stops the Session's folds and waits for that one, then releases
    unit a after batch 4 (the gate's folded mark). Before (released at the records, which waited
    for that fold): batches 1-4 were trained again, and the run counted 16 samples of 12."""
    store = HeldFold(memory_mailbox)
    close = ProgressTracker.close

    def closing(self, *args, **kwargs):  # the fold lands while the queue stops
        store.go.set()
        return close(self, *args, **kwargs)

    monkeypatch.setattr(ProgressTracker, "close", closing)
    model, consumed = torch.nn.Linear(2, 1), []
    session = Session(model, mailbox=store, learner_id="node-0", every=None, every_steps=4, fragments=1)
    with pytest.raises(Crash):
        with (
            session,
            shared_queue(UNITS, mailbox=memory_mailbox, learner_id="node-0", load=load, workers=0, resume=True) as b,
        ):
            for count, (step, batch) in enumerate(b, start=1):
                consumed.append((chr(int(batch[0])), step))
                with torch.no_grad():
                    model.bias.add_(1.0)
                session.step(samples=1)
                if count == 4:
                    assert store.started.wait(30), "the fold of batches 1-4 started"
                    raise Crash("the loop fails while that fold is in flight")
    assert consensus(memory_mailbox, torch.nn.Linear(2, 1)) == {"node-0": 4}  # it landed
    train(memory_mailbox, "node-0", consumed)  # the restart continues the run (resume)
    assert sum(consensus(memory_mailbox, torch.nn.Linear(2, 1)).values()) == sum(STEPS.values())
    assert Counter(consumed)[("a", 0)] == 1, "batches in the run were trained again"


def test_a_clean_exit_folds_before_the_records_are_written(memory_mailbox):
    """The last batches' records wait at the queue's exit: it has the Session fold them, then
    records every unit done (the Session's final fold then has nothing left)."""
    consumed: list = []
    train(memory_mailbox, "node-0", consumed)
    assert sum(consensus(memory_mailbox, torch.nn.Linear(2, 1)).values()) == 12
    run = read_run(memory_mailbox)
    assert len(run.done) == len(UNITS) and not run.released
    row = run.learner("node-0")
    assert row is not None and (row.samples, row.samples_in_run) == (12, 12)  # `gradientmail status`
    assert not list(memory_mailbox.list(WORK_PREFIX))
    assert not meeting_point(memory_mailbox, "node-0").gate.attached  # the Session let go


def test_records_wait_for_the_fold_then_follow_it(memory_mailbox):
    """Inside the loop: nothing is recorded before the first fold; after it, exactly the
    batches it holds (work records are the last folded step of the unit)."""
    model = torch.nn.Linear(2, 1)
    seen_before: dict[str, int] = {}
    seen_after: dict[str, int] = {}
    session = Session(model, mailbox=memory_mailbox, learner_id="node-0", every=None, every_steps=4, fragments=1)
    with (
        session,
        shared_queue(
            UNITS, mailbox=memory_mailbox, learner_id="node-0", load=load, workers=0, lease=timedelta(minutes=5)
        ) as batches,
    ):
        tracker = batches.tracker
        for count, _ in enumerate(batches, start=1):
            session.step(samples=1)
            if count == 3:
                tracker.flush()
                seen_before = steps_recorded(memory_mailbox)
                held = tracker.held
            if count == 4:
                session.wait()
            if count == 5:  # batch 4's consumption is recorded when batch 5 is asked for
                tracker.flush()
                seen_after = steps_recorded(memory_mailbox)
                break
    assert seen_before == {} and held == 2  # batches 1 and 2 consumed, not yet folded
    assert seen_after == {"a": 3}  # batches 1-4 folded: unit a's steps 0-3


def steps_recorded(box) -> dict[str, int]:
    """Unit -> the last consumed step its work record holds (records written at a claim hold none)."""
    records = {key.rsplit("/", 1)[1]: json.loads(box.get(key)) for key in box.list(WORK_PREFIX)}
    return {unit: record["step"] for unit, record in records.items() if record["step"] is not None}


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("fragments", [1, 3])
def test_a_killed_node_s_unfolded_batches_reach_the_model_once(tmp_path, fragments):
    """Three processes, ``resume=True``, a lease, a Session exchanging every
    0.3 s; SIGKILL one after 30 batches, then restart it. Every batch is in the run's state
    (the dead node's batches since its last fold included), and a batch
    is counted twice only if the dead node's fold of it landed but its record was not yet
    written: at most the batches it consumed after its last record known to be written."""
    box = LocalMailbox(tmp_path / "box")
    units = named_units(24, steps=6)
    common = dict(delay=0.002, train=0.01, prefetch=3, workers=0, resume=True, lease_s=1.5, fragments=fragments)
    specs = [ElasticSpec(box, f"node-{rank}", units, str(tmp_path), session_every=0.3, **common) for rank in range(3)]
    specs[0].kill_after = 30
    run_elastic_nodes(specs, killed={"node-0"}, timeout=90)
    run_elastic_nodes([ElasticSpec(box, "node-0", units, str(tmp_path), run=2, session_every=0.3, **common)])

    total = sum(item.steps for item in units.values())
    samples = consensus(box, torch.nn.Linear(8, 8))
    pairs = consumed_pairs(tmp_path)
    dead = pairs["node-0-1"]
    written = written_steps(tmp_path, "node-0")
    in_flight = sum(1 for ident, step in dead if step > written.get(ident, -1))
    seen = Counter(pair for consumed in pairs.values() for pair in consumed)
    print(
        f"\nkill with a Session ({fragments} fragment(s)): {sum(samples.values())} samples in the run "
        f"of {total}; {sum(n - 1 for n in seen.values())} batches trained twice; the dead node "
        f"consumed {len(dead)}, {in_flight} after its last written record"
    )
    assert set(seen) == {(ident, step) for ident, item in units.items() for step in range(item.steps)}
    assert total <= sum(samples.values()) <= total + in_flight
    assert len(read_run(box).done) == len(units)


def consume_logged(box, learner: str, session: Session, model: torch.nn.Module, log) -> None:
    """The documented loop's queue (``resume=True``, a lease) inside ``session``; each batch
    trained adds 1 to the model's bias (one sample) and is logged as ``unit step``."""
    with shared_queue(
        UNITS, mailbox=box, learner_id=learner, load=load, workers=0, resume=True, lease=timedelta(seconds=30)
    ) as batches:
        for step, batch in batches:
            log.write(f"{chr(int(batch[0]))} {step}\n")
            log.flush()
            with torch.no_grad():
                model.bias.add_(1.0)
            session.step(samples=1)


def die_after_fold(box_path: str, learner: str, consumed_path: str, fragments: int, kill_at: int | None) -> None:
    """A node process: the documented loop (Session every 4 steps, ``resume=True``, a lease);
    with ``kill_at`` it SIGKILLs itself the moment the run holds ``kill_at`` batches, before
    the queue's writer can record them (the listener runs first: registered before the queue's)."""
    import os
    import signal

    box = LocalMailbox(box_path)
    model = torch.nn.Linear(2, 1)
    session = Session(model, mailbox=box, learner_id=learner, every=None, every_steps=4, fragments=fragments)
    with session, open(consumed_path, "a", encoding="ascii") as log:
        if kill_at is not None:
            gate = meeting_point(box, learner).gate
            gate.listen(
                lambda folded: folded is not None and folded >= kill_at and os.kill(os.getpid(), signal.SIGKILL)
            )
        consume_logged(box, learner, session, model, log)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fragments", [1, 3])
def test_a_node_killed_after_its_fold_landed_before_its_records_are_not_counted_twice(tmp_path, fragments):
    """The window after a fold: the run holds batches 1-4, the node dies before recording them.
    Its fold's line carries its unit marks, so the restarted node (``resume=True``) continues
    after them. Before the marks its records said nothing was consumed: batches 1-4 were trained
    again and the run held 16 samples of 12."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    box, consumed = str(tmp_path / "box"), str(tmp_path / "consumed.txt")
    first = context.Process(target=die_after_fold, args=(box, "node-0", consumed, fragments, 4))
    first.start()
    first.join(60)
    assert first.exitcode == -9, "the node was to die right after its first fold landed"
    assert steps_recorded(LocalMailbox(box)).get("a", -1) < 3, "batch 4 (step 3) is in the run, not recorded"
    second = context.Process(target=die_after_fold, args=(box, "node-0", consumed, fragments, None))
    second.start()
    second.join(60)
    assert second.exitcode == 0

    samples = consensus(LocalMailbox(box), torch.nn.Linear(2, 1))
    trained = Counter(tuple(line.split()) for line in open(consumed, encoding="ascii").read().splitlines())
    assert sum(samples.values()) == sum(STEPS.values())  # 12: none lost, none counted twice
    assert set(trained) == {(u, str(s)) for u, n in STEPS.items() for s in range(n)}
    assert len(read_run(LocalMailbox(box)).done) == len(UNITS)


class DieInsideAFold(MailboxWrapper):
    """The Session's store: the create of its fold number ``die_at`` (a version after the base)
    is saved to ``saved`` and never sent, and the process SIGKILLs itself, as if killed with that
    request in flight; the test sends it later, as a store that answers late would."""

    def __init__(self, inner, saved: str, die_at: int) -> None:
        super().__init__(inner)
        self.saved = saved
        self.left = die_at

    def put_if_absent(self, key: str, data: bytes) -> bool:
        import os
        import signal

        if "/versions/" in key and not key.endswith(state_key(0, 0).rsplit("/", 1)[1]):
            self.left -= 1
        if self.left == 0:
            with open(self.saved, "wb") as handle:
                handle.write(key.encode() + b"\n" + data)
            os.kill(os.getpid(), signal.SIGKILL)
        return super().put_if_absent(key, data)


def die_with_a_fold_in_flight(box_path: str, consumed_path: str, fragments: int, saved: str, run: int) -> None:
    """Run 1 dies inside its fold of the last fragment of its first round (``DieInsideAFold``:
    every other fragment holds its first batches); run 2 is its restart, and the fold run 1 had
    in flight lands right after run 2's Session joined, before its queue starts."""
    box = LocalMailbox(box_path)
    model = torch.nn.Linear(2, 1)
    store = DieInsideAFold(box, saved, fragments) if run == 1 else box
    session = Session(model, mailbox=store, learner_id="node-0", every=None, every_steps=4, fragments=fragments)
    with session, open(consumed_path, "a", encoding="ascii") as log:
        if run == 2:
            key, data = open(saved, "rb").read().split(b"\n", 1)
            assert box.put_if_absent(key.decode(), data), "the late fold lands"
        consume_logged(box, "node-0", session, model, log)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fragments", [1, 2])
def test_a_fold_that_lands_after_the_restart_joined_is_counted_once(tmp_path, fragments):
    """A request in flight when a node dies can reach the store after its restart read the run's
    state (seen once on SeaweedFS: 8 of 144 samples missing from the count). The restart counts
    from what it read; its queue took the dead node's units back after the marks the late fold
    carries, so those batches were neither trained again nor counted (8 of 12 with one fragment,
    10 of 12 with two: the restart counted from the fragment that held fewest).
    Now the queue continues from the marks of the same read: they are trained again, counted once."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    box, consumed, saved = str(tmp_path / "box"), str(tmp_path / "consumed.txt"), str(tmp_path / "fold")
    first = context.Process(target=die_with_a_fold_in_flight, args=(box, consumed, fragments, saved, 1))
    first.start()
    first.join(60)
    assert first.exitcode == -9, "the node was to die inside a fold"
    second = context.Process(target=die_with_a_fold_in_flight, args=(box, consumed, fragments, saved, 2))
    second.start()
    second.join(60)
    assert second.exitcode == 0

    samples = consensus(LocalMailbox(box), torch.nn.Linear(2, 1))
    trained = Counter(tuple(line.split()) for line in open(consumed, encoding="ascii").read().splitlines())
    assert set(trained) == {(u, str(s)) for u, n in STEPS.items() for s in range(n)}
    assert sum(samples.values()) == sum(STEPS.values())  # 12: none lost, none counted twice
    assert len(read_run(LocalMailbox(box)).done) == len(UNITS)


def test_unit_marks_travel_in_the_learner_s_line_and_bad_ones_are_refused():
    """The marks are read back from the store: bounded and checked like every header field."""
    from gradientmail.errors import UnusableStateError
    from gradientmail.fold_gate import MAX_UNIT_MARKS, UnitMark
    from gradientmail.session.mail import Contribution

    line = Contribution(3, 9, 12, 1.5, units=(UnitMark("a", "t0", 7, 2), UnitMark("b", "t1", -4, None)))
    assert Contribution.from_json(json.loads(json.dumps(line.to_json())), where="w") == line
    assert len(Contribution(1, 1, 1, 1.0).to_json()) == 5  # no marks: the line stays as it was
    bad = [
        "not a list",
        [["a", "t0", 7]],
        [["", "t0", 7, 0]],
        [["a", "t" * 2000, 7, 0]],
        [["a", "t0", 2**63, 0]],
        [["a", "t0", True, 0]],
        [["a", "t0", 1, -1]],
        [["a", "t0", 1, 0]] * (MAX_UNIT_MARKS + 1),
    ]
    for units in bad:
        with pytest.raises(UnusableStateError, match="unit"):
            Contribution.from_json([1, 1, 1, 1.0, False, units], where="state 'x'")


def test_the_totals_a_line_s_marks_are_of_travel_with_it_and_bad_ones_are_refused():
    """Rank 0 of a sharded group marks an earlier step than it folds: a restart continues there."""
    from gradientmail.errors import UnusableStateError
    from gradientmail.fold_gate import UnitMark
    from gradientmail.session.mail import Contribution

    line = Contribution(3, 9, 36, 1.5, units=(UnitMark("a", "t0", 7, 2),), marked=(6, 24))
    assert Contribution.from_json(json.loads(json.dumps(line.to_json())), where="w") == line
    assert line.resumes_at == (6, 24)
    assert Contribution(3, 9, 36, 1.5).resumes_at == (9, 36)
    bare = Contribution(1, 4, 8, 1.0, marked=(2, 4))  # no unit marks: placeholders before it
    assert Contribution.from_json(bare.to_json(), where="w") == bare
    for marked in ([10, 24], [6, 37], [6], [6, True], "6,24", [-1, 0]):
        with pytest.raises(UnusableStateError, match="marked"):
            Contribution.from_json([3, 9, 36, 1.5, False, [], None, marked], where="state 'x'")


SMALL_UNITS = {f"u{n:03d}": n for n in range(300)}
"""One-batch units, all folded in one exchange: many more than a line of the state holds itself."""


def load_one(value: int):
    yield value, torch.tensor([value])


def die_after_folding_every_unit(box_path: str, consumed_path: str, fragments: int, kill: bool) -> None:
    """A node process: the documented loop over ``SMALL_UNITS`` with ``resume=True`` and a lease,
    a Session that folds once all of them are trained; with ``kill`` it SIGKILLs itself the moment
    the run holds every batch, before the queue's writer records any of them."""
    import os
    import signal

    box = LocalMailbox(box_path)
    model = torch.nn.Linear(2, 1)
    every = len(SMALL_UNITS)
    session = Session(model, mailbox=box, learner_id="node-0", every=None, every_steps=every, fragments=fragments)
    with session, open(consumed_path, "a", encoding="ascii") as log:
        if kill:
            gate = meeting_point(box, "node-0").gate
            gate.listen(lambda folded: folded is not None and folded >= every and os.kill(os.getpid(), signal.SIGKILL))
        with shared_queue(
            SMALL_UNITS,
            mailbox=box,
            learner_id="node-0",
            load=load_one,
            workers=0,
            resume=True,
            lease=timedelta(seconds=30),
        ) as batches:
            for step, _ in batches:
                log.write(f"{step}\n")
                log.flush()
                with torch.no_grad():
                    model.bias.add_(1.0)
                session.step(samples=1)


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("fragments", [1, 2])
def test_three_hundred_units_folded_in_one_exchange_count_once_after_a_kill(tmp_path, fragments):
    """The window after a fold, with small units: 300 one-batch units in one fold, the node killed
    before any of their records is written, restarted with ``resume=True``. Every unit's mark
    reaches the restart (an object the line names: a line holds 64 marks itself), so none is
    trained again: before, the marks of all but the last 64 were dropped and the run held 536
    samples of 300."""
    import multiprocessing

    from gradientmail.layout import MARKS_PREFIX

    context = multiprocessing.get_context("fork")
    box, consumed = str(tmp_path / "box"), str(tmp_path / "consumed.txt")
    first = context.Process(target=die_after_folding_every_unit, args=(box, consumed, fragments, True))
    first.start()
    first.join(120)
    assert first.exitcode == -9, "the node was to die right after its fold landed"
    assert not steps_recorded(LocalMailbox(box)), "no batch recorded: the run holds them all, unrecorded"
    assert list(LocalMailbox(box).list(MARKS_PREFIX)), "the marks went to an object of their own"
    second = context.Process(target=die_after_folding_every_unit, args=(box, consumed, fragments, False))
    second.start()
    second.join(120)
    assert second.exitcode == 0

    samples = consensus(LocalMailbox(box), torch.nn.Linear(2, 1))
    trained = Counter(int(line) for line in open(consumed, encoding="ascii").read().split())
    assert sum(samples.values()) == len(SMALL_UNITS)  # none lost, none counted twice
    assert trained == Counter(range(len(SMALL_UNITS))), "each unit trained once, by the first run"
    assert len(read_run(LocalMailbox(box)).done) == len(SMALL_UNITS)
    assert not list(LocalMailbox(box).list(MARKS_PREFIX)), "a clean exit leaves no marks object"
