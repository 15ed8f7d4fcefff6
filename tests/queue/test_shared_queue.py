"""SharedQueueDataset and shared_queue in one process: behaviour, errors, bounds, shutdown."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch
from queue_nodes import Item, RecordingLoad, claims, named_units
from torch.utils.data import DataLoader

import gradientmail
from gradientmail import LocalMailbox, MemoryMailbox, SharedQueueDataset, units_claimed_by
from gradientmail.errors import (
    InProcessMailboxError,
    InvalidKeyError,
    LoaderError,
    MailboxError,
    UnpicklableError,
    UnsafeStoreError,
    WrongProcessError,
)
from gradientmail.layout import CLAIMS_PREFIX, RUN_KEY
from gradientmail.mailbox.wrappers import CountingMailbox, FaultyMailbox
from gradientmail.patterns.shared_queue import shared_queue
from gradientmail.queue.dataset import prepare_mailbox

FORK = multiprocessing.get_context("fork")

pytestmark = pytest.mark.timeout(60)


def load_item(item: Item):
    for step in range(item.steps):
        yield step, torch.tensor([item.index, step])


def _claimed(mailbox) -> list[str]:
    return [key[len(CLAIMS_PREFIX) :] for key in mailbox.list(CLAIMS_PREFIX)]


def wait_until(condition, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.01)


def leftovers(threads_before: set[threading.Thread]) -> tuple[list, list]:
    return multiprocessing.active_children(), [t for t in threading.enumerate() if t not in threads_before]


# -- the dataset on its own ------------------------------------------------------------------


def test_dataset_iterates_every_unit_in_order(memory_mailbox):
    units = named_units(5, steps=3)
    dataset = SharedQueueDataset(units, mailbox=memory_mailbox, learner_id="solo", load=load_item)
    batches = [(step, tuple(int(v) for v in tensor)) for step, tensor in dataset]
    assert batches == [(s, (i, s)) for i in range(5) for s in range(3)]
    assert {ident: claim["learner"] for ident, claim in claims(memory_mailbox).items()} == dict.fromkeys(units, "solo")
    run = json.loads(memory_mailbox.get(RUN_KEY))
    assert run["units"] == 5 and run["created"] > 0
    assert list(dataset) == [], "every unit is claimed: a second pass finds no work"


def test_claim_body_fields(memory_mailbox):
    dataset = SharedQueueDataset(named_units(1), mailbox=memory_mailbox, learner_id="node-3", load=load_item)
    list(dataset)
    claim = claims(memory_mailbox)["00000"]
    assert set(claim) >= {"learner", "token", "host", "pid", "worker", "claimed_at"}
    assert claim["learner"] == "node-3" and claim["worker"] is None and len(claim["token"]) == 32


def test_order_is_each_nodes_preference(memory_mailbox):
    units = named_units(4)
    order = ["00002", "00000", "00003", "00001"]
    dataset = SharedQueueDataset(units, mailbox=memory_mailbox, learner_id="a", load=load_item, order=order)
    assert [int(t[0]) for _, t in dataset] == [2, 0, 3, 1]


def test_nodes_skip_units_claimed_by_others(memory_mailbox):
    units = named_units(6)
    first = iter(SharedQueueDataset(units, mailbox=memory_mailbox, learner_id="a", load=load_item))
    second = iter(SharedQueueDataset(units, mailbox=memory_mailbox, learner_id="b", load=load_item))
    got = {"a": [], "b": []}
    for _ in range(3):
        got["a"].append(int(next(first)[1][0]))
        got["b"].append(int(next(second)[1][0]))
    assert list(first) == [] and list(second) == []
    assert sorted(got["a"] + got["b"]) == list(range(6))
    assert units_claimed_by("a") >= 3


def test_units_claimed_by_counts_this_process():
    mailbox = MemoryMailbox("claimed-by-test")
    try:
        before = units_claimed_by("counted")
        list(SharedQueueDataset(named_units(7), mailbox=mailbox, learner_id="counted", load=load_item))
        assert units_claimed_by("counted") - before == 7
        assert units_claimed_by("nobody-ever") == 0
    finally:
        mailbox.clear()


def test_dataset_in_users_own_dataloader_with_workers(local_mailbox):
    units = named_units(30, steps=2)
    dataset = SharedQueueDataset(units, mailbox=local_mailbox, learner_id="dl", load=load_item)
    before = units_claimed_by("dl")
    loader = DataLoader(dataset, batch_size=None, num_workers=2, multiprocessing_context=FORK)
    pairs = [(int(tensor[0]), step) for step, tensor in loader]
    assert sorted(pairs) == [(i, s) for i in range(30) for s in range(2)]
    assert units_claimed_by("dl") - before == 30, "claims in worker processes are counted"
    workers = {claim["worker"] for claim in claims(local_mailbox).values()}
    assert workers <= {0, 1}


def test_empty_mapping_yields_nothing_and_claims_nothing(memory_mailbox):
    assert list(SharedQueueDataset({}, mailbox=memory_mailbox, learner_id="a", load=load_item)) == []
    with shared_queue({}, mailbox=memory_mailbox, learner_id="a", load=load_item, workers=0) as batches:
        assert list(batches) == []
    assert list(memory_mailbox.list()) == []


def test_exported_from_package():
    assert gradientmail.SharedQueueDataset is SharedQueueDataset
    assert gradientmail.shared_queue is shared_queue


# -- shared_queue ------------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [0, 1, 2])
def test_shared_queue_delivers_every_batch_once(local_mailbox, workers):
    units = named_units(20, steps=3)
    with shared_queue(
        units, mailbox=local_mailbox, learner_id=f"w{workers}", load=load_item, prefetch=4, workers=workers
    ) as batches:
        got = [(int(t[0]), step) for step, t in batches]
    assert sorted(got) == [(i, s) for i in range(20) for s in range(3)]
    # Each unit's steps arrive in order; with two workers, units interleave.
    for i in range(20):
        assert [s for u, s in got if u == i] == [0, 1, 2]
    assert sorted(_claimed(local_mailbox)) == sorted(units)


def test_workers_zero_runs_with_memory_mailbox_and_unpicklable_loader(memory_mailbox):
    units = named_units(4, steps=2)
    lock = threading.Lock()  # cannot be pickled

    def load(item):  # a closure: cannot be pickled either
        with lock:
            yield from load_item(item)

    with shared_queue(units, mailbox=memory_mailbox, learner_id="nb", load=load, workers=0) as batches:
        assert len(list(batches)) == 8


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [1, 2])
def test_two_workers_of_one_node_never_load_one_unit(tmp_path, workers):
    mailbox = LocalMailbox(tmp_path / "box")
    units = named_units(60)
    load = RecordingLoad(str(tmp_path), "n")
    with shared_queue(units, mailbox=mailbox, learner_id="n", load=load, prefetch=2, workers=workers) as batches:
        got = sorted(int(t[0]) for _, t in batches)
    assert got == list(range(60))
    loaded = [name for path in tmp_path.glob("loaded-*.txt") for name in path.read_text().split()]
    assert sorted(loaded) == sorted(units), "each unit loaded exactly once across workers"


class ProducedCounter:
    """A loader that counts batches produced (across worker processes) and records their units."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.produced = FORK.Value("i", 0)

    def __call__(self, item: Item):
        for step in range(self.steps):
            with self.produced.get_lock():
                self.produced.value += 1
            yield step, torch.tensor([item.index, step])


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize(("workers", "prefetch"), [(0, 3), (1, 3), (2, 4), (2, 2), (2, 5)])
def test_prefetch_bounds_batches_in_flight_and_claims(local_mailbox, workers, prefetch):
    units = named_units(40)
    load = ProducedCounter(steps=3)
    # DataLoader's prefetch_factor is per worker: prefetch=5 over 2 workers buffers 2 x 2.
    bound = prefetch // workers * workers if workers else prefetch
    consumed = 0
    with shared_queue(  # the design note's queue: the elastic one's buffer holds end markers too
        units, mailbox=local_mailbox, learner_id="p", load=load, prefetch=prefetch, workers=workers, resume=False
    ) as batches:
        for _ in range(3):
            # The buffer fills to exactly `prefetch`...
            wait_until(lambda done=consumed: load.produced.value >= done + bound)
            claimed = len(_claimed(local_mailbox))
            # ...and then nothing more is produced or claimed while the loop stalls (a
            # must-not-happen check: an implementation that overran would be caught here).
            time.sleep(0.3)
            assert load.produced.value == consumed + bound <= consumed + prefetch
            assert len(_claimed(local_mailbox)) == claimed
            # No hoarding: units of 3 batches, at most one unit started per worker beyond those.
            assert claimed <= -(-(consumed + bound) // 3) + max(workers, 1) - 1
            for _ in range(4):
                next(batches)
                consumed += 1


class FailingLoad:
    """Yields two batches per unit; the unit with index ``bad`` fails after its first batch."""

    def __init__(self, bad: int) -> None:
        self.bad = bad
        self.failed = FORK.Event()

    def __call__(self, item: Item):
        for step in range(2):
            if item.index == self.bad and step == 1:
                self.failed.set()
                raise ValueError(f"boom in unit {item.name}")
            yield step, torch.tensor([item.index, step])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [0, 1, 2])
