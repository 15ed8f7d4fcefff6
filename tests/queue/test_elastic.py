"""The elastic queue's parts on their own: leases, takeovers, progress records, the claimer."""

from __future__ import annotations

import json
import multiprocessing
import queue
import time

import pytest
from elastic_nodes import reclaim_racer

from gradientmail import LeaseLostError, LocalMailbox, UnsafeStoreError
from gradientmail.fold_gate import UnitMark
from gradientmail.layout import claim_key, done_key, lease_key, work_key
from gradientmail.mailbox.wrappers import MailboxWrapper
from gradientmail.queue.claims import claim_body
from gradientmail.queue.elastic_options import ElasticOptions, check_elastic
from gradientmail.queue.liveness import LeaseWatch
from gradientmail.queue.progress import ProgressTracker
from gradientmail.queue.reclaim import ElasticClaimer
from gradientmail.queue.takeover import take_over


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _body(**fields) -> bytes:
    return json.dumps(fields).encode()


# -- leases ----------------------------------------------------------------------------------
def test_a_lease_vouches_for_its_writer_once_seen_renewed_or_while_recent_by_its_writer_s_clock():
    """On this clock a lease read for the first time is live; at the end of a run that must not
    pass for a sign of life from a node that died before this one started."""
    watch = LeaseWatch(60.0, FakeClock())
    fresh = _body(incarnation="a", beat=1, time=time.time() - 5, state="running")
    assert not watch.expired("n", fresh, "a") and watch.vouches("n", fresh)
    old = _body(incarnation="a", beat=1, time=time.time() - 3600, state="running")
    assert not watch.expired("d", old, "a") and not watch.vouches("d", old)
    renewed = _body(incarnation="a", beat=2, time=time.time() - 3600, state="running")  # its clock is far behind
    assert not watch.expired("d", renewed, "a") and watch.vouches("d", renewed), "seen renewed: alive"
    assert not watch.vouches("missing", None)


def test_a_lease_expires_only_after_it_stopped_changing_on_our_clock():
    clock = FakeClock()
    watch = LeaseWatch(2.0, clock)
    beat = _body(incarnation="a", beat=1, time=0.0, state="running")  # the writer's clock is off
    assert not watch.expired("n", beat, "a")  # first sight starts our clock
    clock.now += 1.9
    assert not watch.expired("n", beat, "a")
    clock.now += 0.2
    assert watch.expired("n", beat, "a")
    renewed = _body(incarnation="a", beat=2, time=0.0, state="running")
    assert not watch.expired("n", renewed, "a")  # a change restarts it
    clock.now += 5
    assert watch.expired("n", renewed, "a")


def test_a_missing_stopped_or_restarted_lease():
    clock = FakeClock()
    watch = LeaseWatch(1.0, clock)
    assert not watch.expired("gone", None)
    clock.now += 1.0
    assert watch.expired("gone", None)  # never wrote one, or it vanished
    assert watch.expired("s", _body(incarnation="a", beat=3, state="stopped"), "a")
    assert watch.expired("r", _body(incarnation="b", beat=1, state="running"), "a")


def test_options_are_checked_and_stores_without_cas_refused(tmp_path):
    pytest.importorskip("fsspec")
    from gradientmail.mailbox.filesystem import FsspecMailbox

    box = FsspecMailbox.from_url((tmp_path / "fs").as_uri())
    assert check_elastic(box, False, None) is None  # the design note's queue needs no CAS
    with pytest.raises(UnsafeStoreError, match="lease=.*replace_if.*FsspecMailbox"):
        check_elastic(box, False, 30)
    with pytest.raises(UnsafeStoreError, match="resume=True"):
        check_elastic(box, True, None)
    assert check_elastic(box, None, None) is None  # automatic: the design note's queue on this store
    with pytest.raises(TypeError, match="resume must be True, False or None"):
        check_elastic(LocalMailbox(tmp_path / "l"), "yes", None)
    with pytest.raises(ValueError, match="lease must be positive"):
        check_elastic(LocalMailbox(tmp_path / "l"), False, 0)
    with pytest.raises(TypeError, match="timedelta"):
        check_elastic(LocalMailbox(tmp_path / "l"), False, "2m")


