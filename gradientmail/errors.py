"""One small exception hierarchy, each class also a built-in where one fits.

Catch ``GradientMailError`` for anything the library raises on purpose; catch the built-in
(``ValueError``, ``OSError``, ...) when you do not care that it came from GradientMail.

Example:
    >>> try:
    ...     raise InvalidKeyError("invalid mailbox key '../x'")
    ... except ValueError as exc:
    ...     isinstance(exc, GradientMailError)
    True
"""

from __future__ import annotations

import pickle


def short_repr(value: object, limit: int = 100) -> str:
    """``repr(value)`` cut to about ``limit`` characters, saying how long it was: error messages
    name a bad value without echoing all of a 10,000-character one.

    Example:
        >>> short_repr("ab")
        "'ab'"
        >>> short_repr("x" * 500, limit=20)
        "'xxxxxxxxxxxxxxxx... (502 characters)"
    """
    try:
        text = repr(value)
    except Exception:  # a broken __repr__ must not hide the real problem
        return "<unrepresentable>"
    return text if len(text) <= limit else f"{text[: limit - 3]}... ({len(text)} characters)"


MAX_MESSAGE = 2000
"""Longest message an error shows: a value echoed from hostile or broken input is cut to fit."""


class GradientMailError(Exception):
    """Base class of every error GradientMail raises on purpose.

    Its message is at most ``MAX_MESSAGE`` characters (its middle cut, and said so), whatever a
    bad input echoed into it.
    """

    def __str__(self) -> str:
        text = super().__str__()
        if len(text) <= MAX_MESSAGE:
            return text
        # The middle goes: the start says what failed, the end holds the cause (a worker's
        # traceback carried in the message ends with the original error).
        cut = f" ... ({len(text):,} characters in all; the middle cut) ... "
        head = (MAX_MESSAGE - len(cut)) // 3
        return text[:head] + cut + text[len(text) - (MAX_MESSAGE - len(cut) - head) :]


class InvalidKeyError(GradientMailError, ValueError):
    """A mailbox key (or prefix, or unit identifier) is unsafe or malformed."""


class MailboxError(GradientMailError, OSError):
    """A mailbox operation failed after retries; a log line says what failed where.

    Attributes:
        operation: the mailbox method (``"put_if_absent"``, ``"get"``, ...).
        key: the key it was given.
        store: a description of the store (its URL or directory).
    """

    def __init__(self, message: str, *, operation: str = "", key: str = "", store: str = "") -> None:
        super().__init__(message)
        self.operation = operation
        self.key = key
        self.store = store

    def __reduce__(self):  # keep fields across process boundaries (DataLoader workers)
        return (_rebuild_mailbox_error, (type(self), str(self), self.operation, self.key, self.store))


def _rebuild_mailbox_error(cls, message, operation, key, store):
    return cls(message, operation=operation, key=key, store=store)


class UnsafeStoreError(MailboxError):
    """The store cannot create a key atomically, so two nodes could both win one claim.

    Reading a claim back cannot compensate for a store that silently overwrites, so such a
    store is refused before any work is claimed.
    """


class KeyConflictError(MailboxError):
    """A key collides with another key's path on a filesystem (``a`` and ``a/b``)."""


class ValueTooLargeError(GradientMailError, ValueError):
    """A value read with a bound (``get(key, max_bytes=...)``) is longer than the bound.

    Raised after reading at most ``limit + 1`` bytes of the value (none when the store told its
    size first), so a stray huge file under a record's prefix costs no memory. A ``ValueError``,
    not a ``MailboxError``: the store worked, the value is unusable.

    Attributes:
        key: the key read.
        limit: the bound, in bytes.
        size: the value's size when the store said it, else None (only "more than ``limit``").
        store: a description of the store (its URL or directory), or "".
    """

    def __init__(self, key: str, limit: int, size: int | None = None, *, store: str = "") -> None:
        where = f"{store}: " if store else ""
        held = f"holds {size:,} bytes, more than" if size is not None else "holds more than"
        super().__init__(f"{where}{key!r} {held} the {limit:,} bytes this read allows (refused, not read whole)")
        self.key = key
        self.limit = limit
        self.size = size
        self.store = store

    def __reduce__(self):  # keep fields across process boundaries (DataLoader workers)
        return (_rebuild_too_large, (self.key, self.limit, self.size, self.store))


def _rebuild_too_large(key, limit, size, store):
    return ValueTooLargeError(key, limit, size, store=store)


class WrongProcessError(GradientMailError, RuntimeError):
    """An in-process object (a ``MemoryMailbox``) was used from another process."""


class MissingExtraError(GradientMailError, ImportError):
    """An optional dependency is missing; the message names the ``pip install`` that fixes it."""


