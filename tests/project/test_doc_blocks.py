"""Every code block in README.md and docs/ runs as written, or says what it needs.

A newcomer copies blocks: ``NameError: start`` in docs/data.md's first block and ``KeyError:
'RANK'`` in docs/queue.md's were found that way. So:

- a Python block runs as it is, in a fresh directory, unless the line before it marks it a
  fragment (``<!-- fragment (why): model, box, units -->``); a fragment compiles, and every name it
  uses but does not define or import is one it says it needs;
- a Python block that is an example file verbatim is run by that example's own test;
- a shell block's commands are checked without running them (they install, train on GPUs or
  talk to S3): ``gradientmail ...`` parses with the CLI's own parser, ``python -m M`` names a
  module that exists, scripts and ``pip`` extras exist.
"""

from __future__ import annotations

import builtins
import importlib.metadata
import importlib.util
import os
import re
import shlex
import subprocess
import symtable
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from gradientmail.cli.parser import build_parser

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.S | re.M)
FRAGMENT = re.compile(r"<!--\s*fragment(?:\s*\([^)]*\))?\s*(?::\s*(.*?))?\s*-->\s*$")
"""``<!-- fragment (why, optional): name, name -->``: the names the block uses but leaves to the reader."""
SHELL = ("bash", "sh", "shell")
OTHER_COMMANDS = {"srun", "jq", "date"}
"""Programs a shell block may call that are not ours: only checked to be spelled as here."""


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    language: str
    code: str
    needs: frozenset[str] | None  # a fragment: the names it needs; None: runs as it is

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(languages: tuple[str, ...]) -> list[Block]:
    found = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for match in FENCE.finditer(text):
            if match.group(1) not in languages:
                continue
            before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
            marker = FRAGMENT.search(before)
            needs = None
            if marker is not None:
                names = [name.strip() for name in (marker.group(1) or "").split(",") if name.strip()]
                assert all(name.isidentifier() for name in names), f"{page.name}: bad fragment line {before!r}"
                needs = frozenset(names)
            line = text[: match.start()].count("\n") + 1
            found.append(Block(page, line, match.group(1), match.group(2), needs))
    return found


PYTHON = blocks(("python",))
COMMANDS = blocks(SHELL)
EXAMPLES = {path.read_text(encoding="utf-8") for path in (ROOT / "examples").glob("*.py")}


def free_names(code: str) -> set[str]:
    """Global names ``code`` reads but never binds at module level (assigns, defines, imports)."""
    top = symtable.symtable(code, "<block>", "exec")
    bound = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported() or s.is_namespace()}
    read: set[str] = set()
    tables = [top]
    while tables:
        table = tables.pop()
        tables.extend(table.get_children())
        for symbol in table.get_symbols():
            if symbol.is_referenced() and (table is top or symbol.is_global()):
                read.add(symbol.get_name())
    return read - bound - set(dir(builtins))


def test_the_pages_have_blocks_of_both_kinds():
    assert len(PYTHON) >= 8 and len(COMMANDS) >= 8
    assert sum(block.needs is None for block in PYTHON) >= 3, "most runnable blocks turned into fragments?"


@pytest.mark.parametrize("block", [b for b in PYTHON if b.needs is not None], ids=lambda b: b.name)
def test_a_fragment_compiles_and_names_what_it_needs(block):
    free = free_names(block.code)
    assert free <= block.needs, (
        f"{block.name} uses {sorted(free - block.needs)} without defining them: define them in the "
        "block or add them to its '<!-- fragment: needs ... -->' line"
    )
    unused = block.needs - free
    assert not unused, f"{block.name} says it needs {sorted(unused)}, which it does not use"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("block", [b for b in PYTHON if b.needs is None], ids=lambda b: b.name)
def test_a_python_block_runs_as_written(block, tmp_path):
    if block.code in EXAMPLES:
        pytest.skip("an example file verbatim: run by tests/project/test_examples.py and test_quickstart.py")
    script = tmp_path / "block.py"
    script.write_text(block.code, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "GRADIENTMAIL_LEARNER_ID")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, f"{block.name} failed as written:\n{done.stderr[-3000:]}"


def commands(block: Block) -> list[list[str]]:
    """The block's commands as argument lists: comments, ``&&`` chains and ``VAR=...`` lines split."""
    found = []
    for line in block.code.splitlines():
        line = re.sub(r"\s+#.*$", "", line).strip()
        if not line or line.startswith("#"):
            continue
        line = line.replace("$(date +%Y%m%d-%H%M%S)", "20261203-000000").replace("$RUN", "s3://my-bucket/runs/x")
        for part in line.split("&&"):
            words = shlex.split(part.split("|")[0])
            if words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
                words = words[1:]
            if words:
                found.append(words)
    return found


EXTRAS = set(importlib.metadata.metadata("gradientmail").get_all("Provides-Extra") or ())


def check_command(words: list[str]) -> None:
    program, args = words[0], words[1:]
    if program == "pip":
        assert args[0] == "install"
        for spec in args[1:]:
            extras = re.search(r"\[([^\]]+)\]", spec)
            for extra in extras.group(1).split(",") if extras else ():
                assert extra in EXTRAS, f"pip extra [{extra}] is not in pyproject.toml"
        if "-c" in args:
            assert (ROOT / args[args.index("-c") + 1]).exists()
    elif program == "gradientmail":
        parse_cli(args)
    elif program == "python":
        if args[:1] == ["-m"]:
            module = args[1]
            assert importlib.util.find_spec(module) is not None, f"python -m {module}: no such module"
            if module == "gradientmail":
                parse_cli(args[2:])
        elif args[:1] == ["-c"]:
            compile(args[1], "<python -c>", "exec")
        else:
            assert (ROOT / args[0]).exists(), f"python {args[0]}: no such file"
    elif program == "torchrun":
        script = next(word for word in args if not word.startswith("-"))
        assert (ROOT / script).exists(), f"torchrun {script}: no such file"
    elif program == "srun":
        check_command([word for word in args if not word.startswith("-")])
    else:
        assert program in OTHER_COMMANDS, f"unknown program {program!r}: check it, then add it to OTHER_COMMANDS"


def parse_cli(args: list[str]) -> None:
    try:
        build_parser().parse_args(args)
    except SystemExit as exc:
        pytest.fail(f"gradientmail {' '.join(args)}: the CLI refuses it (exit {exc.code})")


@pytest.mark.parametrize("block", COMMANDS, ids=lambda b: b.name)
def test_a_shell_block_names_commands_that_exist(block):
    found = commands(block)
    assert found, f"{block.name}: an empty shell block"
    for words in found:
        check_command(words)