# -- takeovers -------------------------------------------------------------------------------
def _orphan(box, identifier: str, step: int | None = None) -> None:
    """A unit claimed by a node "dead" that recorded ``step`` before it died."""
    box.put_if_absent(
        claim_key(identifier),
        _body(learner="dead", token="t-" + identifier, incarnation="old", state="active", step=None),
    )
    box.put(work_key("dead", identifier), _body(learner="dead", token="t-" + identifier, incarnation="old", step=step))


def test_take_over_continues_after_the_recorded_step(memory_mailbox):
    _orphan(memory_mailbox, "u1", step=6)
    got = take_over(memory_mailbox, "u1", "node-1", "inc-1")
    assert got is not None and got.after == 6 and got.taken_from == "dead"
    claim = json.loads(memory_mailbox.get(claim_key("u1")))
    assert claim["learner"] == "node-1" and claim["token"] == got.token and claim["step"] == 6
    assert memory_mailbox.get(work_key("dead", "u1")) is None  # the old record is cleaned up
    record = json.loads(memory_mailbox.get(work_key("node-1", "u1")))
    assert (record["token"], record["step"], record["incarnation"]) == (got.token, 6, "inc-1")
    # Now node-1's: a second takeover of the *dead* node's claim finds it changed.
    assert take_over(memory_mailbox, "u1", "node-2", "inc-2", expect=lambda claim: claim["learner"] == "dead") is None


def test_a_unit_done_before_the_takeover_is_not_taken(memory_mailbox):
    """A scan's listing of done units ages (seconds, on a store 100 ms away): the owner may
    finish the unit between that listing and the swap. Before the check after the swap the
    unit was trained again from its first batch (benchmarks.faults, `slow` trials)."""
    _orphan(memory_mailbox, "u1", step=None)
    memory_mailbox.put_if_absent(done_key("u1"), _body(learner="dead", token="t-u1"))
    assert take_over(memory_mailbox, "u1", "node-1", "inc-1") is None
    assert memory_mailbox.get(work_key("node-1", "u1")) is None  # nothing recorded for it


class RecordsBeforeTheSwap(MailboxWrapper):
    """The owner, alive but slow, writes its record of batches 0-4 between the taker's read of
    that record and the taker's swap (its folds of them landed, its lines' marks then cleared)."""

    def __init__(self, inner, record: bytes) -> None:
        super().__init__(inner)
        self.record = record

    def replace_if(self, key: str, data: bytes, version: str) -> bool:
        if self.record is not None:
            self.inner.put(work_key("dead", "u1"), self.record)
            self.record = None
        return self.inner.replace_if(key, data, version)


def test_a_record_written_just_before_the_swap_is_seen(memory_mailbox):
    """Found by benchmarks.faults (`slow` trials, under load): the taker continued after the
    record it read before the swap, and trained again batches the slow owner had folded and
    recorded meanwhile (5 of 144 counted twice). The record is read again after the swap."""
    _orphan(memory_mailbox, "u1", step=None)
    later = _body(learner="dead", token="t-u1", incarnation="old", step=4, position=4)
    got = take_over(RecordsBeforeTheSwap(memory_mailbox, later), "u1", "node-1", "inc-1")
    assert got is not None and (got.after, got.position) == (4, 4)
    assert json.loads(memory_mailbox.get(work_key("node-1", "u1")))["position"] == 4