def test_load_error_arrives_after_buffered_batches(local_mailbox, workers):
    units = named_units(10)
    load = FailingLoad(bad=2)
    got = []
    with pytest.raises(ValueError, match="boom in unit 00002") as caught:
        with shared_queue(
            units, mailbox=local_mailbox, learner_id="e", load=load, prefetch=8, workers=workers
        ) as batches:
            if workers <= 1:
                # One producer runs 8 batches ahead, past the failing one. Two each run 3 ahead
                # (plus the hand-off's 2, from either): the failing 4th of one may wait.
                assert load.failed.wait(60)  # a bound for a hang: DataLoader workers start slowly on busy cores
            for step, tensor in batches:
                got.append((int(tensor[0]), step))
    assert (2, 0) in got, "the failing unit's batch produced before the error was delivered"
    if workers <= 1:
        # One producer: everything it produced before the error came first, in order.
        assert got == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0)]
    assert "00002" in str(caught.value) or any("00002" in n for n in getattr(caught.value, "__notes__", []))


def test_iterator_ends_after_an_error(memory_mailbox):
    with shared_queue(
        named_units(5), mailbox=memory_mailbox, learner_id="e", load=FailingLoad(bad=0), workers=0
    ) as batches:
        next(batches)
        with pytest.raises(ValueError):
            next(batches)
        assert list(batches) == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [0, 1])
