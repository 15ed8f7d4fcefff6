"""Adding a backend from outside the package: one file (this one) and no change to GradientMail.

``ToyMailbox`` keeps each key as one file in a flat directory (the key URL-quoted) and creates
with ``O_CREAT | O_EXCL``, which is atomic on a local file system. It registers the ``toy://``
scheme with its own URL check, joins the conformance suite shipped in ``gradientmail.testing``,
and is then served by ``open_mailbox``, the mistyped-URL checks, the shared queue and the CLI.
"""

from __future__ import annotations

import os
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from gradientmail import shared_queue
from gradientmail.cli.entry import main as cli_main
from gradientmail.errors import ValueTooLargeError
from gradientmail.mailbox import Backend, register_backend
from gradientmail.mailbox.base import BaseMailbox
from gradientmail.mailbox.schemes import unregister_backend
from gradientmail.mailbox.url import open_mailbox
from gradientmail.testing import MailboxConformance


class ToyMailbox(BaseMailbox):
    """Keys as files of one flat directory; ``O_EXCL`` makes the create atomic."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)

    def __reduce__(self) -> tuple[Any, ...]:
        return (ToyMailbox, (self.path,))

    @property
    def url(self) -> str:
        return f"toy://{self.path}"

    def _file(self, key: str) -> Path:
        return self.path / urllib.parse.quote(key, safe="")

    def _put_if_absent(self, key: str, data: bytes) -> bool:
        try:
            fd = os.open(self._file(key), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as file:
            file.write(data)
        return True

    def _get(self, key: str, max_bytes: int | None) -> bytes | None:
        try:
            with open(self._file(key), "rb") as file:
                size = os.fstat(file.fileno()).st_size
                if max_bytes is not None and size > max_bytes:  # refused before reading any of it
                    raise ValueTooLargeError(key, max_bytes, size, store=self.url)
                return file.read()  # had it grown meanwhile, BaseMailbox would refuse it after all
        except FileNotFoundError:
            return None

    def _put(self, key: str, data: bytes) -> None:
        temporary = self.path / f".tmp-{os.getpid()}-{os.urandom(4).hex()}"
        temporary.write_bytes(data)
        os.replace(temporary, self._file(key))

    def _delete(self, key: str) -> None:
        self._file(key).unlink(missing_ok=True)

    def _list(self, prefix: str, start_after: str | None) -> Iterator[str]:
        keys = sorted(urllib.parse.unquote(p.name) for p in self.path.iterdir() if not p.name.startswith("."))
        yield from (k for k in keys if k.startswith(prefix) and (start_after is None or k > start_after))


def open_toy(url: str, rest: str, options: dict[str, Any]) -> ToyMailbox:
    return ToyMailbox("/" + rest.lstrip("/"), **options)


def check_toy(scheme: str, rest: str) -> tuple[str, str | None] | None:
    return ("names no directory", None) if not rest.strip("/") else None


@pytest.fixture(autouse=True)
def toy_scheme() -> Iterator[None]:
    register_backend("toy", Backend("ToyMailbox", open_toy, check=check_toy))
    yield
    unregister_backend("toy")


class TestToyMailbox(MailboxConformance):
    backend = "toy"

    @pytest.fixture
    def mailbox_factory(self, tmp_path: Path) -> Any:
        return lambda backend, run="run": ToyMailbox(tmp_path / run)


def test_open_mailbox_serves_the_registered_scheme(tmp_path):
    box = open_mailbox(f"toy://{tmp_path}/run")
    assert isinstance(box, ToyMailbox) and box.put_if_absent("units/a", b"x") and not box.put_if_absent("units/a", b"y")


def test_the_backends_own_check_refuses_a_bad_url_and_lookalikes_are_named():
    with pytest.raises(ValueError, match="names no directory"):
        open_mailbox("toy://")
    with pytest.raises(ValueError, match="did you mean 'toy://"):
        open_mailbox("toy:/some/run")  # the missing '//' of a registered scheme, never a directory


def test_a_served_scheme_is_not_registered_twice():
    with pytest.raises(ValueError, match="served already"):
        register_backend("toy", Backend("Other", open_toy))
    with pytest.raises(ValueError, match="lower-case URL scheme"):
        register_backend("Toy Store", Backend("Other", open_toy))


def test_the_shared_queue_and_the_cli_run_on_it(tmp_path, capsys):
    url = f"toy://{tmp_path}/queue"
    units = {f"u{i}": i for i in range(3)}
    load = lambda i: [(i, torch.tensor([i]))]  # noqa: E731
    with shared_queue(units, mailbox=open_mailbox(url), learner_id="toy-0", load=load, workers=0) as batches:
        assert sorted(step for step, _ in batches) == [0, 1, 2]
    assert cli_main(["status", url]) == 0
    assert "toy-0" in capsys.readouterr().out
