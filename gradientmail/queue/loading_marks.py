"""Marks of the units an untracked queue is loading, written off the loader's path.

Where the queue cannot record what the loop consumed (a DataLoader worker, a store without
``replace_if``), it still marks each unit it claimed as ``work/{learner}/{unit}`` until the unit
is loaded, so that ``gradientmail status`` and a restart of the learner can name the units left
unfinished (``reclaim.warn_unfinished``). Those marks are information, not a guarantee, so they
must not cost the loader anything: on a store 20-100 ms away a put and a delete per unit on the
loader's path would cost more than loading a unit of small batches. One thread per loader writes
them in order, and a unit loaded before its mark went out costs no request at all. A mark that
fails is logged once; the queue goes on.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict

from gradientmail.layout import work_key
from gradientmail.mailbox.base import Mailbox, describe

__all__ = ["CLOSE_WAIT_S", "LoadingMarks"]

log = logging.getLogger("gradientmail.queue")

CLOSE_WAIT_S = 10.0
"""Longest wait, when the loader ends, for the marks still to be written (a store that stopped
answering must not hold up the end of the loop)."""


class LoadingMarks:
    """Writes ``body`` at ``work/{learner}/{unit}`` while a unit loads, and removes it once the
    unit is loaded, on a thread of its own, in the order asked.

    Args:
        mailbox: The shared store.
        learner_id: The learner whose units these are.
        body: The mark (``reclaim.untracked_record``).
    """

    def __init__(self, mailbox: Mailbox, learner_id: str, body: bytes) -> None:
        self.mailbox = mailbox
        self.learner_id = learner_id
        self.body = body
        self._todo: OrderedDict[str, bool] = OrderedDict()  # key -> True: write, False: remove
        self._busy: str | None = None  # the key being written or removed now
        self._written: set[str] = set()  # keys this loader's marks may stand at
        self._ready = threading.Condition()
        self._closed = False
        self._failed = False
        self._thread: threading.Thread | None = None

    def loading(self, identifier: str) -> None:
        """Mark ``identifier`` as claimed and not yet loaded (returns at once)."""
        self._ask(work_key(self.learner_id, identifier), True)

    def loaded(self, identifier: str) -> None:
        """Remove the mark of ``identifier``; one never written costs nothing (returns at once)."""
        key = work_key(self.learner_id, identifier)
        with self._ready:
            if self._todo.get(key) is True and key != self._busy and key not in self._written:
                del self._todo[key]  # still waiting to go out: nothing to write or remove
                return
        self._ask(key, False)

    def close(self, timeout: float = CLOSE_WAIT_S) -> None:
        """Write what is left (at most ``timeout`` seconds), then stop the thread."""
        with self._ready:
            self._closed = True
            self._ready.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning(
                    "%s: %d unit mark(s) under work/ not written within %.0f s on %s: status may show "
                    "units as unfinished that were loaded",
                    self.learner_id,
                    len(self._todo) + (self._busy is not None),
                    timeout,
                    describe(self.mailbox),
                )

    def _ask(self, key: str, write: bool) -> None:
        with self._ready:
            self._todo.pop(key, None)
            self._todo[key] = write
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name=f"gradientmail-marks-{self.learner_id}", daemon=True
                )
                self._thread.start()
            self._ready.notify()

    def _run(self) -> None:
        while True:
            with self._ready:
                while not self._todo and not self._closed:
                    self._ready.wait()
                if not self._todo:
                    return  # closed, and nothing left
                key, write = self._todo.popitem(last=False)
                self._busy = key
            try:
                if write:
                    self.mailbox.put(key, self.body)
                else:
                    self.mailbox.delete(key)
            except Exception as exc:  # information only: the queue goes on
                if not self._failed:
                    self._failed = True
                    log.warning(
                        "%s: could not write the mark %r on %s (%s: %s): status and a restart may not "
                        "name every unit this learner left unfinished",
                        self.learner_id,
                        key,
                        describe(self.mailbox),
                        type(exc).__name__,
                        exc,
                    )
            with self._ready:
                if write:
                    self._written.add(key)
                else:
                    self._written.discard(key)
                self._busy = None
