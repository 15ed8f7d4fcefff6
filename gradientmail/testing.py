"""The mailbox conformance suite: every backend behaves the same through the five primitives.

Shipped in the package so that a backend written outside this repository joins the same suite
(it needs pytest): subclass ``MailboxConformance`` in a test module, set ``backend``, and give it
a ``mailbox_factory`` fixture returning ``factory(backend, run="run")`` (the same ``run`` opens
the same store, another ``run`` an isolated one). The hooks below say what differs by backend
(a faster way to fill many keys, counting list requests, storing a huge value and measuring what
reading it costs, a store's known deviations); the repository's own backends join in
``tests/mailbox/test_conformance.py``.

Example (a test module)::

    import pytest
    from gradientmail.testing import MailboxConformance

    class TestMyMailbox(MailboxConformance):
        backend = "mine"

        @pytest.fixture
        def mailbox_factory(self, tmp_path):
            return lambda backend, run="run": MyMailbox(tmp_path / run)
"""

from __future__ import annotations

import os
import pickle
import tracemalloc
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, ClassVar

import pytest

from gradientmail.errors import GradientMailError, InvalidKeyError, ValueTooLargeError
from gradientmail.mailbox.base import supports_replace_if, verify_mailbox
from gradientmail.mailbox.keys import MAX_KEY_BYTES
from gradientmail.mailbox.url import open_mailbox

__all__ = ["BAD_KEYS", "BOUND", "KEYS", "LARGE_VALUE_BYTES", "MailboxConformance", "READ_COST_LIMIT", "SPARSE_BYTES"]

# Valid on every backend, including a directory (no key is also a "directory" of another key).
KEYS = ["b", "a-b", "a/b", "a/c/d", "a0", "Z", "a.b", "a_b", "é/x", "units/000003-1.json"]

BAD_KEYS = [
    "",
    ".",
    "..",
    "a/../b",
    "a/./b",
    "../escape",
    "/abs",
    "a//b",
    "a/",
    "//",
    ".hidden",
    "a\x00b",
    "a\nb",
    "a\x7fb",
    "a\\b",
    "x" * (MAX_KEY_BYTES + 1),
    5,
    None,
    b"bytes",
]


BOUND = 4096
"""The ``max_bytes`` the bounded-read tests read with."""

LARGE_VALUE_BYTES = 8 * 2**20
"""Size of the large value ``plant_large_value`` writes by default (one ``put``)."""

SPARSE_BYTES = 2**30
"""Size of the sparse file it plants in a mailbox directory instead: no disk, no memory to write."""

READ_COST_LIMIT = 2**20
"""Most that refusing a large value may cost (``read_meter``): far below ``LARGE_VALUE_BYTES``."""


def _fill(mailbox, keys, value=lambda key: key.encode()) -> None:
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda key: mailbox.put(key, value(key)), keys))


