"""Races with real processes on the LocalMailbox (and threads on every in-process backend).

Writers start together at a barrier and create the same keys in the same order, so that most
keys are contended at the same moment. Readers in other processes read those keys while they
are being created: each value must be absent or whole, never empty or partial. Nothing here
depends on timing: every property is checked on every value seen.
"""

from __future__ import annotations

import multiprocessing
import queue
import threading
from concurrent.futures import ProcessPoolExecutor

import pytest
from mailbox_race_workers import (  # a light module: spawned processes import it quickly
    KEYS,
    READERS,
    WRITERS,
    check_value,
    make_value,
    reader_process,
    use_in_worker,
    writer_process,
)

from gradientmail import LocalMailbox, WrongProcessError

pytestmark = pytest.mark.slow  # every test here starts processes


def _race_processes(target, keys: list[str]) -> tuple[dict[str, list[int]], list, list]:
    """Spawn the writers and readers on ``target`` (a directory path or a mailbox)."""
    context = multiprocessing.get_context("spawn")  # no inherited threads or locks
    barrier = context.Barrier(WRITERS + READERS)
    done = context.Event()
    results = context.Queue()
    processes = [
        context.Process(target=writer_process, args=(target, w, barrier, results, keys)) for w in range(WRITERS)
    ] + [context.Process(target=reader_process, args=(target, r, barrier, done, results, keys)) for r in range(READERS)]
    for process in processes:
        process.start()
    try:
        winners: dict[str, list[int]] = {key: [] for key in keys}
        for _ in range(WRITERS):
            _, writer, won = results.get(timeout=90)
            for key in won:
                winners[key].append(writer)
        done.set()
        reads = [results.get(timeout=60)[2] for _ in range(READERS)]
    except queue.Empty:
        pytest.fail("a worker process died or hung (see its stderr above)")
    finally:
        done.set()
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    return winners, reads, processes


def _check_race(mailbox, keys, winners, reads, processes) -> None:
    assert {key: len(who) for key, who in winners.items() if len(who) != 1} == {}
    for key in keys:  # the stored value is the winner's, whole
        assert check_value(key, mailbox.get(key)) == winners[key][0]
    for seen, problems, count in reads:
        assert count == 0, problems
        assert seen >= len(keys)  # the final pass alone reads every key
    assert list(mailbox.list("units/")) == keys  # no temporary file shows up
    assert all(process.exitcode == 0 for process in processes)


@pytest.mark.timeout(120)
def test_one_winner_per_key_and_whole_values_across_processes(tmp_path):
    mailbox = LocalMailbox(tmp_path / "mailbox")
    winners, reads, processes = _race_processes(str(mailbox.path), KEYS)
    _check_race(mailbox, KEYS, winners, reads, processes)
    assert sorted(p.name for p in (mailbox.path / "units").iterdir()) == [k[6:] for k in KEYS]


@pytest.mark.timeout(120)
def test_one_winner_per_key_across_processes_on_s3(s3_target):
    """The same race through S3 (If-None-Match: *): moto, and SeaweedFS and radosgw, real
    implementations whose conditional create is atomic; 60 keys keep it to seconds."""
    mailbox = s3_target.mailbox("race", backoff=0.01)
    keys = KEYS[:60]
    winners, reads, processes = _race_processes(mailbox, keys)
    _check_race(mailbox, keys, winners, reads, processes)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ["local", "memory", "s3-seaweedfs", "s3-radosgw"])
def test_one_winner_per_key_across_threads(backend, mailbox_factory):
    mailbox = mailbox_factory(backend)
    keys = KEYS if backend in ("local", "memory") else KEYS[:60]  # seconds, not tens
    barrier = threading.Barrier(WRITERS)
    winners: dict[str, list[int]] = {key: [] for key in keys}
    lock = threading.Lock()

    def write(writer: int) -> None:
        barrier.wait(timeout=30)
        for key in keys:
            if mailbox.put_if_absent(key, make_value(key, writer)):
                with lock:
                    winners[key].append(writer)

    threads = [threading.Thread(target=write, args=(w,)) for w in range(WRITERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=50)
    assert not any(thread.is_alive() for thread in threads)
    assert {key: who for key, who in winners.items() if len(who) != 1} == {}
    for key in keys:
        assert check_value(key, mailbox.get(key)) == winners[key][0]


@pytest.mark.timeout(60)
def test_memory_mailbox_refuses_another_process(memory_mailbox):
    memory_mailbox.put("k", b"v")
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=context) as pool:
        with pytest.raises(WrongProcessError, match="cannot be shared with process"):
            pool.submit(use_in_worker, memory_mailbox).result(timeout=50)
    assert memory_mailbox.get("k") == b"v"  # still fine where it lives


@pytest.mark.timeout(60)
def test_local_mailbox_works_in_another_process(local_mailbox):
    local_mailbox.put("k", b"v")
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=context) as pool:
        assert pool.submit(use_in_worker, local_mailbox).result(timeout=50) == b"v"
