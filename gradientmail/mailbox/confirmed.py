"""Conditional writes confirmed by a read-back: the write counts only if the key holds its body.

``put_if_absent`` and ``replace_if`` promise that of several racing writers exactly one succeeds.
SeaweedFS keeps that promise only while every writer of a key takes the same path through its
server (docs/mailboxes.md, "SeaweedFS"): otherwise two writers can both be told they won, and
the key ends up holding one of their bodies. A write that guards exactly-once (a lease's beat and
fence, a unit's release, a presence record) therefore reads the key back after a success and
counts as won only if the key holds this call's very body. Each such body is unique to its call
(an incarnation and its beat count, a taker and the time of its fence, a claim token and the time
of its release), so finding any other body, or none, means another writer won: the caller
handles it exactly like a refused write. A claim and a takeover do the same with their token
(``queue.claims.read_back``).

One request more per write that succeeds. On a store whose conditional writes are atomic the
read-back always finds the body; it costs nothing else.
"""

from __future__ import annotations

from gradientmail.errors import ValueTooLargeError
from gradientmail.mailbox.base import Mailbox, VersionedMailbox

__all__ = ["create_confirmed", "holds", "replace_confirmed"]


def holds(mailbox: Mailbox, key: str, data: bytes) -> bool:
    """Whether ``key`` holds exactly ``data`` now: one ``get`` bounded by ``len(data)``, so a
    larger value (anyone else's) is told apart without being read."""
    data = bytes(data)
    try:
        return mailbox.get(key, max_bytes=len(data)) == data
    except ValueTooLargeError:
        return False


def create_confirmed(mailbox: Mailbox, key: str, data: bytes) -> bool:
    """``put_if_absent(key, data)``, then a read-back: True only if this call's body is the one stored.

    ``data`` must be unique to this call, or another writer's identical body would read as ours.
    """
    return mailbox.put_if_absent(key, data) and holds(mailbox, key, data)


def replace_confirmed(mailbox: VersionedMailbox, key: str, data: bytes, version: str) -> bool:
    """``replace_if(key, data, version)``, then a read-back: True only if this call's body is the
    one stored (``data`` must be unique to this call)."""
    return bool(mailbox.replace_if(key, data, version)) and holds(mailbox, key, data)  # type: ignore[arg-type]
