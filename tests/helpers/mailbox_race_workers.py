"""Worker functions of test_races, in a module that spawned processes import quickly.

Spawned processes import the module that holds their target; importing this one costs
milliseconds, importing a test module (and with it pytest) costs a second per process.
"""

from __future__ import annotations

import hashlib
from typing import Any

from gradientmail import LocalMailbox

WRITERS = 8
READERS = 2
KEYS = [f"units/{i:06d}-{i % 4}.json" for i in range(200)]
VALUE_BYTES = 16 * 1024  # four pages: a torn write would show


def open_target(target: Any) -> Any:
    """A directory path opens a LocalMailbox; anything else is a (pickled) mailbox already."""
    return LocalMailbox(target, create=False) if isinstance(target, str) else target


def make_value(key: str, writer: int) -> bytes:
    payload = (f"{key}:{writer}:".encode() * (VALUE_BYTES // 16))[:VALUE_BYTES]
    return f"{writer}:{hashlib.sha256(payload).hexdigest()}\n".encode() + payload


def check_value(key: str, value: bytes) -> int:
    """The writer that made ``value``; AssertionError when it is not a whole value of ``key``."""
    header, newline, payload = value.partition(b"\n")
    assert newline, f"{key}: partial value of {len(value)} bytes"
    writer, _, digest = header.decode().partition(":")
    assert len(payload) == VALUE_BYTES, f"{key}: {len(payload)} of {VALUE_BYTES} bytes"
    assert hashlib.sha256(payload).hexdigest() == digest, f"{key}: corrupt value"
    assert payload.startswith(f"{key}:{writer}:".encode()), f"{key}: value of another key"
    return int(writer)


def writer_process(root: Any, writer: int, barrier, results, keys: list[str] = KEYS) -> None:
    mailbox = open_target(root)
    barrier.wait(timeout=60)
    won = [key for key in keys if mailbox.put_if_absent(key, make_value(key, writer))]
    results.put(("writer", writer, won))


def reader_process(root: Any, reader: int, barrier, done, results, keys: list[str] = KEYS) -> None:
    mailbox = open_target(root)
    barrier.wait(timeout=60)
    seen, problems = 0, []
    while True:
        finished = done.is_set()  # one full pass after the writers are done, then stop
        for key in keys:
            value = mailbox.get(key)
            if value is None:
                continue
            try:
                check_value(key, value)
                seen += 1
            except (AssertionError, ValueError) as exc:
                problems.append(str(exc))
        if finished:
            break
    results.put(("reader", reader, (seen, problems[:5], len(problems))))


def use_in_worker(mailbox) -> bytes | None:
    return mailbox.get("k")


def replace_if_process(root: Any, value: str, writer: int, version: str, barrier, results) -> None:
    """One of several processes trying ``replace_if`` on ``cas/key`` with the same version.

    ``value`` must be new to the key: versions name values, so writing back an old value would
    make an old version current again (the ABA case that claims avoid with fresh tokens).
    """
    mailbox = open_target(root)
    mailbox.get_versioned("cas/key")  # connect first: the race is the replace, not start-up
    barrier.wait(timeout=60)
    won = mailbox.replace_if("cas/key", value.encode(), version)
    results.put((writer, won))