def test_an_owner_that_beats_its_lease_before_a_fold_is_not_fenced_for_a_lease(memory_mailbox):
    """A slow owner (lease record late) beats its lease right before each fold that holds
    unrecorded batches: the lease changes, so a peer that judged the owner dead waits for it to
    stand still a whole lease again before it may fence it, and the fold lands first."""
    box = memory_mailbox
    clock = FakeClock()
    options = ElasticOptions(resume=False, lease_s=2.0)
    owner = ProgressTracker(box, "slow", options)
    owner.start()
    owner.gate.attach(lambda: None, fragments=1)  # a Session: the record of batch 0 waits for a fold
    box.put_if_absent(claim_key("a"), claim_body("slow", "t-a", incarnation=options.incarnation, state="active"))
    owner.consumed("a", "t-a", 0, 0, owner.gate.deliver(UnitMark("a", "t-a", 0, 0)))
    try:
        watcher = ElasticClaimer(box, ["a"], "node-1", ElasticOptions(resume=False, lease_s=2.0), clock=clock)
        claim = lambda: json.loads(box.get(claim_key("a")))  # noqa: E731
        assert not watcher.takeable("a", claim(), {})  # first sight
        clock.now += 3  # lease and claim stood still for longer than a lease
        owner.gate.confirm_owner()  # ...but the owner is about to fold
        assert json.loads(box.get(lease_key("slow")))["state"] == "running"
        assert not watcher.takeable("a", claim(), {}), "a lease beaten just now was fenced"
        clock.now += 3
        assert watcher.takeable("a", claim(), {})  # fenced now
        got = take_over(box, "a", "node-1", "inc-1")
        assert got is not None
        with pytest.raises(LeaseLostError, match="fenced by 'node-1', which takes its units over, because its lease"):
            owner.gate.confirm_owner()
        with pytest.raises(LeaseLostError, match="fenced by 'node-1'"):
            owner.check_owner(3.0)
    finally:
        owner.close(release=False)


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize("store", ["local", "moto", "seaweedfs", "radosgw"])
def test_two_processes_race_to_reclaim_the_same_orphans(tmp_path, store, request):
    """Two nodes reclaim the same orphaned units at the same moment: one winner each. On S3
    (moto, and SeaweedFS and radosgw, whose If-Match is atomic) the racers are spawned: this
    process may run moto's server thread."""
    if store == "local":
        box = LocalMailbox(tmp_path / "box")
        target, context, count = str(box.path), multiprocessing.get_context("fork"), 40
    else:
        server = "s3" if store == "moto" else f"s3-{store}"
        box = request.getfixturevalue("mailbox_factory")(server)
        target, context, count = box, multiprocessing.get_context("spawn"), 20
    identifiers = [f"{i:04d}" for i in range(count)]
    for identifier in identifiers:
        _orphan(box, identifier, step=3)
    box.put("run.json", b"{}")  # read by the racers to connect before the barrier
    barrier = context.Barrier(2)
    results = context.Queue()
    racers = [
        context.Process(target=reclaim_racer, args=(target, name, identifiers, barrier, results))
        for name in ("node-a", "node-b")
    ]
    for racer in racers:
        racer.start()
    try:
        won = dict(results.get(timeout=50) for _ in racers)
    except queue.Empty:
        pytest.fail("a racer died or hung")
    finally:
        for racer in racers:
            racer.join(timeout=30)
    a, b = set(won["node-a"]), set(won["node-b"])
    print(f"reclaim race ({store}): node-a won {len(a)}, node-b won {len(b)} of {len(identifiers)}")
    assert not a & b, "a unit was reclaimed twice"
    assert a | b == set(identifiers)
    for identifier in identifiers:
        claim = json.loads(box.get(claim_key(identifier)))
        winner = "node-a" if identifier in a else "node-b"
        assert claim["learner"] == winner and claim["step"] == 3
        assert json.loads(box.get(work_key(winner, identifier)))["token"] == claim["token"]


# -- progress records ------------------------------------------------------------------------
def test_tracker_records_progress_done_and_releases_the_rest(memory_mailbox):
    box = memory_mailbox
    options = ElasticOptions(resume=True, lease_s=60.0)
    claimer = ElasticClaimer(box, ["a", "b", "c"], "node-0", options)
    a, b = claimer.claim_next(), claimer.claim_next()
    assert (a.identifier, b.identifier) == ("a", "b") and a.after is None
    tracker = ProgressTracker(box, "node-0", options)
    tracker.start()
    lease = json.loads(box.get(lease_key("node-0")))
    assert lease["state"] == "running" and lease["incarnation"] == options.incarnation
    for step in range(3):
        tracker.consumed("a", a.token, step)
    tracker.finished("a", a.token)
    tracker.consumed("b", b.token, 10)
    tracker.flush()
    assert json.loads(box.get(work_key("node-0", "b")))["step"] == 10
    tracker.close()
    assert json.loads(box.get(done_key("a")))["token"] == a.token
    assert box.get(work_key("node-0", "a")) is None and box.get(work_key("node-0", "b")) is None
    claim_b = json.loads(box.get(claim_key("b")))
    assert claim_b["state"] == "released" and claim_b["step"] == 10
    assert json.loads(box.get(lease_key("node-0")))["state"] == "stopped"
    tracker.check()

    # Another node, with fewer or more peers, continues b after step 10, then takes c fresh.
    other = ElasticClaimer(box, ["c", "b", "a"], "node-7", ElasticOptions(resume=True, lease_s=None))
    got = other.claim_next()
    assert (got.identifier, got.after, got.taken_from) == ("b", 10, "node-0")
    assert other.claim_next().identifier == "c"
    assert other.claim_next() is None


