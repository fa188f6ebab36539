"""How raywds's log records reach the console: `raywds: warning: ...` lines on stderr.

The library only logs (`logging.getLogger(__name__)`); the CLI, the Ray workers and the
DataLoader workers they fork send the `raywds` loggers here.

    from raywds import console
    console.configure()
"""

from __future__ import annotations

import logging
import sys


class _Stderr(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever sys.stderr is when a record comes (a notebook or a test may swap it)."""

    @property  # type: ignore[override]
    def stream(self) -> object:
        return sys.stderr

    @stream.setter
    def stream(self, value: object) -> None:
        pass


class _Formatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return f"raywds: {record.levelname.lower()}: {record.getMessage()}"


def configure(level: int = logging.INFO) -> None:
    """Print the `raywds` loggers' records at `level` and above to stderr, once per process."""
    logger = logging.getLogger("raywds")
    if any(getattr(h, "raywds_console", False) for h in logger.handlers):
        return
    handler = _Stderr()
    handler.setFormatter(_Formatter())
    handler.raywds_console = True  # type: ignore[attr-defined]
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False  # Ray's root handlers would print each line twice
