"""The README and docs are a manual of the product as it is: short, and free of development history.

History (issue numbers, numbered work periods, protocol generations told as a story, commit
hashes, dated runs in prose, what was tried and dropped) goes stale and means nothing to a user;
it belongs in CHANGELOG.md, in user terms. "The seed" is not a word a user knows: the document is
"the design note", its code "the documented example" or "the documented loop".
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README_MAX_LINES = 200
SCANNED = ("README.md", "docs", "gradientmail", "tests", "benchmarks", "examples", "notebooks")
SUFFIXES = (".md", ".py", ".ipynb", ".sh", ".txt", ".toml")
EXEMPT = ("benchmarks/RESULTS.md", "benchmarks/results.json", "tests/project/test_manual.py")
"""Written by ``python -m benchmarks`` (their provenance lines carry dates by design), and this
file, which names the patterns."""

HISTORY = {
    "an issue number": re.compile(r"\b[Ii]ssues? #?\d|#\d+,? (?:asked|items?)\b|\(#\d+\)"),
    "an issue told as the reason": re.compile(r"\b[Tt]he issue's\b|\bof the issue\b"),
    "a protocol generation told as a story": re.compile(
        r"(?<![\"'\[])\b[vV][23]\b(?![:\"'])|\b[Vv]ersion [23]\b(?! of the format)|\bthe first Session\b"
    ),
    "a numbered work period": re.compile(r"\bwork periods?\b|\b[Ss]essions? \d+\b(?! (?:learners?|nodes?|processes))"),
    "the seed as product vocabulary": re.compile(r"\b[Tt]he seed\b|\bseed's\b"),
    "a commit hash": re.compile(r"\bcommits? [0-9a-f]{7,40}\b"),
    "a dated run in prose": re.compile(
        r"\b(?:on|of|in|since|before|after|until) 20\d\d-\d\d-\d\d\b|\(20\d\d-\d\d-\d\d\b|, 20\d\d-\d\d-\d\d[):]"
    ),
    "what was tried and dropped": re.compile(r"\b[Tt]ried\b.{0,80}\bnot kept\b|\bnot kept\b:|\bflagged for the lead\b"),
}
"""What reads as development history, by the words that give it away."""

SEED_NAMED = re.compile(
    r"(?i)(?<![A-Za-z0-9])(?:[A-Za-z0-9]+[-_])*?"
    r"(?:(?:queue|the)[-_]seeds?(?![A-Za-z0-9_-])|seeds?[-_](?:"
    r"case|claims?|demo|entry|example|figures|fixed|grid|kind|loop|makespan|mapping|names|nodes?|"
    r"path|protocol|queue|rotation|runs?|s|schedules?|speeds|training|units?)(?![A-Za-z0-9]))"
)
"""A name (identifier, file, test id, figure key) that calls the design note or its example "the
seed": ``seed_loop``, ``SEED_SPEEDS``, ``seed-queue``, ``test_shared_queue_seed``. A random seed
(``manual_seed``, ``--seed``, ``PYTHONHASHSEED``, ``the_same_seed_and``) is another word."""

FIGURE_BLOCK = re.compile(r"<!-- figures: .*?<!-- /figures -->", re.DOTALL)


def scanned_files() -> list[Path]:
    files = []
    for name in SCANNED:
        path = ROOT / name
        candidates = [path] if path.is_file() else sorted(path.rglob("*"))
        files += [
            candidate
            for candidate in candidates
            if candidate.is_file()
            and candidate.suffix in SUFFIXES
            and str(candidate.relative_to(ROOT)) not in EXEMPT
            and "__pycache__" not in candidate.parts
        ]
    return files


def history_lines(path: Path, root: Path = ROOT) -> list[str]:
    """``file:line: what`` for every line of ``path`` that tells history (generated blocks aside)."""
    text = FIGURE_BLOCK.sub(lambda block: "\n" * block.group().count("\n"), path.read_text(errors="replace"))
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for what, pattern in HISTORY.items():
            if pattern.search(line):
                found.append(f"{path.relative_to(root)}:{number}: {what}: {line.strip()[:120]}")
    return found


def seed_names(path: Path, root: Path = ROOT) -> list[str]:
    """``file[:line]: name`` for the file's name and every name in it that calls a thing "the seed"."""
    where = path.relative_to(root)
    found = [f"{where}: {match.group()}" for match in SEED_NAMED.finditer(path.name)]
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        found += [f"{where}:{number}: {match.group()}" for match in SEED_NAMED.finditer(line)]
    return found


def test_no_development_history_in_the_manual_the_code_or_the_tests() -> None:
    found = [line for path in scanned_files() for line in history_lines(path)]
    assert not found, "development history (it belongs in CHANGELOG.md, in user terms):\n" + "\n".join(found)


def test_the_history_scan_names_file_and_line(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "A manual line.\nThe seed's loop (issue #24, item 3).\n<!-- figures: x -->\nrun on 2026-12-05\n"
        '<!-- /figures -->\nTried a wider window and not kept.\nkeys b"v2" and v2:127.0.0.1 are data\n'
    )
    found = [line.split(": ", 2)[:2] for line in history_lines(page, tmp_path)]
    assert found == [
        ["page.md:2", "an issue number"],
        ["page.md:2", "the seed as product vocabulary"],
        ["page.md:6", "what was tried and dropped"],
    ]


def test_no_name_calls_the_design_note_the_seed() -> None:
    # results.json too: its figure keys are names that the README and docs show.
    paths = [*scanned_files(), ROOT / "benchmarks" / "results.json"]
    found = [name for path in paths for name in seed_names(path)]
    assert not found, 'names for "the seed" (say what it is: design_note, documented, ...):\n' + "\n".join(found)


def test_the_seed_name_scan_tells_product_names_from_random_seeds(tmp_path: Path) -> None:
    module = tmp_path / "test_shared_queue_seed.py"
    module.write_text(
        "from seed_loop import run_seed_loop\nSEED_SPEEDS = {}\nids=['seed-queue']\nfigures['seed_makespan'] = 1\n"
        "torch.manual_seed(0); random.seed(1); parser.add_argument('--seed'); env['PYTHONHASHSEED']\n"
        "def test_a_run_continues_with_the_same_seed_and_refuses_another(seed, hash_seed, MODEL_SEED): ...\n"
    )
    assert [line.split(": ", 1) for line in seed_names(module, tmp_path)] == [
        ["test_shared_queue_seed.py", "test_shared_queue_seed"],
        ["test_shared_queue_seed.py:1", "seed_loop"],
        ["test_shared_queue_seed.py:1", "run_seed_loop"],
        ["test_shared_queue_seed.py:2", "SEED_SPEEDS"],
        ["test_shared_queue_seed.py:3", "seed-queue"],
        ["test_shared_queue_seed.py:4", "seed_makespan"],
    ]


def test_the_readme_is_at_most_200_lines() -> None:
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines; move detail into docs/ (at most {README_MAX_LINES})"
    )
