"""Bad identifiers, learner ids, options, loaders and worker setups refused with an error that
names the problem."""

from __future__ import annotations

import multiprocessing
import threading

import pytest
import torch
from queue_loads import claimed_ids, load_item
from queue_nodes import named_units

from gradientmail import SharedQueueDataset, units_claimed_by
from gradientmail.errors import (
    InProcessMailboxError,
    InvalidKeyError,
    UnpicklableError,
    WrongProcessError,
)
from gradientmail.mailbox.wrappers import CountingMailbox
from gradientmail.patterns.shared_queue import shared_queue

pytestmark = pytest.mark.timeout(60)


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
    assert claimed_ids(local_mailbox) == []


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