def test_mailbox_error_reaches_the_loop(local_mailbox, workers):
    calls = FORK.Value("i", 0)

    def fault(operation, key):
        if operation == "put_if_absent" and key.startswith(CLAIMS_PREFIX):
            with calls.get_lock():
                calls.value += 1
                if calls.value == 3:
                    return MailboxError("store on fire", operation=operation, key=key, store="test")
        return None

    mailbox = FaultyMailbox(local_mailbox, fault)
    got = []
    with pytest.raises(MailboxError, match="store on fire"):
        with shared_queue(
            named_units(10), mailbox=mailbox, learner_id="m", load=load_item, prefetch=4, workers=workers
        ) as batches:
            for _, tensor in batches:
                got.append(int(tensor[0]))
    assert got == [0, 1]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [1, 2])
def test_loader_yielding_the_wrong_thing(memory_mailbox, local_mailbox, workers):
    def bad_load(item):
        yield "not a pair"

    with pytest.raises(LoaderError, match=r"unit '00000'.*str 'not a pair'"):
        list(SharedQueueDataset(named_units(1), mailbox=memory_mailbox, learner_id="x", load=bad_load))
    with pytest.raises(LoaderError, match="00000"):
        with shared_queue(
            named_units(3), mailbox=local_mailbox, learner_id="x", load=bad_load, workers=workers, prefetch=3
        ) as batches:
            list(batches)


@pytest.mark.parametrize(
    "item",
    [(1.5, torch.zeros(1)), (1, [1, 2]), (True, torch.zeros(1)), (1, torch.zeros(1), 2), torch.zeros(2), None],
)
def test_loader_error_names_unit_and_what_it_yielded(memory_mailbox, item):
    def bad_load(value):
        yield item

    with pytest.raises(LoaderError) as caught:
        list(SharedQueueDataset({"u-7": 0}, mailbox=memory_mailbox, learner_id="x", load=bad_load))
    assert "'u-7'" in str(caught.value) and type(item).__name__ in str(caught.value)
    assert isinstance(caught.value, TypeError)
    assert len(str(caught.value)) < 400, "long values are truncated"


def test_loader_returning_a_non_iterable(memory_mailbox):
    with pytest.raises(LoaderError, match="'u'.*NoneType"):
        list(SharedQueueDataset({"u": 0}, mailbox=memory_mailbox, learner_id="x", load=lambda value: None))


