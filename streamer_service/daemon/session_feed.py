"""A load session's feed: what its loading thread hands the ranks.

First the tensors an earlier load left in memory (``resident``), one batch per resident segment;
then the rest, planned into batches and streamed once by the pipeline into the session's buffers
(``session_buffers``), each landed batch published to the rank ledger (``ledger``) as handles. A
batch that no rank holds once published goes straight back to the buffers.

The feed runs on the session's loading thread. Everything the ranks' requests can see changes under
the session's lock, which the feed shares (``lock``: the session's condition, notified on each
publish); the feed stops with :class:`Cancelled` at the next buffer, release wait or publish once
the session is cancelled.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from ..checkpoint.catalog import TensorInfo
from ..checkpoint.plan import Batch, BatchKind, build_plan
from ..checkpoint.versions import ObjectVersions
from ..load.pipeline import Load, LoadStats, Pipeline
from ..readers.base import ReaderFactory
from ..readers.kept import KeptReaders
from .ledger import RankLedger
from .metrics import LoadTimes
from .session_buffers import SegmentSlot, SessionBuffers, handle
from .shm import Segment

if TYPE_CHECKING:
    import threading

    from ..checkpoint.open import Checkpoint

__all__ = ["Cancelled", "SessionFeed"]


class Cancelled(Exception):
    """No rank is left to read the load, or the daemon stops: stop streaming."""


class SessionFeed:
    def __init__(
        self,
        key: str,
        checkpoint: Checkpoint,
        *,
        slot_size: int,
        buffers: SessionBuffers,
        ledger: RankLedger,
        lock: threading.Condition,
        cancelled: Callable[[], bool],
        times: LoadTimes,
        stats: LoadStats,
        versions: ObjectVersions | None,
        reader_factory: ReaderFactory,
        storage_environment: Mapping[str, str] | None,
        in_flight: int | None,
        readers: KeptReaders,
    ) -> None:
        self._key = key
        self._checkpoint = checkpoint
        self._slot_size = slot_size
        self._buffers = buffers
        self._ledger = ledger
        self._lock = lock
        self._cancelled = cancelled  # read under the lock
        self._times = times
        self._stats = stats
        self._versions = versions
        self._reader_factory = reader_factory
        self._storage_environment = storage_environment  # Run:ai's retry/timeout variables
        self._in_flight = in_flight  # bytes submitted to storage and not yet landed, at most
        self.resident_bytes = 0  # handed out from memory kept by earlier loads
        self._readers = readers  # started readers the daemon keeps between loads
        self.reader_kept = False  # this load read through a reader an earlier load left started

    def run(self, wanted: list[TensorInfo]) -> None:
        """Publish every tensor of ``wanted``: those in memory first, then the rest as it lands."""
        missing = self._serve_resident(wanted)
        plan = build_plan(missing, self._slot_size)
        self._buffers.prepare(plan, self._key)
        if not plan.batches:
            return
        uri = self._checkpoint.uri
        with self._readers.reader(uri, self._reader_factory, self._storage_environment) as (reader, self.reader_kept):
            pipeline = Pipeline(uri, plan, reader, self._acquire, self._stats, self._versions, in_flight=self._in_flight)
            for load in pipeline.loaded(self._wait_for_release):
                self._publish(load)

    def _serve_resident(self, wanted: list[TensorInfo]) -> list[TensorInfo]:
        """Hand out the tensors an earlier load left in memory; return those still to stream."""
        # One batch per resident segment, numbered after the plan's (0..n-1).
        checkpoint = self._checkpoint
        batches = self._buffers.resident_batches(checkpoint.uri.normalized, checkpoint.generation, wanted, 1 << 32)
        if not batches:
            return wanted
        if self._versions is not None:
            self._versions.check_all()  # one listing: the copy is still what storage holds
        with self._lock:
            for handles in batches:
                # Leased like a ring slot (ranks release it), but the resident copy owns the memory.
                if self._ledger.publish(handles[0].batch, handles, None)[0]:
                    self._times.mark("first_ready")
            self.resident_bytes = sum(h.nbytes for handles in batches for h in handles)
            self._lock.notify_all()
        self._buffers.served(self.resident_bytes)
        served = {h.name for handles in batches for h in handles}
        return [t for t in wanted if t.name not in served]

    def _acquire(self, batch: Batch) -> tuple[Segment, SegmentSlot] | None:
        """The pipeline's source of buffers: a segment for ``batch``, or none yet."""
        with self._lock:
            self._raise_if_cancelled()
        slot = self._buffers.acquire(batch)
        return None if slot is None else (slot.segment, slot)

    def _wait_for_release(self) -> None:
        """The pipeline has no buffer for its next batch: wait, at most half a second, for what may
        free one (a rank's release, a segment made ahead) or for a cancel."""
        with self._lock:
            self._raise_if_cancelled()
            self._lock.wait(0.5)

    def _publish(self, load: Load) -> None:
        slot: SegmentSlot | None = load.token
        if slot is not None:
            self._buffers.keep(slot, load.batch.placements)
        with self._lock:
            self._raise_if_cancelled()
            segment = slot.segment if slot is not None else None
            # A kept segment is read by later loads too: ranks map it like a ring slot.
            dedicated = load.batch.kind is BatchKind.OVERSIZED and not slot.kept
            handles = [handle(load.index, segment, p.buffer_offset, p.tensor, dedicated) for p in load.batch.placements]
            handed, held = self._ledger.publish(load.index, handles, slot, leased=segment is not None)
            if handed:
                self._times.mark("first_ready")
            if not held and slot is not None:
                self._buffers.recycle(slot)
            self._lock.notify_all()

    def _raise_if_cancelled(self) -> None:
        if self._cancelled():
            raise Cancelled