def test_resume_takes_its_own_units_of_a_dead_incarnation_first(memory_mailbox):
    box = memory_mailbox
    first = ElasticClaimer(box, ["a", "b", "c", "d"], "node-0", ElasticOptions(resume=True, lease_s=None))
    _, b = first.claim_next(), first.claim_next()
    box.put(
        work_key("node-0", "b"),
        json.dumps(
            {  # progress written before the crash
                "learner": "node-0",
                "token": b.token,
                "incarnation": first.options.incarnation,
                "step": 4,
            }
        ).encode(),
    )
    # node-0 dies (no release). Its next incarnation takes a and b back before anything new.
    again = ElasticClaimer(box, ["d", "c", "b", "a"], "node-0", ElasticOptions(resume=True, lease_s=None))
    got = [again.claim_next() for _ in range(4)]
    assert [(g.identifier, g.after) for g in got] == [("b", 4), ("a", None), ("d", None), ("c", None)]
    assert again.stats["takeovers"] == 2 and again.stats["claims"] == 2
    assert again.claim_next() is None
    # A peer without resume or leases never touches them.
    peer = ElasticClaimer(box, ["a", "b"], "node-1", ElasticOptions(resume=False, lease_s=None))
    assert peer.claim_next() is None


def test_restore_from_a_state_dict_takes_back_exactly_those_units(memory_mailbox):
    box = memory_mailbox
    first = ElasticClaimer(box, ["a", "b"], "node-0", ElasticOptions(resume=False, lease_s=None))
    a = first.claim_next()
    state = {"a": {"token": a.token, "step": 2}}
    restored = ElasticClaimer(box, ["a", "b"], "node-0", ElasticOptions(resume=False, lease_s=None), restore=state)
    got = restored.claim_next()
    assert (got.identifier, got.after) == ("a", 2)
    twice = ElasticClaimer(box, ["a", "b"], "node-0", ElasticOptions(resume=False, lease_s=None), restore=state)
    assert twice.claim_next().identifier == "b"  # the token changed: a is not taken twice


def test_a_node_that_consumes_nothing_does_not_renew_its_lease(memory_mailbox):
    options = ElasticOptions(resume=False, lease_s=0.4)
    tracker = ProgressTracker(memory_mailbox, "node-0", options)
    tracker.start()
    first = memory_mailbox.get(lease_key("node-0"))
    assert tracker.beat_due() is None  # nothing consumed: nothing to renew, however long
    tracker.consumed("a", "t", 0)
    assert tracker.beat_due() is not None
    tracker.close(release=False)
    assert json.loads(memory_mailbox.get(lease_key("node-0")))["state"] == "stopped"
    assert json.loads(first)["beat"] == 1


# -- status ----------------------------------------------------------------------------------
def test_status_shows_done_in_progress_released_and_orphaned(memory_mailbox):
    from gradientmail.status import read_run

    box = memory_mailbox
    for identifier, learner, state in (
        ("a", "node-0", "active"),
        ("b", "node-0", "active"),
        ("c", "node-1", "released"),
        ("d", "dead", "active"),
    ):
        box.put_if_absent(claim_key(identifier), _body(learner=learner, token=identifier, incarnation="i", state=state))
    box.put_if_absent(done_key("a"), _body(learner="node-0", token="a"))
    box.put(
        lease_key("node-0"),
        _body(learner="node-0", incarnation="i", beat=1, lease_s=60.0, time=__import__("time").time(), state="running"),
    )
    box.put(lease_key("dead"), _body(learner="dead", incarnation="i", beat=9, lease_s=1.0, time=0.0, state="running"))
    run = read_run(box)
    assert run.elastic and run.done == ["a"] and run.released == ["c"] and run.orphaned == ["d"]
    assert run.units_in_progress == 1
    doc = run.to_dict()
    assert (
        doc["units_done"],
        doc["units_in_progress"],
        doc["units_released"],
        doc["units_orphaned"],
        doc["orphaned"],
    ) == (1, 1, 1, 1, ["d"])
    rows = {row["learner"]: row for row in doc["learners"]}
    assert rows["node-0"]["lease"] == "live" and rows["dead"]["lease"] == "expired"
    assert (rows["node-0"]["done"], rows["node-0"]["in_progress"], rows["dead"]["orphaned"]) == (1, 1, 1)


