"""What claiming costs when units come shuffled in epochs or interleaved from several sources.

The claimer lists claims in the store's key order and walks its preference order; where the
two agree, one listing covers the next units. ``epochs`` shuffles each pass and ``mix``
interleaves sources, so both put each unit's place in its key (``e0000/0042-{id}``,
``0042-{source}/{id}``). This measures that choice on the virtual clock
(``gradientmail.sim.queue``: 16 real claimers at times per unit 1, 2, 2, 4 repeated, each
batch +-20 % jitter, requests counted as S3 bills them):

- ``epochs_requests_per_claim``: 2 shuffled epochs of 2,000 units, ``epochs``' keys;
  ``epochs_plain_keys_requests_per_claim``: the same order under ``e0000/{id}`` keys.
- ``mix_requests_per_claim``: a 90/10 mixture of 3,600 and 400 units, ``mix``'s keys;
  ``mix_plain_keys_requests_per_claim``: the same order under ``{source}/{id}`` keys.
- ``sorted_requests_per_claim``: 4,000 units in key order, for reference.

``--quick``: 400 units instead of 4,000.

Usage: ``python -m benchmarks.epochs [--quick]``; the last line is one JSON object.
"""

from __future__ import annotations

from typing import Any

from benchmarks._common import emit, parser, table
from gradientmail.data import epochs, mix
from gradientmail.sim.queue import simulate

TIMES = (1.0, 2.0, 2.0, 4.0) * 4
"""Time per unit of the 16 claimers."""


def orders(units: int) -> dict[str, dict[str, Any]]:
    """Each case's mapping: the library's keys, and the same order under plain keys."""
    grid = {f"{i:06d}": i for i in range(units)}
    half = {f"{i:06d}": i for i in range(units // 2)}
    run = epochs(half, 2, seed=0)
    web = {f"w{i:06d}": i for i in range(units * 9 // 10)}
    code = {f"c{i:06d}": i for i in range(units - len(web))}
    mixed = mix({"web": (web, 0.9), "code": (code, 0.1)})
    return {
        "sorted": grid,
        "epochs": run,
        "epochs_plain_keys": {f"e{item.epoch:04d}/{item.identifier}": item for item in run.values()},
        "mix": mixed,
        "mix_plain_keys": {f"{item.source}/{item.identifier}": item for item in mixed.values()},
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parser(__doc__).parse_args(argv)
    units = 400 if args.quick else 4000
    figures: dict[str, Any] = {}
    rows = []
    for name, mapping in orders(units).items():
        result = simulate(mapping, TIMES, jitter=0.2, seed=0)
        stats = result.claim_stats
        figures[f"{name}_requests_per_claim"] = result.requests_per_claim
        rows.append((name, len(mapping), f"{result.requests_per_claim:.3f}", stats["listings"], stats["conflicts"]))
    print(table(("order and keys", "units", "requests/claim", "listings", "conflicts"), rows))
    emit(figures)
    return figures


if __name__ == "__main__":
    main()