# -- leaving the with block ---------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("how", ["break", "exception"])
def test_early_exit_leaves_nothing_behind(local_mailbox, workers, how):
    threads_before = set(threading.enumerate())
    units = named_units(200, steps=2)

    class Stop(Exception):
        pass

    with contextlib.suppress(Stop):
        with shared_queue(
            units, mailbox=local_mailbox, learner_id="q", load=load_item, prefetch=4, workers=workers
        ) as batches:
            for n, _ in enumerate(batches):
                if n == 5:
                    if how == "break":
                        break
                    raise Stop
    children, threads = leftovers(threads_before)
    assert children == [] and threads == []
    claimed = _claimed(local_mailbox)
    assert 3 <= len(claimed) < len(units)
    time.sleep(0.3)  # must-not-happen check: a leftover prefetcher would claim more now
    assert _claimed(local_mailbox) == claimed
    assert list(batches) == [], "the iterator is finished after the block"


@pytest.mark.timeout(60)
def test_exit_without_iterating(local_mailbox):
    threads_before = set(threading.enumerate())
    with shared_queue(named_units(50), mailbox=local_mailbox, learner_id="idle", load=load_item, workers=2, prefetch=2):
        pass
    assert leftovers(threads_before) == ([], [])
    assert len(_claimed(local_mailbox)) <= 2


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_slow_operation_in_flight_is_allowed_to_finish(tmp_path):
    """DataLoader alone would SIGTERM a worker still busy after 5 s; the queue waits for it."""
    mailbox = LocalMailbox(tmp_path / "box")
    load = SlowSecondBatch(str(tmp_path), seconds=6.0)
    threads_before = set(threading.enumerate())
    with shared_queue(
        named_units(3, steps=3), mailbox=mailbox, learner_id="slow", load=load, prefetch=2, workers=1
    ) as batches:
        next(batches)
        assert load.started(), "the slow load is in flight when the block is left"
    assert (tmp_path / "finished").exists(), "the in-flight load was interrupted"
    assert (tmp_path / "closed").exists(), "the loader's own cleanup ran"
    assert leftovers(threads_before) == ([], [])


def test_shutdown_timeout_bounds_the_wait(memory_mailbox):
    release = threading.Event()

    def load(item):
        yield 0, torch.zeros(1)
        release.wait(20)
        yield 1, torch.zeros(1)

    with pytest.warns(UserWarning, match="shutdown_timeout"):
        with shared_queue(
            named_units(2), mailbox=memory_mailbox, learner_id="t", load=load, workers=0, shutdown_timeout=0.1
        ) as batches:
            next(batches)
    release.set()  # the abandoned operation finishes in the background
    wait_until(lambda: not any(t.name.startswith("gradientmail-shared-queue-t") for t in threading.enumerate()))


class SlowSecondBatch:
    def __init__(self, out_dir: str, seconds: float) -> None:
        self.out = Path(out_dir)
        self.seconds = seconds

    def started(self) -> bool:
        deadline = time.monotonic() + 20
        while not (self.out / "started").exists():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def __call__(self, item: Item):
        try:
            yield 0, torch.tensor([item.index, 0])
            (self.out / "started").touch()
            time.sleep(self.seconds)
            (self.out / "finished").touch()
            yield 1, torch.tensor([item.index, 1])
        finally:
            (self.out / "closed").touch()


# -- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize("identifier", [1, None, ("a",), b"bytes"])
def test_non_string_identifier(memory_mailbox, identifier):
    with pytest.raises(TypeError, match="str") as caught:
        SharedQueueDataset({identifier: 0}, mailbox=memory_mailbox, learner_id="a", load=load_item)
    assert isinstance(caught.value, InvalidKeyError) and repr(identifier) in str(caught.value)


@pytest.mark.parametrize("identifier", ["", "../escape", "a//b", ".hidden", "tab\there", "back\\slash", "x" * 600])
def test_unsafe_identifier(memory_mailbox, identifier):
    with pytest.raises(InvalidKeyError, match="unit identifier"):
        with shared_queue({identifier: 0}, mailbox=memory_mailbox, learner_id="a", load=load_item, workers=0):
            pass


def test_an_absolute_path_identifier_is_called_one(memory_mailbox):
    with pytest.raises(InvalidKeyError, match="is an absolute path.*'data/shard-0.bin'"):
        SharedQueueDataset({"/data/shard-0.bin": 0}, mailbox=memory_mailbox, learner_id="a", load=load_item)


