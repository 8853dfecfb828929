"""Batches of a plan in flight through a reader, delivered in plan order.

The reader is any :class:`~streamer_service.readers.base.Reader` (Run:ai's for object storage,
Run:ai's or the mapped reader for local files: ``readers.choice``).

The one loading loop, shared by the embedded engine (buffers are anonymous
memory, released as the caller iterates) and the daemon (buffers are
shared-memory segments, released when every rank is done with them):

- submit batches in plan order while the buffer source has room and the bytes submitted but not
  yet landed stay within ``in_flight`` (``sizing.in_flight_bytes``: what keeps storage busy for
  a request's latency); more would only make every batch land later, the head included. Run:ai
  serves the requests in flight side by side, so from object storage consecutive batches go in
  one request of up to ``sizing.submission_size`` (a batch is delivered once its own ranges
  landed, whatever the rest of its request does); from a local directory, one batch a request;
- wait for the head batch's ranges, submitting more as ranges land; a failed range fails the load, naming the
  file, the byte range and the tensors it held, and no tensor of that batch
  is delivered;
- confirm that the objects the batch was read from are still the version the
  plan was made from (``versions``, see ``checkpoint.versions``: its HEADs go out on checking
  threads as soon as the batch's last byte landed; until they answer, the loop goes on collecting
  the reads of the batches behind it and submitting what their landing made room for, so a
  HEAD's round trip holds up only its own batch): otherwise the load fails
  with ``ObjectChangedError`` and nothing of that batch is delivered;
- hand the loaded batch over; when nothing is in flight and no buffer is free,
  ask the caller to wait for a release.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from streamer_client._counters import Counters
from streamer_client.errors import StorageError

from ..checkpoint.plan import Batch, Plan
from ..readers.base import FileReads, RangeResult, Reader, ReadRange
from ..sizing import submission_size
from ..uri import StorageURI

__all__ = ["CHECK_POLL_S", "Buffer", "Load", "LoadStats", "Pipeline", "Versions", "naming_tensors"]

CHECK_POLL_S = 0.001
"""While the head batch waits for its version check, the loop waits this long at a time for its
answers, then as long for a read to land, and again: an answer or a read is seen this much late
at most (a local stat mostly answers within the first wait: a local head batch seldom waits for a
read)."""


class Versions(Protocol):
    """Checks of the objects a batch was read from (``checkpoint.versions.ObjectVersions``)."""

    def expect(self, batch: Batch, landed: float) -> None:
        """The batch's last byte landed at ``landed``: start what :meth:`check` will need."""

    def answered(self, batch: Batch, landed: float, wait_s: float) -> bool:
        """Whether :meth:`check` of the batch would find its answers in (and so not wait),
        waiting up to ``wait_s`` for them."""

    def check(self, batch: Batch, landed: float | None) -> None:
        """Raise when an object changed; ``landed=None``: ask afresh."""


class Buffer(Protocol):
    """Memory a reader may write into: ``nbytes`` at absolute address ``address``."""

    address: int
    nbytes: int


class LoadStats(Counters):
    bytes_read: int = 0  # written into our buffers by the reader
    submissions: int = 0
    peak_in_flight: int = 0  # submissions not yet landed in full, at most at once
    peak_in_flight_bytes: int = 0  # bytes submitted and not yet landed, at most at once
    first_submitted: float | None = None  # time.monotonic() of the first submission
    first_landed: float | None = None  # ... of the first range that landed
    last_landed: float | None = None  # ... of the last range that landed
    acquire_seconds: float = 0.0  # spent getting buffers (making a segment is the costly part)
    buffer_wait_seconds: float = 0.0  # nothing in flight and no buffer free: waiting for a release
    verify_seconds: float = 0.0  # head batches landed and waiting for their version checks (reads collected meanwhile)

    @property
    def read_seconds(self) -> float:
        """First submission to last byte landed: the storage-read span (waits for buffers included)."""
        if self.first_submitted is None or self.last_landed is None:
            return 0.0
        return self.last_landed - self.first_submitted

    def describe(self, started: float) -> str:
        """One line for the log: where a load's read time went (``started``: ``time.monotonic()`` when
        the load began)."""
        first = (self.first_landed - self.first_submitted) if self.first_landed and self.first_submitted else 0.0
        asked = (self.first_submitted - started) if self.first_submitted else 0.0
        return (
            f"first submission after {asked:.3f} s, {self.submissions} submissions, at most {self.peak_in_flight} ({self.peak_in_flight_bytes} bytes) in flight, "
            f"first bytes after {first:.3f} s, read span {self.read_seconds:.3f} s, "
            f"{self.acquire_seconds:.3f} s getting buffers, {self.buffer_wait_seconds:.3f} s waiting for a release, "
            f"{self.verify_seconds:.3f} s checking versions"
        )


