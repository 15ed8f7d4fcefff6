"""Batches per second of ``shared_queue`` on ``S3Mailbox`` over real HTTP with 20 ms per request.

The end-to-end row of ``benchmarks.throughput``: the same units, loader, batch sizes, prefetch
and single worker (imported from it), but the mailbox is an ``S3Mailbox`` talking to moto's S3
server on 127.0.0.1 through a proxy that holds every request 20 ms (``benchmarks.latency_proxy``;
botocore's connection pool keeps connections open, as against a real region). The store runs
in a process of its own (``benchmarks.s3_endpoint``) but shares this machine's cores. The
baseline is the plain DataLoader of ``benchmarks.throughput``; each repeat runs the two back to
back in a rotated order, and a ratio is the median over repeats of shared / baseline within a
repeat (small batches in every other repeat: see ``SPARSE``). Each shared-queue run gets a fresh
prefix in one bucket.

- ``ratio_s3_20ms``: the worse of small (16x128 int64) and large (256x2048 int64) batches;
  target >= 0.95 (as ``ratio_latency_20ms``).

The table also shows what bounds the ratio: the requests and the seconds in mailbox requests
per claimed unit (measured where the requests run, in the loader); the claims in flight that
would hide that time behind loading (``DepthGauge.target``: ceil(claim / unit load) + 1), the
same at the idle time of a request (measured before the runs), and the most that
``claim_ahead`` allows (``TIED_S`` / unit load, at most ``DEFAULT_CLAIM_AHEAD``); and the
store's CPU milliseconds per claimed unit (moto and the proxy, taken from the same cores as
the loader).

Usage: ``python -m benchmarks.s3_latency [--quick] [--repeats N] [--seconds S] [--latency-ms MS]``;
the last line is one JSON object.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from benchmarks._common import emit, median, parser, table, verdicts
from benchmarks.s3_endpoint import S3Endpoint
from benchmarks.throughput import (
    PREFETCH,
    SIZES,
    UNIT_STEPS,
    UNITS,
    Run,
    measure_shared,
    run_baseline,
)
from gradientmail import Unit, unit_grid
from gradientmail.mailbox.s3 import S3Mailbox
from gradientmail.queue.claim_ahead import DEFAULT_CLAIM_AHEAD, TIED_S

SPARSE = {"small"}
"""Sizes run in every other repeat only: small batches reach 3x the baseline's rate (the hand-over
thread beats DataLoader's per-batch hand-over; ``benchmarks.throughput``), so large batches bound
the headline, and the run stays within the budget of ``python -m benchmarks``."""
LATENCY_MS = 20
"""Held per request by the proxy; ``--latency-ms 0`` shows what S3 costs without latency (the
figures are then named ``ratio_s3_0ms`` and so on, and have no target)."""


@dataclass
class S3Run:
    run: Run
    store_cpu_per_request_s: float
    store_requests: int


def idle_request_s(endpoint: S3Endpoint, count: int = 10) -> float:
    """Median seconds of one request (a ``get`` of a missing key) with nothing else running:
    the proxy's latency plus the store's and the client's own time, the floor of a request."""
    mailbox = S3Mailbox(endpoint.bucket, "idle", endpoint_url=endpoint.url)
    mailbox.get("warm-up")  # the client and its connection
    times = []
    for index in range(count):
        start = time.perf_counter()
        mailbox.get(f"missing-{index}")
        times.append(time.perf_counter() - start)
    return median(times)


def run_shared_s3(
    units: dict[str, Unit], shape: tuple[int, int], endpoint: S3Endpoint, prefix: str, seconds: float
) -> S3Run:
    """One shared-queue run on a fresh prefix; the rate as ``throughput.run_shared`` measures it."""
    inner = S3Mailbox(endpoint.bucket, prefix, endpoint_url=endpoint.url)
    run, (before, after) = measure_shared(units, shape, inner, seconds, around=endpoint.usage)
    (cpu_before, requests_before), (cpu_after, requests_after) = before, after
    requests = requests_after - requests_before
    return S3Run(run, (cpu_after - cpu_before) / max(1, requests), requests)


@dataclass
class Pair:
    size: str
    baseline: list[Run] = field(default_factory=list)
    shared: list[S3Run] = field(default_factory=list)

    def ratios(self) -> list[float]:
        return [s.run.rate / b.rate for s, b in zip(self.shared, self.baseline, strict=True)]


