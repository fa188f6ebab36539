"""The project's own exception types. Library code raises these; only the CLI turns them
into an exit code and a one-line message."""


class RaywdsError(Exception):
    """Anything raywds refuses or cannot do; the message says what, the value, and the fix."""


class ConfigError(RaywdsError, ValueError):
    """A setting that cannot work."""


class DataError(RaywdsError):
    """Input files, shards or manifests that are missing or wrong."""


class ServerError(RaywdsError):
    """A shard server that would not start or answer."""