class Load:
    """One batch on its way: its buffer (``None`` for a batch of empty tensors) and its progress.

    ``token`` is whatever the buffer source returned with the buffer (its slot), handed back to
    the caller with the loaded batch.
    """

    __slots__ = ("index", "batch", "buffer", "token", "remaining", "failed", "landed")

    def __init__(self, index: int, batch: Batch, buffer: Buffer | None, token: Any, remaining: int) -> None:
        self.index = index
        self.batch = batch
        self.buffer = buffer
        self.token = token
        self.remaining = remaining
        self.failed: RangeResult | None = None
        self.landed: float | None = None  # time.monotonic() when its last range answered

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
        versions: Versions | None = None,
        *,
        in_flight: int | None = None,
    ) -> None:
        self._uri = uri
        self._limit = in_flight  # None: as many bytes as the buffers hold
        # Bytes of one read request (a request holds whole batches, at least one).
        self._submission_bytes = submission_size(in_flight, local=uri.is_local)
        self._in_flight = 0  # bytes submitted and not yet landed
        self._failed = False  # a range failed: the load ends at its batch
        self._versions = versions
        self._reader = reader
        self._acquire = acquire
        self._stats = stats
        self._pending: deque[tuple[int, Batch]] = deque(enumerate(plan.batches))
        self._pending_bytes = sum(b.data_bytes for b in plan.batches)  # of the batches not yet taken
        self._loads: deque[Load] = deque()
        self._by_submission: dict[int, list[list[Load]]] = {}  # each range's load, by file and range index
        self._unanswered: dict[int, int] = {}  # ranges of each submission not answered yet

    def loaded(self, wait_for_buffer: Callable[[], None]) -> Iterator[Load]:
        """Each batch once loaded, in plan order. ``wait_for_buffer`` blocks until a release."""
        while self._pending or self._loads:
            self._fill()
            if not self._loads:
                waited = time.monotonic()
                wait_for_buffer()
                self._stats.buffer_wait_seconds += time.monotonic() - waited
                continue
            load = self._loads.popleft()
            self._wait_for(load)
            if load.failed is not None:
                if self._versions is not None and type(load.failed.error) is StorageError:
                    # Run:ai says only "file access error" for a refused, missing or changed object:
                    # one HEAD per file through the SDK says which, naming the credentials.
                    self._versions.check(load.batch, None)  # None: a fresh HEAD
                raise self._failure(load)
            if self._versions is not None and load.batch.ranges:
                checked, acquiring = time.monotonic(), self._stats.acquire_seconds
                self._collect_until_answered(load)
                self._versions.check(load.batch, load.landed)
                # Buffers taken meanwhile count as getting buffers, not as checking.
                self._stats.verify_seconds += time.monotonic() - checked - (self._stats.acquire_seconds - acquiring)
            yield load

    def _fill(self) -> None:
        """Take buffers for the next batches while one is free and the bound allows (a batch goes
        when nothing is in flight, or when its bytes fit under ``in_flight`` with what is), and
        submit them to the reader in requests of up to ``sizing.submission_size`` bytes: a few large
        requests keep Run:ai's workers as busy as many small ones with less ramp-up and tail per request."""
        if self._failed:
            return  # the load ends at the failed batch: nothing more is worth reading
        room = None if self._limit is None else self._limit - self._in_flight
        if self._in_flight and room is not None and room < min(self._submission_bytes, self._pending_bytes):
            return  # a request goes once a whole one fits: not one batch each time a range lands
        group: list[Load] = []
        grouped = 0
        while self._pending:
            index, batch = self._pending[0]
            if not batch.ranges:
                load = Load(index, batch, None, None, 0)
            else:
                ahead = self._in_flight + grouped
                if ahead and self._limit is not None and ahead + batch.data_bytes > self._limit:
                    break
                if group and grouped + batch.data_bytes > self._submission_bytes:
                    self._submit(group)
                    group, grouped = [], 0
                asked = time.monotonic()
                got = self._acquire(batch)
                self._stats.acquire_seconds += time.monotonic() - asked
                if got is None:
                    break
                buffer, token = got
                load = Load(index, batch, buffer, token, len(batch.ranges))
                group.append(load)
                grouped += batch.data_bytes
            self._pending.popleft()
            self._pending_bytes -= batch.data_bytes
            self._loads.append(load)
        if group:
            self._submit(group)

    def _submit(self, loads: list[Load]) -> None:
        files, owners = self._file_reads(loads)
        submission = self._reader.submit(files, keepalive=tuple(load.buffer for load in loads))
        self._by_submission[submission] = owners
        self._unanswered[submission] = sum(load.remaining for load in loads)
        self._in_flight += sum(load.batch.data_bytes for load in loads)
        if self._stats.first_submitted is None:
            self._stats.first_submitted = time.monotonic()
        self._stats.submissions += 1
        self._stats.peak_in_flight = max(self._stats.peak_in_flight, len(self._by_submission))
        self._stats.peak_in_flight_bytes = max(self._stats.peak_in_flight_bytes, self._in_flight)

    def _file_reads(self, loads: list[Load]) -> tuple[list[FileReads], list[list[Load]]]:
        """The batches' ranges grouped by file, as Run:ai takes them, with absolute destinations;
        and for each file the load each of its ranges belongs to (how an answer finds its batch)."""
        by_file: dict[str, tuple[list[ReadRange], list[Load]]] = {}
        for load in loads:
            for r in load.batch.ranges:
                reads, owners = by_file.setdefault(self._uri.child(r.file), ([], []))
                reads.append(ReadRange(r.offset, r.nbytes, load.buffer.address + r.buffer_offset))
                owners.append(load)
        return [FileReads(path, tuple(reads)) for path, (reads, _) in by_file.items()], [o for _, o in by_file.values()]

    def _wait_for(self, load: Load) -> None:
        while not load.done:
            result = self._reader.answer()
            if result is None:
                return
            self._record(result)
            # Room under the bound as ranges land: the next request goes out now, before the landed
            # batch waits for its version check and its hand-over, so storage keeps busy meanwhile.
            self._fill()

    def _collect_until_answered(self, load: Load) -> None:
        """While ``load``'s version check is out, record the reads that land behind it and submit
        what they make room for; return once the check answered or no read is owed."""
        while not self._versions.answered(load.batch, load.landed, CHECK_POLL_S):
            result = self._reader.answer(CHECK_POLL_S)
            if result is not None:
                self._record(result)
                self._fill()
            elif not self._reader.outstanding:
                return

    def _record(self, result: RangeResult) -> None:
        load = self._by_submission[result.submission][result.file_index][result.range_index]
        load.remaining -= 1
        self._in_flight -= result.range.nbytes
        if result.error is None:
            self._stats.bytes_read += result.range.nbytes
            self._stats.last_landed = time.monotonic()
            if self._stats.first_landed is None:
                self._stats.first_landed = self._stats.last_landed
        elif load.failed is None:
            load.failed = result
            self._failed = True
        if load.done:
            load.landed = time.monotonic()
            if self._versions is not None and load.failed is None:
                self._versions.expect(load.batch, load.landed)
        self._unanswered[result.submission] -= 1
        if not self._unanswered[result.submission]:
            del self._by_submission[result.submission], self._unanswered[result.submission]

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
        return naming_tensors(failed.error, names)


def naming_tensors(error: StorageError, names: list[str]) -> StorageError:
    """``error`` (a failed read) naming the tensors its range held (the first as its key)."""
    shown = ", ".join(repr(n) for n in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return type(error)(f"{error.message}; tensors {shown}", uri=error.uri, key=names[0] if names else None)
