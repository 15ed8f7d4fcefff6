"""The repository holds source, docs and small fixtures: never a wheel, a build output or a data dump."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAX_BYTES = 1024 * 1024
"""A tracked file larger than this is a binary that belongs in a registry or a release, not here."""
PICTURES = ("docs/",)
"""The docs' pictures are the one exception to the size bound (each is still well under it today)."""
BINARY_SUFFIXES = (".whl", ".tar.gz", ".zip", ".so", ".pt", ".bin", ".npy", ".safetensors")


def tracked() -> list[str]:
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [name for name in listed.stdout.decode().split("\0") if name]


def test_no_tracked_file_is_large_but_the_docs_pictures():
    large = [
        f"{name} ({(ROOT / name).stat().st_size:,} bytes)"
        for name in tracked()
        if (ROOT / name).is_file() and (ROOT / name).stat().st_size > MAX_BYTES and not name.startswith(PICTURES)
    ]
    assert not large, f"tracked files over {MAX_BYTES:,} bytes: {large}"


def test_no_wheel_archive_or_weights_are_tracked():
    binaries = [name for name in tracked() if name.endswith(BINARY_SUFFIXES)]
    assert not binaries, f"binaries tracked in the repository: {binaries}"
