"""The project's own exception types. Library code raises these; only the CLI turns them
into an exit code and a one-line message."""

import re


class RaywdsError(Exception):
    """Anything raywds refuses or cannot do; the message says what, the value, and the fix."""


class ConfigError(RaywdsError, ValueError):
    """A setting that cannot work."""


class DataError(RaywdsError):
    """Input files, shards or manifests that are missing or wrong."""


class ShardError(DataError):
    """A shard that cannot be read (after retries), or whose contents disagree with the manifest."""


class ServerError(RaywdsError):
    """A shard server that would not start or answer."""


class CollectiveError(RaywdsError):
    """A collective failed or timed out: another rank stalled or died."""


def one_line(e: BaseException) -> str:
    """The error's own words; an error raised in a DataLoader worker arrives wrapped in the
    worker's traceback, whose last line holds them (after the exception's dotted type name)."""
    text = str(e)
    if text.startswith("Caught ") and "Original Traceback" in text:
        last = [line for line in text.splitlines() if line.strip()][-1]
        return re.sub(r"^[\w.]+: ", "", last)
    return text
