"""Object versions: the bytes of a load all come from the version whose headers we planned with.

Run:ai's ranged reads carry no ``If-Match``: an object overwritten after its header was read
(or after the metadata cache recorded it) would be read as the new version's bytes at the old
version's offsets, a silent mix. So each loaded batch is delivered only after the objects it
was read from still have the size and version token (S3/Azure ETag, GCS generation, local
mtime and size) that the catalog recorded. Same token before and after the reads: the reads
saw that version. One HEAD per file per batch, against reads of up to a slot each; a HEAD sent
after a batch's last byte landed answers for it too, so batches that landed together share one
(``check``'s ``landed``). The storage client is opened on a thread as the load starts
(:meth:`ObjectVersions.open_soon`), not by the first batch's check.

A load served from memory kept by an earlier load (``resident``) reads no object bytes: it first
checks every shard and the index at once with one listing of the prefix (:meth:`check_all`).

Blind spot: an object replaced and then restored to the same version token between two checks
(an A-B-A overwrite); ETags are content hashes, so only a rewrite with other bytes and back.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from streamer_client.errors import ObjectChangedError, ObjectNotFoundError

from ..settings import Settings
from ..storage import ObjectInfo, Storage, open_storage
from ..uri import StorageURI
from .plan import Batch

if TYPE_CHECKING:
    from .open import Checkpoint

__all__ = ["ObjectVersions"]


class ObjectVersions:
    """Checks that a batch's objects are still the recorded versions; opens its storage lazily."""

    def __init__(self, uri: StorageURI, files: Sequence[ObjectInfo], settings: Settings) -> None:
        self.uri = uri
        self.checks = 0
        self._files = {f.name: f for f in files}
        self._settings = settings
        self._storage: Storage | None = None
        self._opening: threading.Thread | None = None
        self._heads: dict[str, tuple[float, ObjectInfo]] = {}  # each file's last HEAD: when sent, what it said

    @classmethod
    def of(cls, checkpoint: Checkpoint, settings: Settings) -> ObjectVersions:
        """The versions a checkpoint's catalog was built from: its shards and its index."""
        catalog = checkpoint.catalog
        return cls(checkpoint.uri, [*catalog.files, *([catalog.index] if catalog.index is not None else [])], settings)

    def check_all(self) -> None:
        """List the prefix once; raise naming the first recorded object that is gone or changed."""
        current = {o.name: o for o in self._open().list_objects()}
        self.checks += 1
        for name, want in self._files.items():
            now = current.get(name)
            if now is None:
                raise ObjectNotFoundError(
                    f"{self.uri.child(name)} is gone since the metadata of {self.uri} was pulled",
                    uri=self.uri.normalized,
                    key=name,
                )
            if (now.size, now.etag) != (want.size, want.etag):
                raise ObjectChangedError(
                    f"{self.uri.child(name)} changed since the metadata of {self.uri} was pulled (size {want.size}, "
                    f"version {want.etag!r} then; now size {now.size}, version {now.etag!r}); nothing of it was "
                    "delivered. Pull again with force: TRTLLM_OBJECT_STORAGE_FORCE_PULL=1 or `streamer-service pull --force`",
                    uri=self.uri.child(name),
                    key=name,
                )

    def open_soon(self) -> None:
        """Open the storage client on a thread now (building an SDK client takes tens of
        milliseconds): the first check finds it made. An error is raised by that check."""
        if self._storage is None and self._opening is None:
            self._opening = threading.Thread(target=self._open_quietly, name="versions-open", daemon=True)
            self._opening.start()

    def _open_quietly(self) -> None:
        try:
            self._storage = open_storage(self.uri, self._settings)
        except Exception:  # noqa: BLE001 - _open() opens again in the caller's thread and raises there
            pass

    def _open(self) -> Storage:
        if self._opening is not None:
            self._opening.join()
            self._opening = None
        if self._storage is None:
            self._storage = open_storage(self.uri, self._settings)
        return self._storage

    def _stat(self, name: str, landed: float | None) -> ObjectInfo:
        """``name``'s size and version now: from a HEAD sent after ``landed`` (``time.monotonic()``
        when the batch's last byte landed) if there was one, else from a new HEAD."""
        last = self._heads.get(name)
        if landed is not None and last is not None and last[0] >= landed:
            return last[1]
        sent = time.monotonic()
        now = self._open().stat(name)
        self.checks += 1
        self._heads[name] = (sent, now)
        return now

    def check(self, batch: Batch, landed: float | None = None) -> None:
        """:class:`ObjectChangedError` naming the object when one of ``batch``'s files changed.
        ``landed``: ``time.monotonic()`` when the batch's last byte landed; ``None`` always asks."""
        for name in dict.fromkeys(r.file for r in batch.ranges):
            want = self._files[name]
            now = self._stat(name, landed)
            if (now.size, now.etag) != (want.size, want.etag):
                raise ObjectChangedError(
                    f"{self.uri.child(name)} changed while it was being loaded (size {want.size}, version "
                    f"{want.etag!r} when its header was read; now size {now.size}, version {now.etag!r}); no "
                    "tensor of it read since was delivered. Load again (metadata cached before the change: "
                    "pull again with force, TRTLLM_OBJECT_STORAGE_FORCE_PULL=1)",
                    uri=self.uri.child(name),
                    key=name,
                )

    def close(self) -> None:
        if self._opening is not None:
            self._opening.join()
            self._opening = None
        if self._storage is not None:
            self._storage.close()
            self._storage = None