class MailboxConformance:
    """The suite; a subclass sets ``backend`` and provides the ``mailbox_factory`` fixture."""

    backend: ClassVar[str]
    known_deviations: ClassVar[dict[str, str]] = {}
    """Test name -> why this store fails it (marked ``xfail(strict=True)``: it passes if the store changes)."""
    empty_create_refused: ClassVar[bool] = False
    """The backend refuses to create an empty value (s3fs, whose empty create is not conditional)."""

    def fill_many(self, mailbox: Any, keys: Iterable[str]) -> None:
        """Create ``keys`` (value ``b"v"``); a subclass may fill its store faster."""
        _fill(mailbox, list(keys), value=lambda key: b"v")

    def count_list_requests(self, mailbox: Any) -> list[int] | None:
        """A list that grows by one per list request the mailbox makes from now, or None."""
        return None

    def directory_of(self, mailbox: Any) -> Path | None:
        """The local directory holding the mailbox, if any (checked for stray temporary files)."""
        return None

    def plant_large_value(self, mailbox: Any, key: str) -> int:
        """Store a value far larger than ``BOUND`` under ``key``; returns its size.

        In a mailbox directory (``directory_of``), a sparse file of ``SPARSE_BYTES`` made with
        ``truncate``, as a stray file would lie there; elsewhere a ``put`` of ``LARGE_VALUE_BYTES``.
        """
        directory = self.directory_of(mailbox)
        if directory is None:
            mailbox.put(key, bytes(LARGE_VALUE_BYTES))
            return LARGE_VALUE_BYTES
        path = Path(directory, key)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as file:
            os.truncate(file.fileno(), SPARSE_BYTES)
        return SPARSE_BYTES

    @pytest.fixture
    def read_meter(self) -> Iterator[Callable[[Any], Callable[[], int]]]:
        """``read_meter(mailbox)`` starts measuring reads of ``mailbox``; the function it returns
        gives their cost in bytes so far. By default the peak of the memory this process
        allocated (``tracemalloc``); a store whose server runs in this process counts the bytes
        its answers carried instead."""
        started = False

        def meter(mailbox: Any) -> Callable[[], int]:
            nonlocal started
            if not started:
                tracemalloc.start()
                started = True
            tracemalloc.reset_peak()
            floor = tracemalloc.get_traced_memory()[0]
            return lambda: tracemalloc.get_traced_memory()[1] - floor

        yield meter
        if started:
            tracemalloc.stop()

    @pytest.fixture
    def reopen_options(self) -> dict[str, Any]:
        """What ``open_mailbox(mailbox.url, **options)`` needs to open the same store again."""
        return {}

    @pytest.fixture(autouse=True)
    def _known_deviation(self, request: pytest.FixtureRequest) -> None:
        reason = self.known_deviations.get(request.function.__name__)
        if reason:
            request.applymarker(pytest.mark.xfail(strict=True, reason=reason))

    @pytest.fixture
    def mailbox_backend(self) -> str:
        return self.backend

    @pytest.fixture
    def any_mailbox(self, mailbox_backend: str, mailbox_factory: Any) -> Any:
        return mailbox_factory(mailbox_backend)

    def test_put_if_absent_creates_once(self, any_mailbox):
        assert any_mailbox.put_if_absent("units/1", b"first") is True
        assert any_mailbox.put_if_absent("units/1", b"second") is False
        assert any_mailbox.get("units/1") == b"first"

    def test_get_missing_is_none(self, any_mailbox):
        assert any_mailbox.get("missing") is None
        assert any_mailbox.get("no/such/dir") is None
        any_mailbox.put("a/b", b"x")
        assert any_mailbox.get("a/b/c") is None  # below an existing key

    def test_put_overwrites_and_blocks_create(self, any_mailbox):
        any_mailbox.put("progress/n.json", b"1")
        any_mailbox.put("progress/n.json", b"22")
        assert any_mailbox.get("progress/n.json") == b"22"
        assert any_mailbox.put_if_absent("progress/n.json", b"333") is False
        assert any_mailbox.get("progress/n.json") == b"22"

    def test_values_are_exact_bytes(self, any_mailbox):
        payload = bytes(range(256)) * 4
        assert any_mailbox.put_if_absent("bin", bytearray(payload))
        any_mailbox.put("view", memoryview(payload))
        assert any_mailbox.get("bin") == payload
        assert any_mailbox.get("view") == payload
        any_mailbox.put("empty", b"")
        assert any_mailbox.get("empty") == b""
        with pytest.raises(TypeError):
            any_mailbox.put_if_absent("text", "not bytes")
        with pytest.raises(TypeError):
            any_mailbox.put("text", "not bytes")
        assert any_mailbox.get("text") is None

    def test_empty_value_create(self, any_mailbox):
        if self.empty_create_refused:
            with pytest.raises(ValueError, match="touch"):
                any_mailbox.put_if_absent("empty", b"")
            assert any_mailbox.get("empty") is None
        else:
            assert any_mailbox.put_if_absent("empty", b"") is True
            assert any_mailbox.put_if_absent("empty", b"x") is False
            assert any_mailbox.get("empty") == b""

    def test_delete(self, any_mailbox):
        any_mailbox.put("a/b", b"x")
        any_mailbox.delete("a/b")
        assert any_mailbox.get("a/b") is None
        any_mailbox.delete("a/b")  # missing is fine
        any_mailbox.delete("never/there")
        assert any_mailbox.put_if_absent("a/b", b"y") is True
        assert any_mailbox.get("a/b") == b"y"
        assert list(any_mailbox.list()) == ["a/b"]

    def test_list_is_lexicographic(self, any_mailbox):
        _fill(any_mailbox, KEYS)
        assert list(any_mailbox.list()) == sorted(KEYS)
        # '-' (0x2d) sorts before '/' (0x2f): a flat sort of whole keys, not a directory walk.
        keys = list(any_mailbox.list("a"))
        assert keys == ["a-b", "a.b", "a/b", "a/c/d", "a0", "a_b"]

    def test_list_prefixes(self, any_mailbox):
        _fill(any_mailbox, KEYS)
        assert list(any_mailbox.list("a/")) == ["a/b", "a/c/d"]
        assert list(any_mailbox.list("a/c")) == ["a/c/d"]
        assert list(any_mailbox.list("a/c/")) == ["a/c/d"]
        assert list(any_mailbox.list("units/")) == ["units/000003-1.json"]
        assert list(any_mailbox.list("units/0000")) == ["units/000003-1.json"]
        assert list(any_mailbox.list("é/")) == ["é/x"]
        assert list(any_mailbox.list("zzz")) == []
        assert list(any_mailbox.list("nothing/here/")) == []

    def test_list_start_after(self, any_mailbox):
        _fill(any_mailbox, KEYS)
        ordered = sorted(KEYS)
        assert list(any_mailbox.list(start_after="a-b")) == ordered[ordered.index("a-b") + 1 :]
        assert list(any_mailbox.list(start_after="a/a")) == [k for k in ordered if k > "a/a"]
        assert list(any_mailbox.list("a/", start_after="a/b")) == ["a/c/d"]
        assert list(any_mailbox.list("a/", start_after="")) == ["a/b", "a/c/d"]
        assert list(any_mailbox.list("a/", start_after="0")) == ["a/b", "a/c/d"]  # before the prefix
        assert list(any_mailbox.list("a/", start_after="a/c/d")) == []
        assert list(any_mailbox.list(start_after="é/x")) == []
        assert list(any_mailbox.list(start_after="units/1")) == ["é/x"]

    def test_list_paginates_past_1000_keys(self, any_mailbox):
        keys = [f"page/{i:05d}" for i in range(1050)]
        self.fill_many(any_mailbox, keys + ["pagf", "pag"])
        assert any_mailbox.get("page/01049") == b"v"
        requests = self.count_list_requests(any_mailbox)
        assert list(any_mailbox.list("page/")) == keys
        assert list(any_mailbox.list("page/", start_after="page/00999")) == keys[1000:]
        assert list(any_mailbox.list(start_after="page/01049")) == ["pagf"]
        assert len(list(any_mailbox.list())) == 1052
        if requests is not None:  # pages of 1,000 keys: 2 + 1 + 1 + 2
            assert len(requests) == 6
        # Lazy: the first keys come without listing everything.
        listing = any_mailbox.list("page/")
        assert [next(listing) for _ in range(3)] == keys[:3]
        listing.close()
        if requests is not None:
            assert len(requests) == 7

    def test_run_prefixes_are_isolated(self, mailbox_backend, mailbox_factory):
        first = mailbox_factory(mailbox_backend, "run")
        second = mailbox_factory(mailbox_backend, "run-2")  # "run" is a string prefix of "run-2"
        assert first.put_if_absent("units/1", b"first")
        assert second.put_if_absent("units/1", b"second")
        second.put("units/2", b"only second")
        assert first.get("units/1") == b"first"
        assert second.get("units/1") == b"second"
        assert first.get("units/2") is None
        assert list(first.list()) == ["units/1"]
        assert list(second.list()) == ["units/1", "units/2"]
        first.delete("units/1")
        assert second.get("units/1") == b"second"
        same = mailbox_factory(mailbox_backend, "run-2")
        assert same.get("units/2") == b"only second"

    def test_pickle_round_trip(self, any_mailbox):
        any_mailbox.put("before", b"1")  # clients exist now and must not travel
        copy = pickle.loads(pickle.dumps(any_mailbox))
        assert type(copy) is type(any_mailbox)
        assert copy.url == any_mailbox.url
        assert copy.get("before") == b"1"
        assert copy.put_if_absent("after", b"2") is True
        assert any_mailbox.put_if_absent("after", b"3") is False
        assert any_mailbox.get("after") == b"2"
        assert list(copy.list()) == ["after", "before"]

    def test_bad_keys_are_refused_before_writing(self, any_mailbox):
        operations = [
            lambda key: any_mailbox.put_if_absent(key, b"x"),
            lambda key: any_mailbox.put(key, b"x"),
            any_mailbox.get,
            any_mailbox.delete,
        ]
        operations.append(lambda key: any_mailbox.get(key, max_bytes=BOUND))
        for key in BAD_KEYS:
            for operation in operations:
                with pytest.raises(InvalidKeyError) as caught:
                    operation(key)
                assert isinstance(caught.value, ValueError), key
        assert list(any_mailbox.list()) == []
        directory = self.directory_of(any_mailbox)
        if directory is not None:
            assert list(Path(directory).rglob("*")) == []  # no temp file either

    def test_get_refuses_a_value_over_the_bound_without_reading_it(self, any_mailbox, read_meter):
        key = "progress/stray.json"
        size = self.plant_large_value(any_mailbox, key)
        versioned = supports_replace_if(any_mailbox)
        reads: list[Callable[[], Any]] = [lambda: any_mailbox.get(key, max_bytes=BOUND)]
        if versioned:
            reads.append(lambda: any_mailbox.get_versioned(key, max_bytes=BOUND))
        for read in reads:
            cost = read_meter(any_mailbox)
            with pytest.raises(ValueTooLargeError) as caught:
                read()
            assert cost() < READ_COST_LIMIT, f"refusing a {size:,}-byte value cost {cost():,} bytes"
            refusal = caught.value
            assert isinstance(refusal, ValueError) and isinstance(refusal, GradientMailError)
            assert (refusal.key, refusal.limit) == (key, BOUND)
            assert refusal.size in (None, size)
            assert repr(key) in str(refusal) and f"{BOUND:,}" in str(refusal)
        assert list(any_mailbox.list("progress/")) == [key]  # refused, not removed

    def test_get_returns_a_value_at_the_bound(self, any_mailbox):
        value = bytes(range(256)) * 4
        any_mailbox.put("k", value)
        any_mailbox.put("empty", b"")
        any_mailbox.put("one", b"1")
        assert any_mailbox.get("k", max_bytes=len(value)) == value
        assert any_mailbox.get("k", max_bytes=2**40) == value
        assert any_mailbox.get("empty", max_bytes=0) == b""
        for key, bound in (("k", len(value) - 1), ("one", 0)):
            with pytest.raises(ValueTooLargeError) as caught:
                any_mailbox.get(key, max_bytes=bound)
            assert caught.value.size in (None, len(any_mailbox.get(key)))
        if supports_replace_if(any_mailbox):
            body, version = any_mailbox.get_versioned("k", max_bytes=len(value))
            assert (body, version) == any_mailbox.get_versioned("k")
            assert any_mailbox.get_versioned("empty", max_bytes=0) == any_mailbox.get_versioned("empty")
            with pytest.raises(ValueTooLargeError):
                any_mailbox.get_versioned("k", max_bytes=len(value) - 1)
            assert any_mailbox.replace_if("k", b"next", version)  # the bounded read's version swaps
            assert any_mailbox.get("k", max_bytes=4) == b"next"

    def test_bounded_get_of_a_missing_key_is_none(self, any_mailbox):
        any_mailbox.put("a/b", b"x" * 10)
        for key in ("missing", "no/such/dir", "a/b/c"):
            assert any_mailbox.get(key, max_bytes=BOUND) is None
            assert any_mailbox.get(key, max_bytes=0) is None
            if supports_replace_if(any_mailbox):
                assert any_mailbox.get_versioned(key, max_bytes=BOUND) is None

    def test_a_bound_is_a_count_of_bytes(self, any_mailbox):
        any_mailbox.put("k", b"v")
        for bound, error in ((-1, ValueError), ("10", TypeError), (True, TypeError), (1.5, TypeError)):
            with pytest.raises(error, match="max_bytes"):
                any_mailbox.get("k", max_bytes=bound)

    def test_bad_list_prefixes(self, any_mailbox):
        for prefix in ["/a", "a//", "..", "a/../", "\x00", ".tmp", 3]:
            with pytest.raises(InvalidKeyError):
                list(any_mailbox.list(prefix))

    def test_verify_passes(self, any_mailbox):
        any_mailbox.verify()
        verify_mailbox(any_mailbox)
        assert list(any_mailbox.list()) == []  # the probe cleans up after itself

    def test_open_mailbox_round_trips_url(self, any_mailbox, reopen_options):
        any_mailbox.put("k", b"v")
        reopened = open_mailbox(any_mailbox.url, **reopen_options)
        assert reopened.get("k") == b"v"
