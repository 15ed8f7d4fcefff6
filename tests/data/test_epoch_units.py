"""``epochs``: several seeded passes as one mapping, the same on every node; ``permutation``."""

from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys
from collections import Counter

import pytest
import torch

from gradientmail import InvalidKeyError, MemoryMailbox, RunMismatchError
from gradientmail.data import EpochUnit, epochs, permutation
from gradientmail.layout import claim_key
from gradientmail.patterns.shared_queue import shared_queue
from gradientmail.queue.claims import validate_identifiers

UNITS = {f"shard-{i:03d}.parquet": i for i in range(40)}


def test_every_unit_once_per_epoch_epochs_in_order():
    run = epochs(UNITS, 3, seed=7)
    assert len(run) == 3 * len(UNITS)
    pairs = Counter((item.epoch, item.identifier) for item in run.values())
    assert set(pairs) == {(e, ident) for e in range(3) for ident in UNITS} and set(pairs.values()) == {1}
    assert all(item.unit == UNITS[item.identifier] and item.seed == 7 for item in run.values())
    assert [item.epoch for item in run.values()] == sorted(item.epoch for item in run.values())
    assert all(
        key.startswith(f"e{item.epoch:04d}/") and key.endswith(f"-{item.identifier}") for key, item in run.items()
    )


def test_keys_sort_in_the_mappings_order():
    """The claimer lists claims in key order; a shuffled order under plain keys costs it about
    twice the requests per claim, so the keys carry each unit's place in its pass."""
    for shuffle in (True, False):
        run = epochs(UNITS, 2, seed=1, shuffle=shuffle)
        keys = [claim_key(key) for key in run]
        assert keys == sorted(keys)
    wide = epochs({f"u{i}": i for i in range(12_345)}, 2)  # five digits of position
    assert list(wide) == sorted(wide) and all(re.fullmatch(r"e000[01]/\d{5}-u\d+", key) for key in wide)


def test_each_pass_has_its_own_order_and_the_seed_chooses_them():
    orders = [[item.identifier for item in epochs(UNITS, 3, seed=seed).values()] for seed in (0, 1)]
    for order in orders:
        passes = [order[e * len(UNITS) : (e + 1) * len(UNITS)] for e in range(3)]
        assert len({tuple(p) for p in passes}) == 3, "every pass in its own order"
        assert all(p != list(UNITS) for p in passes), "shuffled"
    assert orders[0] != orders[1]
    assert [item.identifier for item in epochs(UNITS, 2, shuffle=False).values()] == [*UNITS, *UNITS]


def test_the_order_does_not_depend_on_how_the_units_came_in():
    """Nodes that listed a bucket in different orders still agree."""
    backwards = dict(reversed(list(UNITS.items())))
    assert list(epochs(backwards, 2, seed=3)) == list(epochs(UNITS, 2, seed=3))


SCRIPT = """
import json, sys
from gradientmail.data import epochs, permutation
run = epochs({f"u{i}": i for i in range(50)}, 2, seed=11)
print(json.dumps([list(run), permutation(20, seed=11, epoch=1, key="u3")]))
"""


def test_identical_in_processes_with_other_hash_seeds():
    outputs = []
    for hash_seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        result = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, check=True)
        outputs.append(json.loads(result.stdout))
    here = epochs({f"u{i}": i for i in range(50)}, 2, seed=11)
    assert outputs[0] == outputs[1] == [list(here), permutation(20, seed=11, epoch=1, key="u3")]


def test_keys_are_valid_unit_identifiers_even_for_nested_names():
    nested = {"train/a.parquet": 0, "train/a.parquet/x": 1, "b": 2}  # a folder of another: not as units
    with pytest.raises(InvalidKeyError):
        validate_identifiers(nested)
    run = epochs(nested, 2)
    assert validate_identifiers(run) == list(run)


@pytest.mark.parametrize(
    ("units", "n", "seed", "error", "match"),
    [
        (UNITS, 0, 0, ValueError, "n must be an int >= 1"),
        (UNITS, True, 0, ValueError, "n must be an int >= 1"),
        (UNITS, 2, -1, ValueError, "seed must be an int >= 0"),
        (UNITS, 2, 1.5, ValueError, "seed must be an int >= 0"),
        ({}, 2, 0, ValueError, "at least one unit"),
        ({"ok": 0, "bad/.hidden": 1}, 2, 0, InvalidKeyError, "unit 'bad/.hidden'"),
        ({3: 0}, 2, 0, InvalidKeyError, "must be str"),
    ],
)
def test_bad_arguments_are_refused(units, n, seed, error, match):
    with pytest.raises(error, match=match):
        epochs(units, n, seed=seed)


def test_permutation_is_a_seeded_shuffle_of_the_rows():
    first = permutation(1000, seed=0, epoch=0, key="a")
    assert sorted(first) == list(range(1000)) and first != list(range(1000))
    assert first == permutation(1000, seed=0, epoch=0, key="a")
    others = [
        permutation(1000, seed=0, epoch=1, key="a"),
        permutation(1000, seed=0, key="b"),
        permutation(1000, seed=1),
    ]
    assert all(other != first for other in others)
    assert permutation(0, seed=0) == [] and permutation(1, seed=0) == [0]
    # Pinned: a change here reorders every run's rows (nodes on two versions would disagree).
    assert permutation(8, seed=0, epoch=0, key="a") == [4, 7, 1, 0, 2, 6, 5, 3]
    item = epochs({"a": 0}, 1, seed=0)["e0000/0000-a"]
    assert item.permutation(1000) == first


def test_an_epoch_unit_pickles_for_dataloader_workers():
    item = EpochUnit(1, "shard.parquet", {"rows": 10}, 5)
    assert pickle.loads(pickle.dumps(item)) == item


def load(item: EpochUnit[int]):
    yield item.epoch * 100 + item.unit, torch.tensor([item.epoch, item.unit])


def test_two_epochs_are_one_run_of_the_queue():
    box = MemoryMailbox("epochs-one-run")
    box.clear()
    run = epochs({f"{i:02d}": i for i in range(6)}, 2, seed=0)
    with shared_queue(run, mailbox=box, learner_id="n0", load=load, workers=0) as batches:
        seen = [tuple(batch.tolist()) for _, batch in batches]
    assert sorted(seen) == sorted((e, i) for e in range(2) for i in range(6))
    assert seen[:6] == [(0, item.unit) for item in list(run.values())[:6]], "one node claims in the mapping's order"


def test_a_run_stopped_mid_epoch_continues_with_the_same_seed_and_refuses_another():
    box = MemoryMailbox("epochs-resume")
    box.clear()
    run = epochs({f"{i:02d}": i for i in range(6)}, 2, seed=0)
    seen = []
    with shared_queue(run, mailbox=box, learner_id="n0", load=load, workers=0) as batches:
        for _, batch in batches:
            seen.append(tuple(batch.tolist()))
            if len(seen) == 8:  # two units into the second epoch
                break
    with pytest.raises(RunMismatchError):
        with shared_queue(epochs({f"{i:02d}": i for i in range(6)}, 2, seed=1), mailbox=box, load=load, workers=0):
            pass
    with shared_queue(run, mailbox=box, learner_id="n0", load=load, workers=0) as batches:
        seen += [tuple(batch.tolist()) for _, batch in batches]
    assert sorted(seen) == sorted((e, i) for e in range(2) for i in range(6))
