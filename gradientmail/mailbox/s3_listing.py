"""Moved to ``gradientmail.mailbox.s3_common``; this path keeps old imports working."""

from gradientmail.mailbox.s3_common import LIST_PAGE, list_keys

__all__ = ["LIST_PAGE", "list_keys"]
