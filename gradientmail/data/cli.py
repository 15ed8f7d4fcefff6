"""Old home of ``gradientmail tokens``, now in ``gradientmail.cli.tokens``; re-exported here."""

from gradientmail.cli.main import tokens_main as main
from gradientmail.cli.tokens import add_tokens_command

__all__ = ["add_tokens_command", "main"]