def test_an_error_about_a_very_long_identifier_names_it_briefly_and_keeps_the_reason(memory_mailbox):
    identifier = "x" * 10_000
    with pytest.raises(InvalidKeyError) as caught:
        with shared_queue({identifier: 0}, mailbox=memory_mailbox, learner_id="a", load=load_item, workers=0):
            pass
    message = str(caught.value)
    assert len(message) < 300, len(message)
    assert "longer than 512 bytes" in message and "(10002 characters)" in message


@pytest.mark.parametrize("length", [256, 300])
def test_an_identifier_no_directory_could_hold_is_refused_before_anything_is_written(local_mailbox, length):
    identifier = "u" * length
    with pytest.raises(InvalidKeyError, match="segment longer than 255 bytes"):
        with shared_queue({identifier: 0}, mailbox=local_mailbox, learner_id="a", load=load_item, workers=0):
            pass
    assert list(local_mailbox.list("")) == []  # no run.json binding the prefix to them

    def one_batch(value):
        yield 0, torch.zeros(1)

    with shared_queue({"u" * 255: 0}, mailbox=local_mailbox, learner_id="a", load=one_batch, workers=0) as batches:
        assert len(list(batches)) == 1  # the longest accepted identifier is a file name


def test_identifier_that_is_a_folder_of_another(memory_mailbox):
    with pytest.raises(InvalidKeyError, match="'a' is a folder of unit 'a/b'"):
        SharedQueueDataset({"a": 0, "a/b": 1}, mailbox=memory_mailbox, learner_id="x", load=load_item)
    SharedQueueDataset({"a/1": 0, "a/2": 1}, mailbox=memory_mailbox, learner_id="x", load=load_item)


@pytest.mark.parametrize(
    ("learner_id", "error"),
    [("", InvalidKeyError), ("a/b", InvalidKeyError), (".x", InvalidKeyError), (3, TypeError), (b"x", TypeError)],
)
def test_bad_learner_id(memory_mailbox, learner_id, error):
    with pytest.raises(error, match="learner_id"):
        SharedQueueDataset(named_units(1), mailbox=memory_mailbox, learner_id=learner_id, load=load_item)


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"prefetch": 0}, ValueError, "prefetch must be >= 1"),
        ({"prefetch": -3}, ValueError, "prefetch must be >= 1"),
        ({"prefetch": 2.5}, TypeError, "prefetch must be an int"),
        ({"prefetch": 10**9}, ValueError, "prefetch must be <= 4096"),
        ({"workers": -1}, ValueError, "workers must be >= 0"),
        ({"workers": 4, "prefetch": 2}, ValueError, "prefetch=2 is below workers=4"),
        ({"load": "load_item"}, TypeError, "load must be a callable"),
        ({"order": "00000"}, ValueError, "order must be a sequence"),
        ({"order": ["00000"]}, ValueError, "missing: '00001'"),
        ({"order": ["00000", "00001", "zzz"]}, ValueError, "unknown: 'zzz'"),
        ({"order": ["00000", "00000"]}, ValueError, "missing: '00001'; repeated: '00000'"),
        ({"order": [0, 1]}, ValueError, "order must hold unit identifiers"),
        ({"units": [("00000", 1)]}, TypeError, "units must be a mapping"),
        ({"mailbox": "/tmp/box"}, TypeError, "mailbox must be a Mailbox"),
        ({"shutdown_timeout": -1}, ValueError, "shutdown_timeout must be >= 0"),
    ],
)
def test_bad_arguments(memory_mailbox, options, error, match):
    arguments = {"units": named_units(2), "mailbox": memory_mailbox, "learner_id": "a", "load": load_item, "workers": 0}
    arguments.update(options)
    with pytest.raises(error, match=match):
        with shared_queue(**arguments):
            pass
    assert list(memory_mailbox.list()) == [], "nothing is written before the arguments are checked"


@pytest.mark.parametrize("wrap", [lambda m: m, CountingMailbox])
def test_memory_mailbox_with_worker_processes(memory_mailbox, wrap):
    with pytest.raises(InProcessMailboxError, match="workers=0, or a LocalMailbox / S3 mailbox") as caught:
        with shared_queue(named_units(2), mailbox=wrap(memory_mailbox), learner_id="a", load=load_item, workers=1):
            pass
    assert isinstance(caught.value, WrongProcessError) and isinstance(caught.value, ValueError)


