"""``gradientmail --version`` prints the installed version and exits 0."""

from __future__ import annotations

import pytest

import gradientmail
from gradientmail.cli import main


def test_version_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"gradientmail {gradientmail.__version__}"
