"""Object versions: the bytes of a load all come from the version whose headers we planned with.

Run:ai's ranged reads carry no ``If-Match``: an object overwritten after its header was read
(or after the metadata cache recorded it) would be read as the new version's bytes at the old
version's offsets, a silent mix. So each loaded batch is delivered only after the objects it
was read from still have the size and version token (S3/Azure ETag, GCS generation, local
mtime and size) that the catalog recorded. Same token before and after the reads: the reads
saw that version. One HEAD per file per batch, against reads of up to a slot each; a HEAD sent
after a batch's last byte landed answers for it too, so batches that landed together share one
(``check``'s ``landed``).

The HEADs go out on :data:`CHECK_THREADS` checking threads, which share one storage client opened
as the load starts (:meth:`ObjectVersions.open_soon`): the pipeline asks for a batch's HEADs the
moment its last byte lands (:meth:`ObjectVersions.expect`) and keeps submitting and collecting
reads until they answer (:meth:`ObjectVersions.answered`); :meth:`ObjectVersions.check`, before
the batch is delivered, waits only for what is still unanswered. Batches of one request land
close together, each asking for a HEAD sent after it landed: on several threads those go out
side by side, not one round trip after another. A HEAD queued and not yet sent answers for every
batch that landed before it goes out, so the checks never fall behind by more than a HEAD a file
per thread.

A load served from memory kept by an earlier load (``resident``) reads no object bytes: it first
checks every shard and the index at once with one listing of the prefix (:meth:`check_all`).

Blind spot: an object replaced and then restored to the same version token between two checks
(an A-B-A overwrite); ETags are content hashes, so only a rewrite with other bytes and back.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING

from streamer_client.errors import ObjectChangedError, ObjectNotFoundError

from ..settings import Settings
from ..storage import ObjectInfo, Storage, open_storage
from ..uri import StorageURI
from .plan import Batch

if TYPE_CHECKING:
    from .open import Checkpoint

__all__ = ["CHECK_THREADS", "ObjectVersions"]

CHECK_THREADS = 4
"""Threads sending a load's HEADs: enough for the batches that land together, those of one or two
requests, each asking once its last byte landed (the SDK clients take concurrent calls, as the
catalog's header reads do)."""


class _Head:
    """One HEAD of a file on the checking thread: its answer, and when it was sent (``None``
    while it waits in the queue, to be sent later than anything that has landed now)."""

    __slots__ = ("answer", "sent")

    def __init__(self) -> None:
        self.answer: Future[ObjectInfo] | None = None
        self.sent: float | None = None

    def answers_for(self, landed: float) -> bool:
        """Whether this HEAD goes (or went) out after a batch's last byte landed at ``landed``."""
        sent = self.sent
        return sent is None or sent >= landed


class ObjectVersions:
    """Checks that a batch's objects are still the recorded versions, with HEADs on checking
    threads that share one storage client, opened lazily. Driven from one loading thread."""

    def __init__(self, uri: StorageURI, files: Sequence[ObjectInfo], settings: Settings) -> None:
        self.uri = uri
        self.checks = 0
        self._files = {f.name: f for f in files}
        self._settings = settings
        self._storage: Storage | None = None  # made and used on the checking threads only
        self._opening = threading.Lock()  # one client, made by the first thread that needs it
        self._thread: ThreadPoolExecutor | None = None
        self._heads: dict[str, _Head] = {}  # each file's latest HEAD

    @classmethod
    def of(cls, checkpoint: Checkpoint, settings: Settings) -> ObjectVersions:
        """The versions a checkpoint's catalog was built from: its shards and its index."""
        catalog = checkpoint.catalog
        return cls(checkpoint.uri, [*catalog.files, *([catalog.index] if catalog.index is not None else [])], settings)

    def check_all(self) -> None:
        """List the prefix once; raise naming the first recorded object that is gone or changed."""
        current = {o.name: o for o in self._on_thread(lambda: self._open().list_objects()).result()}
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
        """Open the storage client on the checking thread now (building an SDK client takes tens of
        milliseconds): the first HEAD finds it made. An error is raised by the first check."""
        if self._storage is None:
            self._on_thread(self._open)

    def _on_thread(self, work) -> Future:
        if self._thread is None:
            self._thread = ThreadPoolExecutor(max_workers=CHECK_THREADS, thread_name_prefix="versions")
        return self._thread.submit(work)

    def _open(self) -> Storage:
        with self._opening:
            if self._storage is None:
                self._storage = open_storage(self.uri, self._settings)
            return self._storage

    def _send(self, name: str, head: _Head) -> ObjectInfo:
        storage = self._open()
        head.sent = time.monotonic()
        return storage.stat(name)

    def _head(self, name: str, landed: float | None) -> _Head:
        """A HEAD of ``name`` sent after ``landed`` (``time.monotonic()`` when a batch's last byte
        landed): the latest one if it is, else a new one. ``landed=None``: always a new one."""
        last = self._heads.get(name)
        if landed is not None and last is not None and last.answers_for(landed):
            return last
        head = self._heads[name] = _Head()
        head.answer = self._on_thread(lambda: self._send(name, head))
        self.checks += 1
        return head

    def expect(self, batch: Batch, landed: float) -> None:
        """``batch``'s last byte landed at ``landed``: send the HEADs that will answer for it now,
        so that :meth:`check` finds them answered."""
        for name in batch.files:
            self._head(name, landed)

    def answered(self, batch: Batch, landed: float, wait_s: float = 0.0) -> bool:
        """Whether the HEADs that answer for ``batch`` (landed at ``landed``) have answered, so
        that :meth:`check` would not wait, waiting up to ``wait_s`` for them; asks for any not
        asked for yet."""
        answers = [self._head(name, landed).answer for name in batch.files]
        return not wait(answers, timeout=wait_s).not_done

    def check(self, batch: Batch, landed: float | None = None) -> None:
        """:class:`ObjectChangedError` naming the object when one of ``batch``'s files changed.
        ``landed``: ``time.monotonic()`` when the batch's last byte landed; ``None`` always asks."""
        heads = [(name, self._head(name, landed)) for name in batch.files]
        for name, head in heads:
            want = self._files[name]
            now = head.answer.result()
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
        """Drop the HEADs not sent yet (nothing will read them), wait for those out, then close
        the storage client."""
        if self._thread is not None:
            self._thread.shutdown(wait=True, cancel_futures=True)
            self._thread = None
        self._heads.clear()
        if self._storage is not None:
            self._storage.close()
            self._storage = None