def test_unpicklable_loader_under_spawn(local_mailbox):
    with pytest.raises(UnpicklableError, match="(?i)use workers=0, or a module-level function") as caught:
        with shared_queue(
            named_units(2),
            mailbox=local_mailbox,
            learner_id="a",
            load=lambda item: load_item(item),
            workers=1,
            multiprocessing_context="spawn",
        ):
            pass
    assert isinstance(caught.value, TypeError) and "load" in str(caught.value)
    units = {"u": threading.Lock()}
    with pytest.raises(UnpicklableError, match="unit values"):
        with shared_queue(
            units, mailbox=local_mailbox, learner_id="a", load=load_item, workers=1, multiprocessing_context="spawn"
        ):
            pass
    assert _claimed(local_mailbox) == []


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_spawned_workers(local_mailbox):
    units = named_units(6, steps=2)
    before = units_claimed_by("sp")
    with shared_queue(
        units,
        mailbox=local_mailbox,
        learner_id="sp",
        load=load_item,
        workers=1,
        prefetch=2,
        multiprocessing_context="spawn",
    ) as batches:
        assert sorted((int(t[0]), s) for s, t in batches) == [(i, s) for i in range(6) for s in range(2)]
    assert units_claimed_by("sp") - before == 6
    assert multiprocessing.active_children() == []


class IgnoresConditions(MemoryMailbox):
    """A store that silently overwrites on put_if_absent, like some S3-compatible servers."""

    def put_if_absent(self, key, data):
        self.put(key, data)
        return True


@pytest.mark.parametrize("workers", [0])
def test_store_without_conditional_writes_is_refused_before_any_claim(workers):
    mailbox = IgnoresConditions("unsafe-store-test")
    try:
        with pytest.raises(UnsafeStoreError):
            with shared_queue(named_units(3), mailbox=mailbox, learner_id="a", load=load_item, workers=workers):
                pass
        with pytest.raises(UnsafeStoreError):
            list(SharedQueueDataset(named_units(3), mailbox=mailbox, learner_id="a", load=load_item))
        assert _claimed(mailbox) == []
    finally:
        mailbox.clear()


# -- the store check: full probe by the node that creates run.json ------------------------------


def test_only_the_node_that_creates_run_json_probes_the_store(memory_mailbox):
    units = named_units(1)
    first, second, third = (CountingMailbox(memory_mailbox) for _ in range(3))
    prepare_mailbox(first, len(units))
    # run.json created, then verify_mailbox: probe created twice, read back, deleted.
    assert dict(first.counts) == {"put_if_absent": 3, "get": 1, "delete": 1}
    prepare_mailbox(second, len(units))
    prepare_mailbox(third, len(units))
    # Refused a duplicate run.json (the evidence the probe looks for), then read it back.
    assert dict(second.counts) == dict(third.counts) == {"put_if_absent": 1, "get": 1}
    assert json.loads(memory_mailbox.get(RUN_KEY))["units"] == 1
    assert list(memory_mailbox.list("")) == [RUN_KEY], "no probe key left behind"


def test_every_node_probes_a_store_that_ignores_conditions_and_is_refused():
    mailbox = IgnoresConditions(f"unsafe-every-node-{uuid.uuid4().hex}")
    try:
        mailbox.put(RUN_KEY, b"{}")  # as if an earlier node had created it
        for learner in ("a", "b", "c"):
            counted = CountingMailbox(mailbox)
            dataset = SharedQueueDataset(
                named_units(3), mailbox=counted, learner_id=learner, load=load_item, resume=False
            )
            with pytest.raises(UnsafeStoreError, match="second put_if_absent"):
                list(dataset)
            assert counted.counts["put_if_absent"] == 3, "run.json 'created' again, so the full probe ran"
        assert _claimed(mailbox) == []
    finally:
        mailbox.clear()


class RefusesEverything(MemoryMailbox):
    """A broken store: every create reports that the key already exists, and writes nothing."""

    def put_if_absent(self, key, data):
        return False


def test_a_store_that_refuses_every_create_is_refused():
    mailbox = RefusesEverything(f"refuses-{uuid.uuid4().hex}")
    try:
        with pytest.raises(UnsafeStoreError, match="run.json.*cannot be read"):
            list(SharedQueueDataset(named_units(3), mailbox=mailbox, learner_id="a", load=load_item))
        with pytest.raises(UnsafeStoreError, match="run.json"):
            with shared_queue(named_units(3), mailbox=mailbox, learner_id="a", load=load_item, workers=0):
                pass
    finally:
        mailbox.clear()
