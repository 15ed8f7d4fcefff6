"""An object store on a virtual clock: latency, bandwidth per stream and request limits per prefix.

Every request of a learner (through its ``SimulatedMailbox``) suspends the calling task on the
``VirtualClock``: it reaches the store half a latency (plus its upload) after it is sent, waits
there while its prefix is at its request limit, is applied to one shared ``MemoryMailbox`` at
that moment (so a listing and a create of different learners race as they would on the store),
and is answered half a latency (plus its download) later. A listing costs one round trip per
page of ``LIST_PAGE`` keys; its keys are taken at the first page.

Bytes are billed as the store would carry them for a larger model: the tensors of safetensors
bodies (the fragments' versions and pending contributions) count ``body_scale`` times their real
size; their headers and every other record count their real size. A request over its prefix's
limit waits for its turn (S3 answers ``503 SlowDown`` instead, which the S3 mailbox retries
after a back-off: waiting in line is the better case, so the figures are a lower bound there).
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from benchmarks._virtual_clock import VirtualClock
from gradientmail.errors import ValueTooLargeError
from gradientmail.mailbox.base import LIST_PAGE, Mailbox
from gradientmail.mailbox.wrappers import MailboxWrapper
from gradientmail.records import MAX_RECORD_BYTES

T = TypeVar("T")

READ, WRITE = "read", "write"


@dataclass(frozen=True)
class StoreModel:
    """What a request costs on the simulated store.

    Attributes:
        latency_s: one round trip (half to reach the store, half to come back).
        bandwidth_bytes_s: one request's stream, each way.
        reads_per_s: requests that read (get, list) one prefix serves per second (None: no limit).
        writes_per_s: requests that write (put, create, delete), the same.
        body_scale: billed bytes per real byte of a tensor body (modelled model / real model).
        latency_spread: each request's round trip is ``latency_s`` times a factor drawn from
            ``1 ± latency_spread`` (a store's latencies vary; without it, learners on a perfectly
            regular clock can fall into a schedule where they never meet, which no real run keeps).
        seed: the random seed of those draws.
    """

    latency_s: float = 0.020
    bandwidth_bytes_s: float = 100e6
    reads_per_s: float | None = 5500.0
    writes_per_s: float | None = 3500.0
    body_scale: float = 1.0
    latency_spread: float = 0.5
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.latency_spread <= 1:
            raise ValueError(f"latency_spread must be in [0, 1], not {self.latency_spread}")
        if self.latency_s < 0 or self.bandwidth_bytes_s <= 0 or self.body_scale <= 0:
            raise ValueError(f"a store model needs latency >= 0, bandwidth > 0 and body_scale > 0: {self}")
        for limit in (self.reads_per_s, self.writes_per_s):
            if limit is not None and limit <= 0:
                raise ValueError(f"a request limit must be None or > 0, not {limit}")

    def billed(self, data: bytes | None) -> float:
        """The bytes ``data`` stands for: a safetensors body's tensors times ``body_scale``."""
        if data is None:
            return 0.0
        if len(data) >= 9 and data[8:9] == b"{":
            header = 8 + int.from_bytes(data[:8], "little")
            if header <= len(data):
                return header + (len(data) - header) * self.body_scale
        return float(len(data))


def prefix_of(key: str) -> str:
    """The prefix a key's requests count against: its folder (``session/fragments/3/pending``)."""
    return key.rsplit("/", 1)[0] if "/" in key else ""


class SimulatedStore:
    """The shared store: a ``MemoryMailbox`` behind the model's costs and per-prefix limits.

    ``per_second[(prefix, kind, second)]`` counts the requests of that kind that reached one
    prefix within each whole second of virtual time (``peak`` finds the busiest).
    """

    def __init__(self, inner: Mailbox, clock: VirtualClock, model: StoreModel) -> None:
        self.inner = inner
        self.clock = clock
        self.model = model
        self.requests: Counter[str] = Counter()
        self.per_second: Counter[tuple[str, str, int]] = Counter()
        self.waited_s = 0.0  # time requests spent queued behind a prefix's limit
        self._draws = random.Random(model.seed)
        self._free: dict[tuple[str, str], float] = {}  # when the prefix takes its next request

    def request(self, key: str, kind: str, sent: float, apply: Callable[[], T], answer: Callable[[T], float]) -> T:
        """Send a request on the virtual clock: ``sent`` bytes up, ``apply`` at the store, then
        ``answer(result)`` bytes back."""
        model, clock = self.model, self.clock
        half = model.latency_s / 2 * (1 + model.latency_spread * self._draws.uniform(-1, 1))
        clock.sleep_until(clock.now + half + sent / model.bandwidth_bytes_s)
        arrives = self._admit(prefix_of(key), kind, clock.now)  # in the order requests reach the store
        if arrives > clock.now:  # queued behind the prefix's limit
            clock.sleep_until(arrives)
        self.requests[kind] += 1
        try:
            result = apply()
        except Exception:
            clock.sleep_until(arrives + half)
            raise
        clock.sleep_until(arrives + half + answer(result) / model.bandwidth_bytes_s)
        return result

    def _admit(self, prefix: str, kind: str, arrives: float) -> float:
        limit = self.model.reads_per_s if kind == READ else self.model.writes_per_s
        slot = (prefix, kind)
        if limit is not None:
            turn = max(arrives, self._free.get(slot, 0.0))
            self._free[slot] = turn + 1.0 / limit
            self.waited_s += turn - arrives
            arrives = turn
        self.per_second[(prefix, kind, math.floor(arrives))] += 1
        return arrives

    def peak(self, kind: str, since: float = -math.inf, until: float = math.inf) -> tuple[str, int]:
        """The busiest prefix for ``kind`` and its requests in its busiest whole second within
        ``[since, until)``."""
        best = max(
            ((n, p) for (p, k, second), n in self.per_second.items() if k == kind and since <= second < until),
            default=(0, ""),
        )
        return best[1], best[0]


