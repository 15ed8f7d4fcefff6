"""Silent newcomer mistakes get a clear word.

- ``run.json`` records the unit set's fingerprint; a node with another unit set is refused
  (``RunMismatchError``) before it claims anything. Old records without one stay joinable.
- A node that joins a run whose every unit is already taken warns once (0 batches otherwise
  look like a finished run).
- Iterating ``shared_queue(...)`` without ``with`` says to use ``with``.
"""

from __future__ import annotations

import json
import multiprocessing
import warnings

import pytest
import torch

from gradientmail import GradientMailError, LocalMailbox, RunMismatchError, SharedQueueDataset
from gradientmail.layout import CLAIMS_PREFIX, RUN_KEY
from gradientmail.patterns.shared_queue import shared_queue
from gradientmail.run_record import prepare_mailbox, unit_fingerprint

EMPTY_WARNING = "0 batches for learner .* every unit of this run .* already taken or done .*use a fresh prefix"


def _load(value: int):
    for step in range(2):
        yield step, torch.tensor([value, step])


def _units(count: int, start: int = 0) -> dict[str, int]:
    return {f"u{i:03d}": i for i in range(start, start + count)}


def _drain(box, units, learner: str, **options) -> list[tuple[int, int]]:
    with shared_queue(units, mailbox=box, learner_id=learner, load=_load, **options) as batches:
        return [(int(batch[0]), step) for step, batch in batches]


# -- the fingerprint ---------------------------------------------------------------------------
def test_the_run_record_carries_the_unit_sets_fingerprint(mailbox_factory):
    box = mailbox_factory("s3")
    units = _units(4)
    assert len(_drain(box, units, "node-0", workers=0)) == 8
    record = json.loads(box.get(RUN_KEY))
    assert record["units"] == 4 and record["fingerprint"] == unit_fingerprint(units)
    assert record["fingerprint"].startswith("sha256:") and len(record["fingerprint"]) == 71
    assert unit_fingerprint(reversed(list(units))) == record["fingerprint"]  # order is no part
    assert unit_fingerprint(["ab", "c"]) != unit_fingerprint(["a", "bc"])


def _other_node(path: str, units: dict[str, int], results) -> None:
    try:
        with shared_queue(units, mailbox=LocalMailbox(path), learner_id="node-1", load=_load, workers=0) as batches:
            results.put(("batches", len(list(batches))))
    except GradientMailError as exc:
        results.put((type(exc).__name__, str(exc)))


def _run_other_node(path, units) -> tuple[str, object]:
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    process = context.Process(target=_other_node, args=(str(path), units, results))
    process.start()
    try:
        return results.get(timeout=60)
    finally:
        process.join(timeout=30)
        if process.is_alive():
            process.kill()
            process.join()


@pytest.mark.timeout(120)
def test_another_unit_set_in_a_used_prefix_is_refused_in_another_process(tmp_path):
    box = LocalMailbox(tmp_path / "run")
    assert len(_drain(box, _units(4), "node-0", workers=0)) == 8
    claims_before = sorted(box.list(CLAIMS_PREFIX))

    kind, message = _run_other_node(box.path, _units(6))  # 4 of the same and 2 new ones
    assert kind == "RunMismatchError", message
    assert "another unit set (4 units" in message and "(6 units" in message
    assert "use a fresh prefix" in message
    assert sorted(box.list(CLAIMS_PREFIX)) == claims_before, "nothing was claimed"

    # The same units in another order are the same run: joining it is fine (and finds no work).
    assert _run_other_node(box.path, dict(reversed(list(_units(4).items())))) == ("batches", 0)


def test_a_run_record_without_a_fingerprint_is_still_joined(memory_mailbox):
    memory_mailbox.put_if_absent(RUN_KEY, json.dumps({"units": 3, "created": 1.7e9}).encode())
    assert len(_drain(memory_mailbox, _units(3), "node-0", workers=0)) == 6
    assert "fingerprint" not in json.loads(memory_mailbox.get(RUN_KEY)), "an old record is kept"


@pytest.mark.parametrize(
    "body, problem",
    [
        (b"[" * 5000 + b"]" * 5000, "nested deeper than"),
        (b'{"units": 3, "fingerprint": "md5:0"}', "'fingerprint' 'md5:0' is not"),
        (b"not json", "not JSON"),
    ],
    ids=["nested", "bad fingerprint", "not json"],
)
def test_a_prefix_holding_no_run_record_is_refused(memory_mailbox, body, problem):
    memory_mailbox.put_if_absent(RUN_KEY, body)
    with pytest.raises(RunMismatchError, match="fresh prefix") as caught:
        prepare_mailbox(memory_mailbox, 3, _units(3))
    assert problem in str(caught.value) and "run.json" in str(caught.value)
    dataset = SharedQueueDataset(_units(3), mailbox=memory_mailbox, learner_id="n", load=_load)
    with pytest.raises(RunMismatchError):
        list(dataset)
    assert list(memory_mailbox.list(CLAIMS_PREFIX)) == []


# -- joining a finished run ----------------------------------------------------------------------
@pytest.mark.parametrize("workers", [0, 1])
def test_joining_a_run_whose_every_unit_is_taken_warns_once(local_mailbox, workers):
    units = _units(3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert len(_drain(local_mailbox, units, "node-0", workers=workers)) == 6
    assert not [w for w in caught if "0 batches" in str(w.message)], "the first node got work"

    with pytest.warns(UserWarning, match=EMPTY_WARNING) as caught:
        assert _drain(local_mailbox, units, "node-1", workers=workers) == []
    empty = [w for w in caught if "0 batches" in str(w.message)]
    assert len(empty) == 1 and empty[0].filename == __file__  # points at the training loop


RESUMED_WARNING = (
    "0 batches for learner .* none of this learner's earlier units was left unfinished, and every unit "
    "of this run .* is done or held by a live node: nothing is left for this node"
)


def test_a_finished_elastic_run_warns_too_without_advising_a_fresh_prefix(memory_mailbox):
    """A node restarted with resume=True into a finished run is resuming, not
    starting over: "use a fresh prefix to train again" was the wrong advice."""
    units = _units(2)
    assert len(_drain(memory_mailbox, units, "node-0", workers=0, resume=True)) == 4
    for learner in ("node-1", "node-0"):  # a newcomer, and the same learner restarted
        with pytest.warns(UserWarning, match=RESUMED_WARNING) as caught:
            assert _drain(memory_mailbox, units, learner, workers=0, resume=True) == []
        assert not [w for w in caught if "fresh prefix" in str(w.message)]


# -- without ``with`` ----------------------------------------------------------------------------
def test_iterating_shared_queue_without_with_says_to_use_with(memory_mailbox):
    queue = shared_queue(_units(2), mailbox=memory_mailbox, learner_id="n", load=_load, workers=0)
    with pytest.raises(TypeError, match=r"with shared_queue\(\.\.\.\) as batches:"):
        for _ in queue:
            pass
    with pytest.raises(TypeError, match="context manager, not an iterable"):
        next(queue)
    assert list(memory_mailbox.list("")) == [], "nothing ran"
    with queue as batches:  # the same object still works as documented
        assert len(list(batches)) == 4
