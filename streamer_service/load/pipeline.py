"""Batches of a plan in flight through a reader, delivered in plan order.

The reader is any :class:`~streamer_service.readers.base.Reader` (Run:ai's for object storage,
Run:ai's or the mapped reader for local files: ``readers.choice``).

The one loading loop, shared by the embedded engine (buffers are anonymous
memory, released as the caller iterates) and the daemon (buffers are
shared-memory segments, released when every rank is done with them):

- submit batches in plan order while the buffer source has room and the bytes submitted but not
  yet landed stay within ``in_flight`` (``sizing.in_flight_bytes``: what keeps storage busy for
  a request's latency); more would only make every batch land later, the head included;
- wait for the head batch's ranges, submitting more as ranges land; a failed range fails the load, naming the
  file, the byte range and the tensors it held, and no tensor of that batch
  is delivered;
- confirm that the objects the batch was read from are still the version the
  plan was made from (``verify``, see ``versions``): otherwise the load fails
  with ``ObjectChangedError`` and nothing of that batch is delivered;
- hand the loaded batch over; when nothing is in flight and no buffer is free,
  ask the caller to wait for a release.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from streamer_client.errors import StorageError

from ..checkpoint.plan import Batch, Plan
from ..readers.base import FileReads, RangeResult, ReadRange, Reader
from ..uri import StorageURI

__all__ = ["Buffer", "Load", "LoadStats", "Pipeline"]


class Buffer(Protocol):
    """Memory a reader may write into: ``nbytes`` at absolute address ``address``."""

    address: int
    nbytes: int


@dataclass
class LoadStats:
    bytes_read: int = 0  # written into our buffers by Run:ai
    submissions: int = 0
    peak_in_flight: int = 0  # submissions not yet landed in full, at most at once
    peak_in_flight_bytes: int = 0  # bytes submitted and not yet landed, at most at once
    first_submitted: float | None = None  # time.monotonic() of the first submission
    last_landed: float | None = None  # ... of the last range that landed

    @property
    def read_seconds(self) -> float:
        """First submission to last byte landed: the storage-read span (waits for buffers included)."""
        if self.first_submitted is None or self.last_landed is None:
            return 0.0
        return self.last_landed - self.first_submitted


@dataclass(eq=False)
class Load:
    """One batch on its way: its buffer (``None`` for a batch of empty tensors) and its progress.

    ``token`` is whatever the buffer source returned with the buffer (its slot), handed back to
    the caller with the loaded batch.
    """

    index: int
    batch: Batch
    buffer: Buffer | None
    token: Any
    remaining: int
    failed: RangeResult | None = None

    @property
    def done(self) -> bool:
        return self.remaining == 0


AcquireBuffer = Callable[[Batch], "tuple[Buffer, Any] | None"]
"""A buffer (and a token) for a batch with ranges, or ``None`` while none is free."""


class Pipeline:
    def __init__(
        self,
        uri: StorageURI,
        plan: Plan,
        reader: Reader,
        acquire: AcquireBuffer,
        stats: LoadStats,
        verify: Callable[[Batch], None] | None = None,
        *,
        in_flight: int | None = None,
    ) -> None:
        self._uri = uri
        self._limit = in_flight  # None: as many bytes as the buffers hold
        self._in_flight = 0  # bytes submitted and not yet landed
        self._verify = verify
        self._reader = reader
        self._acquire = acquire
        self._stats = stats
        self._pending: deque[tuple[int, Batch]] = deque(enumerate(plan.batches))
        self._loads: deque[Load] = deque()
        self._by_submission: dict[int, Load] = {}

    def loaded(self, wait_for_buffer: Callable[[], None]) -> Iterator[Load]:
        """Each batch once loaded, in plan order. ``wait_for_buffer`` blocks until a release."""
        while self._pending or self._loads:
            self._fill()
            if not self._loads:
                wait_for_buffer()
                continue
            load = self._loads.popleft()
            self._wait_for(load)
            if load.failed is not None:
                if self._verify is not None and type(load.failed.error) is StorageError:
                    # Run:ai says only "file access error" for a refused, missing or changed object:
                    # one HEAD per file through the SDK says which, naming the credentials.
                    self._verify(load.batch)
                raise self._failure(load)
            if self._verify is not None and load.batch.ranges:
                self._verify(load.batch)
            yield load

    def _fill(self) -> None:
        """Submit the next batches while a buffer is free and the bound allows: a batch goes when
        nothing is in flight, or when its bytes fit under ``in_flight`` with what is."""
        while self._pending:
            index, batch = self._pending[0]
            if not batch.ranges:
                load = Load(index, batch, None, None, 0)
            else:
                if self._in_flight and self._limit is not None and self._in_flight + batch.data_bytes > self._limit:
                    return
                got = self._acquire(batch)
                if got is None:
                    return
                buffer, token = got
                load = Load(index, batch, buffer, token, len(batch.ranges))
                self._submit(load)
            self._pending.popleft()
            self._loads.append(load)

    def _submit(self, load: Load) -> None:
        submission = self._reader.submit(self._file_reads(load), keepalive=load.buffer)
        self._by_submission[submission] = load
        self._in_flight += load.batch.data_bytes
        if self._stats.first_submitted is None:
            self._stats.first_submitted = time.monotonic()
        self._stats.submissions += 1
        self._stats.peak_in_flight = max(self._stats.peak_in_flight, len(self._by_submission))
        self._stats.peak_in_flight_bytes = max(self._stats.peak_in_flight_bytes, self._in_flight)

    def _file_reads(self, load: Load) -> list[FileReads]:
        """The batch's ranges grouped by file, as Run:ai takes them, with absolute destinations."""
        by_file: dict[str, list[ReadRange]] = {}
        for r in load.batch.ranges:
            read = ReadRange(r.offset, r.nbytes, load.buffer.address + r.buffer_offset)
            by_file.setdefault(self._uri.child(r.file), []).append(read)
        return [FileReads(path, tuple(reads)) for path, reads in by_file.items()]

    def _wait_for(self, load: Load) -> None:
        if load.done:
            return
        for result in self._reader.responses():
            self._record(result)
            if load.done:
                return
            self._fill()  # room under the bound as ranges land: storage keeps busy meanwhile

    def _record(self, result: RangeResult) -> None:
        load = self._by_submission[result.submission]
        load.remaining -= 1
        self._in_flight -= result.range.nbytes
        if result.error is None:
            self._stats.bytes_read += result.range.nbytes
            self._stats.last_landed = time.monotonic()
        elif load.failed is None:
            load.failed = result
        if load.done:
            del self._by_submission[result.submission]

    def _failure(self, load: Load) -> StorageError:
        """The storage error of a failed batch, naming the tensors the failed range held."""
        failed = load.failed
        names = [
            p.tensor.name
            for p in load.batch.placements
            if p.tensor.nbytes
            and self._uri.child(p.tensor.file) == failed.path
            and p.tensor.offset < failed.range.end
            and p.tensor.end > failed.range.offset
        ]
        shown = ", ".join(repr(n) for n in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        error = failed.error
        return type(error)(f"{error.message}; tensors {shown}", uri=error.uri, key=names[0] if names else None)
