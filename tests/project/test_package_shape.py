"""The package's shape: one concept per module, data flowing one way, privacy respected.

Read from the source with ``ast``, so a regression names the file and line that caused it.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "gradientmail"
CALLERS = ("gradientmail", "benchmarks", "examples", "tests")
OURS = {*CALLERS, "", *(path.stem for path in (ROOT / "tests").rglob("*.py"))}
"""Our modules: the packages, relative imports, and the test modules and helpers imported by name."""
FOREIGN_OWNERS = {"torch"}  # a third-party module's private API is its own business, not a crossing of ours
PUBLIC_BY_CONVENTION = {
    "_fields",  # namedtuple's public API (with the three below)
    "_asdict",
    "_replace",
    "_make",
    "_shutdown_workers",  # torch's DataLoader iterator: no public shutdown (queue/loader.py, one call)
}


def _python_files(*folders: str) -> list[Path]:
    return sorted(path for folder in folders for path in (ROOT / folder).rglob("*.py"))


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(path): path for path in _python_files("gradientmail")}


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _resolve(module: str, node: ast.ImportFrom) -> str:
    """The absolute module an ``ImportFrom`` names (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    base = module.split(".") if _is_package(module) else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def _runtime_imports(tree: ast.Module) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement except those under ``if TYPE_CHECKING:`` (never run)."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(child) for statement in node.body for child in ast.walk(statement))
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in skipped:
            yield node


def _edges(module: str) -> set[str]:
    """The package modules ``module`` imports at run time (a name from a package counts as the
    package itself unless the name is one of its submodules)."""
    tree = ast.parse(MODULES[module].read_text())
    targets: set[str] = set()
    for node in _runtime_imports(tree):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
            continue
        source = _resolve(module, node)
        for alias in node.names:
            submodule = f"{source}.{alias.name}"
            targets.add(submodule if submodule in MODULES else source)
    return {target for target in targets if target in MODULES and target != module}


@pytest.mark.parametrize("name", sorted(MODULES))
def test_every_module_says_its_one_concept_in_its_first_line(name: str) -> None:
    # The rule is one concept per module, not a line count: its docstring's first line names it,
    # one sentence a reader can hold the module's contents against.
    docstring = ast.get_docstring(ast.parse(MODULES[name].read_text())) or ""
    first = docstring.splitlines()[0] if docstring else ""
    where = MODULES[name].relative_to(ROOT)
    assert first.endswith("."), f"{where}: the docstring's first line should say the module's concept in one sentence"
    assert len(first) <= 120 and ". " not in first.rstrip("."), f"{where}: one sentence, one line: {first!r}"


NO_CONCEPT = {"common", "helpers", "misc", "shared", "util", "utils"}
"""Module names that say where code is used, not what it is."""


@pytest.mark.parametrize("name", sorted(MODULES))
def test_every_module_is_named_for_its_concept(name: str) -> None:
    # "Helpers every command shares" is a drawer, not a concept: its parts each get a module
    # named for what they are (cli/exits.py, cli/output.py, ...).
    docstring = ast.get_docstring(ast.parse(MODULES[name].read_text())) or ""
    where = MODULES[name].relative_to(ROOT)
    assert name.rpartition(".")[2] not in NO_CONCEPT, f"{where}: name the module for its concept"
    assert not re.match(r"(Helpers|Utilities|Miscellaneous)\b", docstring), f"{where}: say the concept, not 'helpers'"


GLUED = re.compile(r"^Section ``\w+`` below:", re.MULTILINE)
"""A docstring paragraph that introduces one of several modules pasted into one file."""

AWAITING_SPLIT: set[str] = set()
"""Modules still glued from parts, each split by concept when its pending changes have landed:
listed here so that the test below fails for any other, and for these once they are split."""


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_is_several_pasted_together(name: str) -> None:
    # One module, one concept: parts pasted into one file under "Section ``x`` below:"
    # paragraphs are separate concepts, so they get separate modules, whatever the count.
    docstring = ast.get_docstring(ast.parse(MODULES[name].read_text())) or ""
    glued = bool(GLUED.search(docstring))
    where = MODULES[name].relative_to(ROOT)
    if name in AWAITING_SPLIT:
        assert glued, f"{where} is split: remove it from AWAITING_SPLIT"
    else:
        assert not glued, f"{where} pastes several modules together: give each part its own module"


def _cycle() -> list[str] | None:
    graph = {module: _edges(module) for module in MODULES}
    # A package's __init__ re-exporting its submodules is not a circle with them: the
    # submodules import each other directly, never through the package.
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        stack.append(module)
        for target in sorted(graph[module]):
            if _is_package(target) and module.startswith(target + "."):
                continue  # a submodule importing its own package's public names: flagged below
            if state.get(target) == 1:
                return stack[stack.index(target) :] + [target]
            if target not in state:
                found = visit(target)
                if found:
                    return found
        stack.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state:
            found = visit(module)
            if found:
                return found
    return None


def test_no_import_circle() -> None:
    cycle = _cycle()
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


LAYERS = (
    ("gradientmail.errors", "gradientmail.learner_id"),
    ("gradientmail.mailbox", "gradientmail.data"),
    ("gradientmail.layout", "gradientmail.records", "gradientmail.fold_gate", "gradientmail.meeting_point"),
    ("gradientmail.verdict", "gradientmail.run_record", "gradientmail.presence"),
    ("gradientmail.session",),
    ("gradientmail.queue",),
    ("gradientmail.status", "gradientmail.plot", "gradientmail.patterns", "gradientmail.testing", "gradientmail.sim"),
    ("gradientmail.cli",),
)
"""The package's layers, lowest first: a module imports only from its own layer or below.
The front door (``gradientmail/__init__.py``) and ``__main__`` entry points sit above them all.
The Session is below the queue: the elastic queue reads the learners' unit marks from the
run's state (``session.folded_units``) to continue a dead learner's unit; the Session needs
nothing from the queue (the queue hands its figures over through ``meeting_point``, and both
register their learner through ``presence``, below them)."""


VERSION_FALLBACK = {("gradientmail.cli.parser", "gradientmail")}
"""``gradientmail --version`` from a source tree without installed metadata reads ``__version__``."""


def _layer(module: str) -> int:
    if module == "gradientmail" or module.endswith(".__main__"):
        return len(LAYERS)
    for index, prefixes in enumerate(LAYERS):
        if any(module == prefix or module.startswith(prefix + ".") for prefix in prefixes):
            return index
    raise AssertionError(f"{module} is in no layer: add it to LAYERS")


def test_no_import_runs_back_up_the_layers() -> None:
    upward = [
        f"{module} (layer {_layer(module)}) imports {target} (layer {_layer(target)})"
        for module in sorted(MODULES)
        for target in sorted(_edges(module))
        if _layer(target) > _layer(module) and (module, target) not in VERSION_FALLBACK
    ]
    assert not upward, upward


def test_no_module_imports_from_its_own_package_init() -> None:
    """``from gradientmail.mailbox import X`` inside ``gradientmail/mailbox/`` is a hidden circle."""
    found = []
    for module in MODULES:
        for target in _edges(module):
            if _is_package(target) and module.startswith(target + ".") and target != "gradientmail":
                found.append(f"{module} imports {target}")
    assert not found, found


def _package_names(init: Path) -> set[str]:
    """The names a package's ``__init__`` binds at its top level (``_LAZY``'s keys included)."""
    names: set[str] = set()
    for node in ast.parse(init.read_text()).body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(target.id for target in targets if isinstance(target, ast.Name))
            if any(isinstance(t, ast.Name) and t.id == "_LAZY" for t in targets) and isinstance(node.value, ast.Dict):
                names.update(key.value for key in node.value.keys if isinstance(key, ast.Constant))
    return names


def test_no_module_is_shadowed_by_a_name_of_its_package() -> None:
    """A package exporting a function named like one of its modules hides that module:
    ``package.name`` is then the function, and the module is reachable only through ``sys.modules``."""
    shadowed = [
        f"{init.parent.relative_to(ROOT)}/{name}.py"
        for init in PACKAGE.rglob("__init__.py")
        for name in sorted(_package_names(init))
        if (init.parent / f"{name}.py").exists() or (init.parent / name / "__init__.py").exists()
    ]
    assert not shadowed, f"modules hidden by a name their package binds (rename the module): {shadowed}"


def _private_uses(path: Path) -> Iterator[str]:
    """Imports of another module's ``_private`` names, and ``obj._private`` on anything but
    ``self``/``cls`` (reading or writing another object's private state)."""
    tree = ast.parse(path.read_text())
    where = path.relative_to(ROOT)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in OURS:
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    yield f"{where}:{node.lineno} imports {alias.name}"
        private = (
            node.attr.startswith("_") and not node.attr.startswith("__") if isinstance(node, ast.Attribute) else False
        )
        if private and node.attr not in PUBLIC_BY_CONVENTION:
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls", *FOREIGN_OWNERS):
                continue
            if isinstance(owner, ast.Call) and ast.unparse(owner.func) == "super":
                continue
            yield f"{where}:{node.lineno} uses {ast.unparse(node)}"


@pytest.mark.parametrize("folder", CALLERS)
def test_no_private_name_crosses_a_module(folder: str) -> None:
    found = [use for path in _python_files(folder) for use in _private_uses(path)]
    assert not found, "\n".join(found)
