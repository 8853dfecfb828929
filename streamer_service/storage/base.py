"""The narrow interface every storage backend implements.

Backends list a prefix, download whole (small) objects for the metadata cache
and read byte ranges (safetensors headers). Bulk tensor bytes never go through
here: Run:ai's native reader owns that path (see ``engine``).
"""

from __future__ import annotations

import abc
from collections.abc import Iterator
from typing import BinaryIO, NamedTuple

from ..uri import StorageURI

__all__ = ["ObjectInfo", "Storage"]


class ObjectInfo(NamedTuple):
    """One object under a URI's prefix.

    ``name`` is the path relative to the prefix, '/'-separated, exactly as the
    storage spells it (still untrusted: see ``metadata.safe_relative_path``).
    ``etag`` is the storage's version token: S3/Azure ETag, GCS generation,
    or ``<mtime_ns>-<size>`` for local files.
    """

    name: str
    size: int
    etag: str


class Storage(abc.ABC):
    """One URI's bucket and prefix on one backend."""

    def __init__(self, uri: StorageURI) -> None:
        self.uri = uri

    def list_objects(self) -> list[ObjectInfo]:
        """Every object under the prefix, recursively, sorted by name.

        Raises ``ObjectNotFoundError`` when the bucket does not exist.
        """
        prefix = f"{self.uri.prefix}/" if self.uri.prefix else ""
        found = [
            ObjectInfo(name=key[len(prefix) :], size=size, etag=etag)
            for key, size, etag in self._list_keys(prefix)
            if not key.endswith("/")  # a "folder" placeholder object, not a file
        ]
        found.sort(key=lambda o: o.name)
        return found

    def _list_keys(self, prefix: str) -> Iterator[tuple[str, int, str]]:
        """``(key, size, etag)`` of every object whose key starts with ``prefix`` (cloud backends)."""
        raise NotImplementedError

    @abc.abstractmethod
    def download(self, obj: ObjectInfo, dest: BinaryIO) -> int:
        """Write the whole of ``obj`` to ``dest``; return the bytes written.

        Raises ``ObjectChangedError`` when the object no longer matches ``obj.etag``.
        """

    @abc.abstractmethod
    def read_range(self, name: str, offset: int, length: int) -> bytes:
        """Bytes ``[offset, offset+length)`` of object ``name`` (fewer only at its end)."""

    @abc.abstractmethod
    def stat(self, name: str) -> ObjectInfo:
        """Size and version of one object; ``ObjectNotFoundError`` if missing."""

    def permissions(self, obj: ObjectInfo) -> int | None:
        """The permission bits of ``obj`` where the storage has them (local files), else None."""
        return None

    def close(self) -> None:
        """Release clients and connections."""

    def __enter__(self) -> Storage:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.uri.normalized!r})"