class SimulatedMailbox(MailboxWrapper):
    """One learner's view of the ``SimulatedStore``, counting its requests and billed bytes as
    ``benchmarks.session_scale.PacedMailbox`` counts them (a listing's keys are not bytes read)."""

    def __init__(self, store: SimulatedStore) -> None:
        super().__init__(store.inner)
        self.store = store
        self.requests = 0
        self.bytes_read = 0.0
        self.bytes_written = 0.0

    def counters(self) -> tuple[int, float, float]:
        """``(requests, bytes_read, bytes_written)`` so far."""
        return self.requests, self.bytes_read, self.bytes_written

    def _send(self, key: str, kind: str, up: bytes | None, apply: Callable[[], T], down: Callable[[T], Any]) -> T:
        billed_up = self.store.model.billed(up)
        self.requests += 1
        self.bytes_written += billed_up

        def answer(result: T) -> float:
            billed = self.store.model.billed(down(result))
            self.bytes_read += billed
            return billed

        return self.store.request(key, kind, billed_up, apply, answer)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        return self._send(key, WRITE, data, lambda: self.inner.put_if_absent(key, data), lambda _: None)

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes | None:
        if max_bytes is None:
            return self._send(key, READ, None, lambda: self.inner.get(key), lambda data: data)
        # As the S3 mailbox reads it: one GET of the first ``max_bytes + 1`` bytes, refused when the
        # object (at its modelled size) is larger, having carried only those bytes. A bound of at
        # most a record's size is a record's bound (``min(len(data), MAX_RECORD_BYTES)``, reckoned
        # by the caller on the real bytes): in the modelled run it is the modelled body's, capped
        # at a record's size.
        data = self._send(key, READ, None, lambda: self.inner.get(key, max_bytes=max_bytes), lambda _: None)
        billed = self.store.model.billed(data)
        if max_bytes <= MAX_RECORD_BYTES:
            max_bytes = min(int(max_bytes * self.store.model.body_scale), MAX_RECORD_BYTES)
        carried = min(billed, max_bytes + 1)
        self.bytes_read += carried
        self.store.clock.sleep_until(self.store.clock.now + carried / self.store.model.bandwidth_bytes_s)
        if data is not None and billed > max_bytes:
            raise ValueTooLargeError(key, max_bytes, int(billed))
        return data

    def put(self, key: str, data: bytes) -> None:
        self._send(key, WRITE, data, lambda: self.inner.put(key, data), lambda _: None)

    def delete(self, key: str) -> None:
        self._send(key, WRITE, None, lambda: self.inner.delete(key), lambda _: None)

    def get_versioned(self, key: str, *, max_bytes: int | None = None) -> tuple[bytes, str] | None:
        inner = self._versioned()
        return self._send(
            key,
            READ,
            None,
            lambda: inner.get_versioned(key, max_bytes=max_bytes),
            lambda found: None if found is None else found[0],
        )

    def replace_if(self, key: str, data: bytes, version: str) -> bool:
        inner = self._versioned()
        return self._send(key, WRITE, data, lambda: inner.replace_if(key, data, version), lambda _: None)

    def list(self, prefix: str = "", start_after: str | None = None) -> Iterator[str]:
        keys = self._send(prefix + "-", READ, None, lambda: list(self.inner.list(prefix, start_after)), lambda _: None)
        for _ in range(1, math.ceil(len(keys) / LIST_PAGE)):  # each further page: one more round trip
            self._send(prefix + "-", READ, None, lambda: None, lambda _: None)
        return iter(keys)
