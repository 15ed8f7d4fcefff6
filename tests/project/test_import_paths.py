"""One import path per name: every import names the module that defines the name.

Nothing but the design note's API has shipped, so no module re-exports another's names for old
callers: an import ``from gradientmail.X import name`` is allowed when ``X`` defines ``name``
(assigns it, or defines a function or class of that name), when ``X`` is a package whose
``__init__`` exports it (``gradientmail`` for the user's API), or when it is the design note's
documented ``from gradientmail.patterns.shared_queue import shared_queue`` (and
``SharedQueueDataset``, which the queue's first issue documented there). Checked in the package,
tests, benchmarks, examples, notebooks and the code blocks of README.md and docs/.
"""

from __future__ import annotations

import ast
import json
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DESIGN_NOTE_PATH = "gradientmail.patterns.shared_queue"
DESIGN_NOTE_NAMES = {"shared_queue", "SharedQueueDataset"}
LAZY_EXPORT = re.compile(r'"(\w+)": "gradientmail[\w.]*"')


def module_file(module: str) -> tuple[Path | None, bool]:
    """The source of ``module`` and whether it is a package, or None when it is not ours."""
    path = ROOT.joinpath(*module.split("."))
    if (path / "__init__.py").is_file():
        return path / "__init__.py", True
    if path.with_suffix(".py").is_file():
        return path.with_suffix(".py"), False
    return None, False


@cache
def defined_and_exported(module: str) -> tuple[frozenset[str], frozenset[str]]:
    """Names ``module`` defines at top level, and those its ``__all__`` (or lazy table) lists."""
    path, _ = module_file(module)
    assert path is not None, f"no module {module}"
    source = path.read_text()
    defined: set[str] = set()
    exported: set[str] = set(LAZY_EXPORT.findall(source))
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        targets = node.targets if isinstance(node, ast.Assign) else []
        if isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        for target in targets:
            defined.update(name.id for name in ast.walk(target) if isinstance(name, ast.Name))
        if isinstance(node, ast.Assign) and "__all__" in {getattr(t, "id", None) for t in node.targets}:
            exported.update(e.value for e in ast.walk(node.value) if isinstance(e, ast.Constant))
    return frozenset(defined), frozenset(exported)


def crossings(source: str, where: str) -> list[str]:
    """The imports in ``source`` that go through a module that does not define the name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (
            isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("gradientmail")
        ):
            continue
        module = node.module or ""
        _, package = module_file(module)
        defined, exported = defined_and_exported(module)
        for alias in node.names:
            name = alias.name
            if name in defined or (package and name in exported) or module_file(f"{module}.{name}")[0]:
                continue
            if module == DESIGN_NOTE_PATH and name in DESIGN_NOTE_NAMES:
                continue
            found.append(f"{where}:{node.lineno}: from {module} import {name}")
    return found


def python_sources() -> list[tuple[str, str]]:
    """``(where, source)`` of every checked piece of Python in the repository."""
    sources = []
    for folder in ("gradientmail", "tests", "benchmarks", "examples"):
        sources += [(str(p.relative_to(ROOT)), p.read_text()) for p in sorted((ROOT / folder).rglob("*.py"))]
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        blocks = re.findall(r"```python\n(.*?)```", page.read_text(), re.S)
        sources += [(f"{page.relative_to(ROOT)} block {i + 1}", block) for i, block in enumerate(blocks)]
    for notebook in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(notebook.read_text())["cells"]
        code = ["".join(cell["source"]) for cell in cells if cell["cell_type"] == "code"]
        sources += [(f"{notebook.relative_to(ROOT)} cell {i + 1}", cell) for i, cell in enumerate(code)]
    return sources


def test_every_import_names_the_home_of_the_name():
    found = [line for where, source in python_sources() for line in crossings(source, where)]
    assert not found, "import these names from the module that defines them:\n" + "\n".join(found)


def test_no_module_but_a_package_init_re_exports():
    # A name imported into a module and listed in its __all__ is a second import path for it.
    found = []
    for path in sorted((ROOT / "gradientmail").rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        if path.name == "__init__.py" or module == DESIGN_NOTE_PATH:
            continue
        tree = ast.parse(path.read_text())
        imported = {a.asname or a.name for n in tree.body if isinstance(n, ast.ImportFrom) for a in n.names}
        _, exported = defined_and_exported(module)
        found += [f"{module}: {name}" for name in sorted(imported & exported)]
    assert not found, "modules that list an imported name in __all__:\n" + "\n".join(found)


def test_the_design_note_path_names_only_its_entry_points():
    import gradientmail
    from gradientmail.patterns import shared_queue as design_note

    assert set(design_note.__all__) == DESIGN_NOTE_NAMES
    assert design_note.shared_queue is gradientmail.shared_queue
    assert design_note.SharedQueueDataset is gradientmail.SharedQueueDataset
    assert sorted(p.name for p in (ROOT / "gradientmail" / "patterns").glob("*.py")) == [
        "__init__.py",
        "shared_queue.py",
    ]


@pytest.mark.parametrize(
    "source",
    [
        "from gradientmail.queue.claimer import NEAR\n",  # defined there: allowed
        "from gradientmail import shared_queue\n",  # the package's export: allowed
    ],
)
def test_the_rule_allows_a_home(source):
    assert crossings(source, "x") == []


def test_the_rule_catches_a_second_path():
    # claimer.py imports LIST_PAGE from the mailbox wrappers: importing it through claimer is a crossing.
    assert crossings("from gradientmail.queue.claimer import LIST_PAGE\n", "x") == [
        "x:1: from gradientmail.queue.claimer import LIST_PAGE"
    ]
