"""The learner id a process takes when none is given: its host name and its launcher's rank.

One learner id names one process of a run: its claims, progress, presence record and Session
line are keyed by it, and a second live process under the same id is refused
(``DuplicateLearnerError``). ``f"node-{rank}"`` repeats on every machine that runs its own
launcher; the host name tells machines apart, the rank tells the processes of one machine
apart, and both stay the same when that process slot restarts, so ``resume=True`` takes its
units back.

Example:
    >>> import os
    >>> os.environ["GRADIENTMAIL_LEARNER_ID"] = "trainer-7"
    >>> default_learner_id()
    'trainer-7'
    >>> del os.environ["GRADIENTMAIL_LEARNER_ID"]
    >>> default_learner_id().endswith(f"-{os.environ.get('RANK', os.environ.get('SLURM_PROCID', '0'))}")
    True
"""

from __future__ import annotations

import os
import re
import socket
import zlib

__all__ = ["ENV_LEARNER_ID", "RANK_VARIABLES", "default_learner_id"]

ENV_LEARNER_ID = "GRADIENTMAIL_LEARNER_ID"
"""An explicit learner id for this process, used as it is (launchers without a rank variable)."""

RANK_VARIABLES = ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
"""Where launchers put a process's rank, in the order read: torchrun (and torch.distributed's
``env://``), SLURM, Open MPI, MPICH/Intel MPI. None set: rank 0 (one process per machine)."""

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def default_learner_id() -> str:
    """``$GRADIENTMAIL_LEARNER_ID`` if set, else ``{host name}-{rank}`` (``RANK_VARIABLES``, else 0).

    Unique per process across machines whose host names differ, and stable across restarts of
    the same process slot. Characters outside ``A-Z a-z 0-9 . _ -`` become ``-`` (a key segment),
    and a host name or rank that had any is followed by its CRC-32, so that two names that differ
    only there stay two learners.
    Two processes on one machine without a launcher both get rank 0: the second is refused
    with ``DuplicateLearnerError``; give each a rank or ``GRADIENTMAIL_LEARNER_ID``.
    """
    explicit = os.environ.get(ENV_LEARNER_ID, "").strip()
    if explicit:
        return explicit
    rank = next((os.environ[name].strip() for name in RANK_VARIABLES if os.environ.get(name, "").strip()), "0")
    return f"{_segment(socket.gethostname()) or 'host'}-{_segment(rank)}"


def _segment(text: str) -> str:
    """``text`` as part of a key segment: unsafe characters become ``-``, and a text that had any
    gets the CRC-32 of its original, so that ``gpu+1`` and ``gpu 1`` stay two learners.

    Example:
        >>> _segment("node-3"), _segment("gpu+1"), _segment("gpu 1")
        ('node-3', 'gpu-1.f39bab34', 'gpu-1.106f72ff')
    """
    safe = _UNSAFE.sub("-", text).strip("-")
    if safe == text:
        return safe
    return f"{safe}.{zlib.crc32(text.encode('utf-8', 'surrogatepass')):08x}"
