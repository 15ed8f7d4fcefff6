"""Every ``Example:`` in the package's docstrings runs, as the user would type it."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import gradientmail

MODULES = sorted(
    name
    for _, name, _ in pkgutil.walk_packages(gradientmail.__path__, prefix="gradientmail.")
    if not name.endswith("__main__")
)

EXTRAS = {"gradientmail.data.tables": "pyarrow"}
"""Modules whose examples need an optional dependency (their extra); skipped, with the reason, without it."""


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name: str) -> None:
    if name in EXTRAS:
        pytest.importorskip(EXTRAS[name], reason=f"{name}'s examples need {EXTRAS[name]} (its extra is not installed)")
    module = importlib.import_module(name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in finder.find(module, name):
        if test.lineno is None or test.filename != module.__file__:
            continue  # re-exported objects: their own module runs them
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples in {name} failed (output above)"


def test_the_package_has_examples() -> None:
    """A guard against the finder silently finding nothing (the suite above would pass)."""
    attempted = 0
    for name in MODULES:
        module = importlib.import_module(name)
        attempted += sum(len(test.examples) for test in doctest.DocTestFinder().find(module, name))
    assert attempted >= 20, attempted
