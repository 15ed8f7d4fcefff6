"""The errors of ``gradientmail.data``: a file that is not a usable token file, a range outside it."""

from __future__ import annotations

from gradientmail.errors import GradientMailError


class TokenFileError(GradientMailError, ValueError):
    """A token file (or a writer's input) is unusable: wrong dtype, size, header or token value.

    The message names the file and what was found, so a bad upload is diagnosed from one line.
    """


class SequenceRangeError(GradientMailError, IndexError):
    """``sequences(start, count)`` asked for sequences the file does not hold."""
