"""The Session with its learners in 8 processes: 64 and 128 learners on one store, S3-like costs.

``benchmarks.session_scale --processes 8`` in one fixed regime: the learners are threads dealt
round-robin to 8 worker processes sharing one ``LocalMailbox`` (on ``/dev/shm`` when writable),
each behind its own store wrapper costing 15 ms plus the body at 40 MB/s per request; a
100k-parameter float32 model cut into 16 fragments, 20 steps/s per learner, ``every=12 s``, a
30 s window. Twelve seconds keeps the folds a second that this machine's two cores serve below
what they can (at 128 learners about 170 fragment folds a second); a fold's store costs stay
those of the S3-like store, so what is measured is the protocol's, not the cores'. Figures as
``session_scale``'s, named ``processes_{figure}_{learners}``.

Usage: ``python -m benchmarks.session_processes [--quick]`` (``--quick``, for CI: 8 learners in
2 processes for a few seconds; it judges nothing). The last line is one JSON object.
"""

from __future__ import annotations

import os

from benchmarks import session_scale
from benchmarks._common import parser

FRAGMENTS = 16
ROWS = ["--processes", "8", "--learners", "64", "128", "--params", "100000", "--every", "12", "--seconds", "30"]
QUICK_ROWS = ["--quick", "--processes", "2", "--learners", "8", "--params", "100000", "--every", "1", "--seconds", "3"]


def main(argv: list[str] | None = None) -> dict[str, object]:
    args = parser(__doc__).parse_args(argv)
    os.environ["GRADIENTMAIL_SESSION_FRAGMENTS"] = str(FRAGMENTS)  # the spawned workers inherit it
    return session_scale.main(QUICK_ROWS if args.quick else ROWS, prefix="processes")


if __name__ == "__main__":
    main()
