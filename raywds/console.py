"""How raywds's log records reach the console: `raywds: warning: ...` lines on stderr.

The library only logs (`logging.getLogger(__name__)`); the CLI, the Ray workers and the
DataLoader workers they fork send the `raywds` loggers here.

    from raywds import console
    console.configure()
"""

from __future__ import annotations

import logging
import sys


class _Formatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return f"raywds: {record.levelname.lower()}: {record.getMessage()}"


def configure(level: int = logging.INFO) -> None:
    """Print the `raywds` loggers' records at `level` and above to stderr, once per process."""
    logger = logging.getLogger("raywds")
    if any(getattr(h, "raywds_console", False) for h in logger.handlers):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Formatter())
    handler.raywds_console = True  # type: ignore[attr-defined]
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False  # Ray's root handlers would print each line twice