def test_status_of_a_design_note_run_has_no_elastic_counts(memory_mailbox):
    from gradientmail.status import read_run

    memory_mailbox.put_if_absent(claim_key("a"), _body(learner="node-0", token="a"))
    doc = read_run(memory_mailbox).to_dict()
    assert doc["elastic"] is False and doc["units_done"] is None and doc["orphaned"] == []
    assert doc["learners"][0]["done"] is None and doc["learners"][0]["lease"] is None


@pytest.mark.slow
def test_orphans_are_taken_once_the_lease_and_the_claim_stood_still(memory_mailbox):
    """Judged on the claimer's own (here: fake) clock, which advances only while it waits. The
    dead node's lease is old by its writer's clock, so the claimer waits for it at the end."""
    box = memory_mailbox
    clock = FakeClock()
    _orphan(box, "a", step=1)
    box.put(lease_key("dead"), _body(learner="dead", incarnation="old", beat=5, time=0.0, state="running"))
    waited = []

    def stopping() -> bool:  # called while waiting for the next scan: time passes
        clock.now += 0.25
        waited.append(clock.now)
        return False

    claimer = ElasticClaimer(
        box, ["a", "b"], "node-1", ElasticOptions(resume=False, lease_s=2.0), stopping=stopping, clock=clock
    )
    start = clock.now
    assert claimer.claim_next().identifier == "b"  # "a" is not judged at first sight
    got = claimer.claim_next()
    assert (got.identifier, got.after, got.taken_from) == ("a", 1, "dead")
    assert clock.now - start >= 2.0, "taken only after a whole lease without change"
    assert claimer.claim_next() is None  # nothing left that is not done or ours


class SleepingClock(FakeClock):
    """A monotonic clock that only the claimer's waits advance (its ``sleep``)."""

    def __init__(self) -> None:
        super().__init__()
        self.slept = 0.0

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        self.slept += seconds


def _claim(box, identifier: str, learner: str, incarnation: str = "i") -> None:
    box.put_if_absent(
        claim_key(identifier),
        _body(learner=learner, token="t-" + identifier, incarnation=incarnation, state="active", step=None),
    )


def _lease(box, learner: str, *, written: float, beat: int = 1, incarnation: str = "i") -> None:
    """``learner``'s lease record, written at ``written`` by its own (unix) clock."""
    box.put(
        lease_key(learner),
        _body(
            learner=learner,
            incarnation=incarnation,
            beat=beat,
            consumed=beat,
            lease_s=600.0,
            time=written,
            state="running",
        ),
    )


def _end_claimer(
    box, order, clock: SleepingClock, *, lease_s: float | None = 600.0, asked: list | None = None, may_wait=True
) -> ElasticClaimer:
    """A claimer on ``clock``; ``asked`` collects when it asked ``stopping()`` (only while it
    waits). ``may_wait=False``: a wait stops at once, and the claimer keeps its real ``sleep``
    (one that never waits never calls it)."""

    def stopping() -> bool:
        if asked is not None:
            asked.append(clock.now)
        return not may_wait

    options = ElasticOptions(resume=True, lease_s=lease_s)
    sleep = {"sleep": clock.sleep} if may_wait else {}
    return ElasticClaimer(box, order, "node-1", options, stopping=stopping, clock=clock, **sleep)


def test_a_node_with_nothing_left_leaves_once_every_unit_is_done_or_held_by_a_live_node(memory_mailbox):
    """The end of a run with a long lease: the last units are done or being trained by live
    peers, so the node leaves at once instead of rescanning a lease/2 later, or until they are done."""
    box, clock, asked = memory_mailbox, SleepingClock(), []
    _claim(box, "a", "node-2")  # a peer training its last unit
    _lease(box, "node-2", written=time.time() - 5)
    _claim(box, "b", "node-3")
    box.put_if_absent(done_key("b"), _body(learner="node-3", token="t-b"))
    _claim(box, "c", "node-4")  # a peer whose clock is an hour behind: seen renewed, so alive
    _lease(box, "node-4", written=time.time() - 3600)
    claimer = _end_claimer(box, ["a", "b", "c", "d"], clock, asked=asked, may_wait=False)
    _lease(box, "node-4", written=time.time() - 3600, beat=2)
    assert claimer.claim_next().identifier == "d"
    _lease(box, "node-4", written=time.time() - 3590, beat=3)
    assert claimer.claim_next() is None
    assert asked == [], "it waited for units held by live nodes"
    assert json.loads(box.get(claim_key("a")))["learner"] == "node-2", "a live node's unit was taken"