def main(argv: list[str] | None = None) -> dict[str, float]:
    options = parser(__doc__)
    options.add_argument(
        "--repeats", type=int, default=None, help="pairs of runs per size (default 6, quick 1; small: every other)"
    )
    options.add_argument(
        "--latency-ms", type=int, default=LATENCY_MS, help=f"ms held per request (default {LATENCY_MS})"
    )
    options.add_argument("--seconds", type=float, default=None, help="seconds per run (default 0.8, quick 0.2)")
    args = options.parse_args(argv)
    repeats = args.repeats or (1 if args.quick else 6)
    seconds = args.seconds or (0.2 if args.quick else 0.8)
    torch.set_num_threads(1)
    units = unit_grid(steps=UNITS * UNIT_STEPS, unit_steps=UNIT_STEPS, lanes=1)
    pairs = {size: Pair(size) for size in SIZES}
    start = time.perf_counter()
    name = f"s3_{args.latency_ms}ms"
    with S3Endpoint(args.latency_ms / 1e3) as endpoint:
        started = time.perf_counter() - start
        idle = idle_request_s(endpoint)
        for repeat in range(repeats):
            for size, pair in pairs.items():
                if size in SPARSE and repeat % 2:
                    continue
                shape = SIZES[size]
                baseline_first = len(pair.baseline) % 2 == 0  # rotate who goes first
                if baseline_first:
                    pair.baseline.append(run_baseline(units, shape, seconds))
                pair.shared.append(run_shared_s3(units, shape, endpoint, f"run-{size}-{repeat}", seconds))
                if not baseline_first:
                    pair.baseline.append(run_baseline(units, shape, seconds))
    wall = time.perf_counter() - start

    print(
        f"Throughput on S3 (moto over HTTP, {args.latency_ms} ms per request): batches/s, median of "
        f"{repeats} paired runs of ~{seconds:g}s (small: every other), units of {UNIT_STEPS} batches, prefetch {PREFETCH}, "
        f"1 worker{' (quick)' if args.quick else ''}"
    )
    rows = []
    figures: dict[str, float] = {}
    for size, pair in pairs.items():
        ratios = pair.ratios()
        ratio = median(ratios)
        base_rate = median(run.rate for run in pair.baseline)
        shared_rate = median(s.run.rate for s in pair.shared)
        unit_load = UNIT_STEPS / base_rate
        wait = median(s.run.mailbox_wait_per_unit_s for s in pair.shared)
        requests = median(s.run.requests_per_unit for s in pair.shared)
        store_cpu = median(s.store_cpu_per_request_s for s in pair.shared)
        needed = math.ceil(wait / unit_load) + 1
        floor = math.ceil(requests * idle / unit_load) + 1
        allowed = min(DEFAULT_CLAIM_AHEAD, max(1, int(TIED_S / unit_load)))
        rows.append(
            [
                size,
                f"{base_rate:.1f}",
                f"{shared_rate:.1f}",
                f"{ratio:.3f}",
                f"{min(ratios):.3f}-{max(ratios):.3f}",
                f"{requests:.2f}",
                f"{wait * 1e3:.1f}",
                f"{unit_load * 1e3:.1f}",
                f"{floor} / {needed} / {allowed}",
                f"{store_cpu * requests * 1e3:.1f}",
                f"{median(s.run.first_batch_s for s in pair.shared) * 1e3:.0f}",
            ]
        )
        figures[f"ratio_{name}_{size}"] = ratio
        figures[f"ratio_{name}_{size}_min"] = min(ratios)
        figures[f"ratio_{name}_{size}_max"] = max(ratios)
        figures[f"batches_per_s_{size}_baseline"] = base_rate
        figures[f"batches_per_s_{size}_{name}"] = shared_rate
        figures[f"mailbox_ms_per_unit_{size}"] = wait * 1e3
        figures[f"requests_per_unit_{size}"] = requests
        figures[f"store_cpu_ms_per_request_{size}"] = store_cpu * 1e3
        figures[f"claims_in_flight_needed_{size}"] = needed
    figures["idle_request_ms"] = idle * 1e3
    print(
        table(
            [
                "batches",
                "DataLoader b/s",
                "S3 b/s",
                "ratio",
                "min-max",
                "requests/unit",
                "mailbox ms/unit",
                "unit load ms",
                "in flight idle / needed / allowed",
                "store CPU ms/unit",
                "first batch ms",
            ],
            rows,
        )
    )
    print(
        "needed = ceil(mailbox time per unit / unit load) + 1 claims in flight (DepthGauge.target); "
        f"idle = the same with every request at its idle time ({idle * 1e3:.1f} ms: {args.latency_ms} ms "
        f"held + the store's and client's own time); allowed = min(claim_ahead {DEFAULT_CLAIM_AHEAD}, "
        f"TIED_S {TIED_S:g} s / unit load). Store CPU: moto and the proxy, on this machine's cores. "
        f"Store start-up {started:.1f}s; {wall:.0f}s in all."
    )
    headline = {f"ratio_{name}": min(figures[f"ratio_{name}_small"], figures[f"ratio_{name}_large"])}
    for line in verdicts(headline):
        print(line)
    emit({**headline, **figures})
    return {**headline, **figures}


if __name__ == "__main__":
    main()
