"""A progress bar on stderr (tqdm) that a spawned rank keeps while its output goes to a log.

Example:
    >>> progress = Progress(total=10, enabled=True)
    >>> progress.update(3, "int8 64M")
    >>> progress.close()
"""

from __future__ import annotations

import os
import sys

from tqdm import tqdm

# Where progress goes in a spawned rank whose stderr is captured to a log file.
_stream = None


def keep_terminal() -> None:
    """In a spawned rank, before its output is redirected: progress keeps the terminal."""
    global _stream
    _stream = os.fdopen(os.dup(2), "w")


class Progress:
    """A progress bar: done/total, elapsed time, a note. Off unless ``enabled``
    (default: stderr is a terminal)."""

    def __init__(self, total: int, enabled: bool | None = None):
        stream = _stream or sys.stderr
        enabled = stream.isatty() if enabled is None else enabled
        self.bar = tqdm(
            total=max(total, 1), file=stream, disable=not enabled, leave=False, dynamic_ncols=True
        )

    def update(self, done: int, note: str = "") -> None:
        if self.bar.disable:
            return
        changed = note != self.bar.desc
        self.bar.set_description_str(note, refresh=False)
        self.bar.update(done - self.bar.n)
        if changed:
            self.bar.refresh()  # a new note shows at once, however soon after the last redraw

    def close(self) -> None:
        self.bar.close()