def test_a_node_with_nothing_left_waits_for_a_takeover_under_way_and_then_takes_the_unit(memory_mailbox):
    """A peer's lease that stands still (its writer's clock says long ago): the node waits,
    rescanning every few seconds rather than every lease/2, and takes the unit over once its
    lease and its claim stood still a whole lease on this node's clock."""
    box, clock = memory_mailbox, SleepingClock()
    lease_s = 600.0
    _orphan(box, "a", step=1)
    _lease(box, "dead", written=time.time() - 3600, incarnation="old")
    claimer = _end_claimer(box, ["a", "b"], clock, lease_s=lease_s)
    start = clock.now
    assert claimer.claim_next().identifier == "b"  # fresh units first; "a" is judged at its first sight
    got = claimer.claim_next()
    assert (got.identifier, got.after, got.taken_from) == ("a", 1, "dead")
    assert lease_s <= clock.now - start <= lease_s + claimer.await_rescan_s * 1.01, (
        "taken a whole lease after, promptly"
    )
    assert claimer.await_rescan_s < lease_s / 30 and claimer.stats["scans"] >= 30, "rescans while it waited"
    assert claimer.claim_next() is None


def test_a_node_stops_waiting_once_the_owner_of_the_awaited_unit_renews_its_lease(memory_mailbox):
    """The owner was alive after all (its record first read was old: a long first load, say):
    once its lease changes the node leaves, within a rescan, and the unit stays the owner's."""
    box, clock, asked = memory_mailbox, SleepingClock(), []
    _claim(box, "a", "slow")
    _lease(box, "slow", written=time.time() - 3600)
    claimer = _end_claimer(box, ["a", "b"], clock, asked=asked)
    assert claimer.claim_next().identifier == "b"
    renew_at = clock.now + 30.0

    def sleep(seconds: float) -> None:
        clock.sleep(seconds)
        if clock.now >= renew_at:
            _lease(box, "slow", written=time.time(), beat=2)

    claimer.sleep = sleep
    assert claimer.claim_next() is None
    assert asked, "it did not wait for the unit whose owner's lease did not vouch for it"
    assert renew_at <= clock.now <= renew_at + claimer.await_rescan_s * 1.01
    assert json.loads(box.get(claim_key("a")))["learner"] == "slow"


def test_without_leases_a_node_with_nothing_left_never_waits(memory_mailbox):
    box, clock, asked = memory_mailbox, SleepingClock(), []
    _claim(box, "a", "node-2")
    _lease(box, "node-2", written=0.0)
    _claim(box, "r", "node-3")
    box.put(claim_key("r"), _body(learner="node-3", token="t-r", incarnation="i", state="released", step=2))
    claimer = _end_claimer(box, ["a", "r", "b"], clock, lease_s=None, asked=asked, may_wait=False)
    assert claimer.claim_next().identifier == "r"  # a released unit, found by the first scan
    assert claimer.claim_next().identifier == "b"
    assert claimer.claim_next() is None and asked == []


def test_a_unit_just_taken_over_is_not_taken_again_at_once(memory_mailbox):
    box = memory_mailbox
    clock = FakeClock()
    box.put(lease_key("slow"), _body(learner="slow", incarnation="s", beat=1, state="running"))
    watcher = ElasticClaimer(box, ["a"], "node-9", ElasticOptions(resume=False, lease_s=1.0), clock=clock)
    leases: dict = {}
    watcher.takeable("x", {"learner": "slow", "token": "t0", "incarnation": "s"}, leases)
    clock.now += 5  # the lease has stood still for long...
    fresh = {"learner": "slow", "token": "t1", "incarnation": "s"}  # ...but this claim is new
    assert not watcher.takeable("x", fresh, {})
    clock.now += 1
    assert watcher.takeable("x", fresh, {})