class LoaderError(GradientMailError, TypeError):
    """A unit loader yielded something other than ``(int, batch)`` pairs.

    A batch is a tensor, or tuples, lists and dicts of tensors; the message names the unit and the
    offending leaf.
    """


class MailRejectedError(GradientMailError, ValueError):
    """Parameter mail that does not match this model (names, shapes, dtypes) or is corrupt."""


class SessionError(GradientMailError, RuntimeError):
    """A background exchange of a ``Session`` failed; raised on the training thread."""


class MailSkippedWarning(UserWarning):
    """Mail that could not be used (corrupt, non-finite, inconsistent) was skipped.

    A warning, not an error: one bad file must not stop every node, so the run goes on from the
    newest good mail; the message names the key, the writer and what was wrong.
    """


class DuplicateLearnerError(GradientMailError, ValueError):
    """Another live process already runs this ``learner_id`` in this run.

    Two incarnations of one learner would take each other's units; a restart after a crash is
    not refused (its predecessor is dead).

    Attributes:
        learner: the learner id.
        host: the host of the live incarnation.
        pid: its process id, when known.
    """

    def __init__(self, message: str, *, learner: str = "", host: str = "", pid: int | None = None) -> None:
        super().__init__(message)
        self.learner = learner
        self.host = host
        self.pid = pid

    def __reduce__(self):  # keep fields across process boundaries
        return (_rebuild_duplicate, (str(self), self.learner, self.host, self.pid))


def _rebuild_duplicate(message, learner, host, pid):
    return DuplicateLearnerError(message, learner=learner, host=host, pid=pid)


class LeaseLostError(GradientMailError, RuntimeError):
    """Peers judged this process dead (its lease stood still a whole lease: it stood still or its
    store was slow) and fenced its lease to take its units over: it stops rather than fold
    batches they train again."""


class UntrackedClaimsError(GradientMailError, RuntimeError):
    """A resuming learner found its own earlier claims written by the design note's queue, which
    records no progress: nobody can tell which of their batches were trained, so none is taken
    back (taking them back would train every one again)."""


class UnfinishedUnitsWarning(UserWarning):
    """Units claimed under a learner id were left unfinished and will not be trained in this run
    unless their owner's id takes them back (a restart under it, or ``lease=``)."""


class RecordError(GradientMailError, ValueError):
    """A record read from the mailbox is too large, too deep, not a JSON object, or has a bad field.

    The message names the key and the problem.
    """


class RecordSkippedWarning(MailSkippedWarning):
    """A record read from the mailbox was unusable and skipped (once per kind and learner)."""


class RunMismatchError(GradientMailError, ValueError):
    """The prefix already holds a run of another unit set (or something that is no run record)."""


# -- the CLI application and the run reader (moved from cli.py, demo.py and status.py) ------------
class UsageError(GradientMailError, ValueError):
    """A mailbox URL or option the command cannot work with."""


class DemoError(GradientMailError, RuntimeError):
    """The demo could not run: a node failed, or the options do not describe a run."""


class RunNotFoundError(GradientMailError, LookupError):
    """The mailbox exists but holds no run (no ``run.json``, claims or progress records)."""


# -- the session's state chain (moved from session/mail.py) ----------------------------------------
class UnusableStateError(MailRejectedError):
    """A version of the run's state that is corrupt, truncated, not finite or inconsistent.

    Skipped with a ``MailSkippedWarning`` rather than raised: one bad file, or one diverged or
    hostile writer, must not stop every node and every ``consensus()`` of the run.
    """


# -- the local mailbox's internal signals (moved from mailbox/local.py) ----------------------
class UnsafeEntry(Exception):
    """An entry of a local mailbox that must not be used: a symlink or a special file.

    Internal: ``LocalMailbox`` turns it into a ``MailboxError`` naming the key, or skips the entry
    in ``list`` with a ``MailSkippedWarning``.
    """

    def __init__(self, relative: str, what: str) -> None:
        super().__init__(f"{relative!r} is {what}")
        self.relative = relative
        self.what = what


class ParentIsKey(Exception):
    """A directory a local key needs is an existing key (a regular file); internal, as ``UnsafeEntry``."""


# -- the claim protocol -------------------------------------------
class KeyTypeError(InvalidKeyError, TypeError):
    """A unit identifier or learner id that is not a ``str`` (also a ``TypeError``)."""


# -- the shared queue's worker checks ------------------------
class InProcessMailboxError(WrongProcessError, ValueError):
    """A ``MemoryMailbox`` was given to worker processes, which would each get a private copy."""


class UnpicklableError(GradientMailError, TypeError, pickle.PicklingError):
    """``load``, the units or the mailbox cannot be sent to workers under this start method."""
