"""The errors of ``gradientmail.data``: an unusable token file or shard, a range outside a file."""

from __future__ import annotations

from gradientmail.errors import GradientMailError


class TokenFileError(GradientMailError, ValueError):
    """A token file (or a writer's input) is unusable: wrong dtype, size, header or token value.

    The message names the file and what was found, so a bad upload is diagnosed from one line.
    """


class SequenceRangeError(GradientMailError, IndexError):
    """``sequences(start, count)`` asked for sequences the file does not hold."""


class ShardError(GradientMailError, ValueError):
    """A shard cannot be listed or read as asked: no file matched, a column that is no tensor,
    a format that cannot be split. The message names the shard and the fix."""


class FileChangedError(TokenFileError, ShardError):
    """A file is not the one pinned: replaced since ``shards()`` listed it, or while it was read.

    Reading on would mix two versions of the data (or silently train on other data than the run
    listed), so the reader stops; list the shards again for a new run.
    """
