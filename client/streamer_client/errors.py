"""The one error tree of streamer-service and its client.

It lives in the thin client so that daemon mode can raise the very classes the
daemon raised, without the client importing the service. Every class is also a
builtin, so callers can catch what they already know::

    StreamerError (Exception)
    ├── InvalidURIError (ValueError)          a URI we cannot read from
    ├── ConfigError (ValueError)              a setting or argument out of range
    │   └── SettingsError                     a variable or argument the settings schema refuses
    ├── UnsafeKeyError (ValueError)           an object key that would escape the cache dir
    ├── CheckpointError (ValueError)          a checkpoint we refuse to load
    │   ├── HeaderError                       a safetensors header that fails validation
    │   └── SelectionError                    a selection that matches nothing / overlaps
    ├── StorageError (OSError)                object storage said no
    │   ├── ObjectNotFoundError (FileNotFoundError)   bucket, prefix or key missing
    │   ├── StorageAccessDeniedError (PermissionError) credentials missing or refused
    │   ├── StorageUnavailableError (ConnectionError)  endpoint unreachable, timeouts
    │   └── ObjectChangedError                 an object changed while we read it
    ├── SessionError (RuntimeError)           a load session the daemon refused or gave up on
    ├── DaemonError (ConnectionError)         the node daemon is unreachable or went away
    ├── BorrowedTensorError (RuntimeError)    a borrowed view was still in use when its buffer was due for reuse
    ├── CacheError (OSError)                  the local cache dir cannot be written (disk full, ...)
    └── CacheLockTimeoutError (TimeoutError)  another puller held the cache lock too long

Each error carries the URI, key or tensor name that caused it in its message
and, where known, as attributes.
"""

from __future__ import annotations

__all__ = [
    "StreamerError",
    "InvalidURIError",
    "ConfigError",
    "SettingsError",
    "UnsafeKeyError",
    "CheckpointError",
    "HeaderError",
    "SelectionError",
    "StorageError",
    "ObjectNotFoundError",
    "StorageAccessDeniedError",
    "StorageUnavailableError",
    "ObjectChangedError",
    "SessionError",
    "DaemonError",
    "BorrowedTensorError",
    "CacheError",
    "CacheLockTimeoutError",
]


class StreamerError(Exception):
    """Base of every error raised on purpose by streamer-service."""

    def __init__(self, message: str, *, uri: str | None = None, key: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.uri = None if uri is None else str(uri)  # text, also when given a parsed URI
        self.key = key

    def __str__(self) -> str:
        return self.message

    def __reduce__(self):  # keep the attributes across pickling (process pools, the daemon)
        return (_rebuild, (type(self), self.message, self.uri, self.key))


def _rebuild(cls, message, uri, key):
    return cls(message, uri=uri, key=key)


class InvalidURIError(StreamerError, ValueError):
    """The URI has an unknown scheme, no bucket, junk, or is not a directory."""


class ConfigError(StreamerError, ValueError):
    """A setting or an argument is out of range."""


class SettingsError(ConfigError):
    """An environment variable or an argument that its setting's parser refuses; the message names
    each one with its value (``STREAMER_SHM_BUDGET='lots': not a size: ...``)."""


class UnsafeKeyError(StreamerError, ValueError):
    """An object key would land outside the cache dir or cannot be a file name."""


class CheckpointError(StreamerError, ValueError):
    """The checkpoint is malformed or ambiguous."""


class HeaderError(CheckpointError):
    """A safetensors header fails validation."""


class SelectionError(CheckpointError):
    """A selection names nothing, names a tensor twice, or overlaps another."""


class StorageError(StreamerError, OSError):
    """Object storage refused or failed a request."""


class ObjectNotFoundError(StorageError, FileNotFoundError):
    """The bucket, container, prefix or key does not exist, or holds no objects."""


class StorageAccessDeniedError(StorageError, PermissionError):
    """Credentials are missing or the storage refused them."""


class StorageUnavailableError(StorageError, ConnectionError):
    """The storage endpoint could not be reached or did not answer in time."""


class ObjectChangedError(StorageError):
    """An object changed (ETag or size) between two reads of one pull or load."""


class SessionError(StreamerError, RuntimeError):
    """The daemon refused a join (world size mismatch, rank joined twice, not allowed) or gave up
    on a session (ranks missing at the join timeout, this rank reclaimed after its lease lapsed)."""


class DaemonError(StreamerError, ConnectionError):
    """The node daemon could not be reached, went away mid-load, or answered nonsense."""


class BorrowedTensorError(StreamerError, RuntimeError):
    """A ``borrowed=True`` tensor was still referenced when its buffer was about to be reused.

    Raised instead of overwriting memory the caller can still see (docs/client.md).
    """


class CacheError(StreamerError, OSError):
    """The local metadata cache dir cannot be written (disk full, permissions)."""


class CacheLockTimeoutError(StreamerError, TimeoutError):
    """Waiting for another process's pull of the same URI took longer than the timeout."""
