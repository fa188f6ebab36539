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


class ShardMismatch(ShardError):
    """A shard that disagrees with its manifest entry (size, first key, samples, keys or sha256):
    not the shard the manifest lists. Always an error: an epoch must never count wrong."""


ANOTHER_SHARD = (
    "it is another shard's bytes or changed after the manifest was made; run `raywds verify` on the run's --data "
    "(or `raywds index` again for shards raywds did not write)"
)
"""What a shard that disagrees with its manifest entry before it is read (size, first key) means."""


class StorageError(RaywdsError):
    """A run folder or checkpoint that cannot be used: a full disk, a damaged checkpoint, one
    holding code, a folder another run holds."""


class ServerError(RaywdsError):
    """A shard server that would not start or answer."""


class Terminated(RaywdsError):
    """The run stopped on SIGTERM, after a checkpoint inside its epoch (exit code 143, as a
    process that SIGTERM ends)."""

    exit_code = 143


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


def own_cause(e: BaseException) -> RaywdsError | None:
    """The first raywds error in `e`'s chain of causes (Ray's task errors keep the one raised in
    the task in `.cause`), or None."""
    seen: list[BaseException] = []
    cause: BaseException | None = e
    while cause is not None and cause not in seen:
        inner = getattr(cause, "cause", None)  # Ray's task error is also of the raised type: go in to the raised one
        if isinstance(cause, RaywdsError) and not isinstance(inner, BaseException):
            return cause
        seen.append(cause)
        cause = inner if isinstance(inner, BaseException) else cause.__cause__
    return None
