"""How raywds's log records reach the console. The library only logs
(`logging.getLogger(__name__)`); the CLI, the launchers, the Ray workers and the DataLoader
workers they fork send the `raywds` loggers here: INFO records (epoch and progress lines) to
stdout as they are, warnings and errors to stderr as `raywds: warning: ...`.

    from raywds import console
    console.configure()
"""

from __future__ import annotations

import logging
import sys


class _Console(logging.Handler):
    """Looks up sys.stdout and sys.stderr at each record: a notebook or a test may swap them."""

    raywds_console = True

    def emit(self, record: logging.LogRecord) -> None:
        try:
            if record.levelno < logging.WARNING:
                stream, text = sys.stdout, record.getMessage()
            else:
                stream, text = sys.stderr, f"raywds: {record.levelname.lower()}: {record.getMessage()}"
            stream.write(text + "\n")
            stream.flush()
        except Exception:  # noqa: BLE001 - logging's own policy: report, never raise
            self.handleError(record)


def configure(level: int = logging.INFO) -> None:
    """Print the `raywds` loggers' records at `level` and above, once per process."""
    logger = logging.getLogger("raywds")
    if any(getattr(h, "raywds_console", False) for h in logger.handlers):
        return
    logger.addHandler(_Console())
    logger.setLevel(level)
    logger.propagate = False  # Ray's root handlers would print each line twice
