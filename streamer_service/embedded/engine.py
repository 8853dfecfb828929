"""The embedded engine: plan -> Run:ai reads straight into our buffers -> tensors, in one process.

Data path (docs/architecture.md): every batch of the plan gets a buffer we allocated;
Run:ai's native reader writes each range directly into it (no copy through
Python); tensors are built over those bytes in plan order. A load of a local
directory to a CUDA device, where the mapped reader is chosen
(:mod:`~streamer_service.readers.choice`), has no ring and no reader: its tensors
are copied from the files' mappings through the process's small staging ring to
the device, as a daemon's rank copies from its segments
(:mod:`~streamer_service.embedded.staged`). Everything below is the ring's.

Buffers:

- A ring of at most ``budget // slot_bytes`` slots, allocated lazily, each as
  large as the plan's largest slot batch (at most ``slot_size``; safe CPU loads:
  each batch's own size). Slots are :class:`~streamer_service.embedded.buffers.HostBuffer` s,
  private anonymous ``mmap`` s: page-aligned (so the plan's range alignment
  holds in memory), backed by transparent huge pages where the kernel allows
  (fresh memory is filled only as fast as it can be faulted in), and returned
  to the OS as soon as the last view of them is gone (freed malloc blocks can
  linger in the RSS).
- An oversized tensor gets a dedicated buffer of its own; at most one is
  engine-owned at a time, so buffer memory stays within ``budget`` plus one
  oversized tensor. ``stats.peak_buffer_bytes`` measures exactly that. A
  device load has none: its oversized tensors pass through ring slots in
  parts (below).

In flight: batches are submitted in plan order as long as a buffer is free,
so up to ``budget // slot_bytes`` Run:ai submissions (plus one oversized) run
concurrently; a slot is refilled as soon as its batch has been delivered.
Batches complete in any order; they are delivered in plan order.

Delivery modes (safe by default; docs/architecture.md):

- default (CPU): Run:ai reads each batch straight into memory the caller
  keeps, as Run:ai's own ``owned=True`` does: a slot is a fresh buffer of the
  batch's size, its tensors are views over it, and once they are delivered the
  ring retires the slot (its memory is the caller's now) and makes a new one
  for a later batch. No copy; the memory in flight stays within the budget
  (``stats.buffer_bytes`` counts buffers until they are handed over). A kept
  tensor keeps its batch's buffer (at most ``slot_size``) alive until every
  tensor of that batch is gone: ``clone()`` one tensor kept alone for long.
  Oversized tensors are handed over the same way.
- ``device="cuda:N"``: the load reads through at most four slots of at most
  64 MiB (:data:`DEVICE_RING_BYTES`: the copies drain them at the link rate,
  and page-locking more only slows a first load), planned anew in those slots
  when the configured slot size is larger; they are page-locked once (first
  use) and reused,
  across loads too: when a load ends its slots stay page-locked in the process's
  :class:`~streamer_service.embedded.buffers.PinnedPool` for the next load (slot sizes
  rounded up to whole 2 MiB so that they repeat);
  each batch's copies are queued ``non_blocking`` on the stream's own CUDA
  stream (:class:`streamer_client.cuda.PinnedCopier`), overlapping the reads
  into other slots, and the caller's current stream waits for them before the
  first tensor is yielded. A slot goes back to the ring only once its copies
  have completed. An oversized tensor is read in parts of a slot each, each
  part copied to its place in the device tensor, which is yielded with its
  last part: no host buffer of its size is made, filled and page-locked (for
  a 1 GiB embedding that was a fresh GiB faulted in and pinned by every first
  load: InstantTensor stages through 96 MiB).
- ``borrowed=True``: zero-copy CPU views into the ring, valid only until the
  next item is requested. When a slot is about to be reused, every view
  handed out from it must be gone; if the caller kept one,
  :class:`BorrowedTensorError` is raised instead of overwriting it. Blind spot:
  the item yielded last cannot be told apart from the caller's loop variable,
  which still holds it, so keeping only that one is not detected.
"""

from __future__ import annotations

import functools
import mmap
import weakref
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from streamer_client import delivery
from streamer_client.cuda import PinnedCopier
from streamer_client.dtypes import torch_dtype
from streamer_client.errors import BorrowedTensorError, CheckpointError, ConfigError
from streamer_client.request import target

from ..checkpoint.catalog import Catalog
from ..checkpoint.plan import DEFAULT_ALIGN, Batch, BatchKind, Part, Placement, Plan, build_plan, in_parts
from ..checkpoint.plan import select as select_tensors
from ..checkpoint.versions import ObjectVersions
from ..load.pipeline import Load, Pipeline, Versions
from ..readers.base import Reader, ReaderFactory
from ..readers.choice import open_reader, reader_for, reads_mappings
from ..readers.runai import storage_environment
from ..settings import Settings
from ..sizing import in_flight_bytes, ring_slots, slot_bytes
from ..uri import StorageURI
from .buffers import HostBuffer, PinnedPool, pinned_pool
from .slots import EngineStats, Slot, Slots

__all__ = [
    "BorrowedTensorError",
    "EmbeddedEngine",
    "EngineConfig",
    "EngineStats",
]


@dataclass(frozen=True)
class EngineConfig:
    """What one engine may use: ``budget`` bytes of buffers in slots of at most ``slot_size``."""

    budget: int
    slot_size: int
    align: int = DEFAULT_ALIGN
    storage_environment: tuple[tuple[str, str], ...] = ()  # Run:ai's retry/timeout variables
    local_reader: str = "mapped"  # Settings.local_reader: how local files are read (readers.choice.reader_for)
    in_flight: int | None = None  # bytes submitted to storage and not yet landed, at most (sizing.in_flight_bytes)

    def __post_init__(self) -> None:
        if not isinstance(self.budget, int) or self.budget <= 0:
            raise ConfigError(f"buffer budget must be a positive number of bytes, got {self.budget!r}")
        if not isinstance(self.slot_size, int) or not 0 < self.slot_size <= self.budget:
            raise ConfigError(f"slot size must be positive and at most the budget ({self.budget}), got {self.slot_size!r}")
        if self.align <= 0 or self.align & (self.align - 1) or mmap.PAGESIZE % self.align:
            # Buffers are page-aligned mmaps, so congruence holds for any power of two up to a page.
            raise ConfigError(f"alignment must be a power of two dividing {mmap.PAGESIZE}, got {self.align!r}")
        if self.slot_size < self.align:
            # A device load reads an oversized tensor in parts of a slot, each but the first aligned.
            raise ConfigError(f"slot size must be at least the alignment ({self.align} bytes), got {self.slot_size!r}")

    @classmethod
    def from_settings(cls, settings: Settings) -> EngineConfig:
        """The settings' budget and slot size (shrunk as ``sizing.slot_bytes`` says), and the bytes in
        flight for the NIC rate."""
        budget = int(settings.shm_budget)
        slot = slot_bytes(budget, int(settings.slot_size))
        return cls(
            budget=budget,
            slot_size=slot,
            in_flight=in_flight_bytes(settings.target_gbps, slot, budget),
            storage_environment=tuple(storage_environment(settings).items()),
            local_reader=settings.local_reader,
        )


_SLOT_GRANULE = 2 * 1024 * 1024  # device ring slots come in whole huge pages (see _device_slot_bytes)

DEVICE_SLOT_BYTES = 64 * 1024**2
DEVICE_RING_BYTES = 256 * 1024**2
"""A device load reads through slots of at most ``DEVICE_SLOT_BYTES``, at most ``DEVICE_RING_BYTES``
of them (four), whatever the budget and slot size. The copies drain a slot at the link rate
(55 GB/s on an H200: 1.2 ms per 64 MiB), so a few keep the reads busy; small slots start the
first copy early and end the last one soon after the last read; and page-locking is a first
load's largest cost (0.07 s/GiB on an H200 host: the whole 4 GiB default ring took 0.37 s of a
1.2 s first load). Measured on an H200 host, 6.44 GB from tmpfs (docs/benchmarks.md):
with 4 x 64 MiB a process's first load ran at 25-30 GB/s and its reloads at 30-36, against 13-15
and 31-33 with 4 x 256 MiB; smaller rings or slots were slower."""


class EmbeddedEngine:
    """Streams one checkpoint's tensors in-process (no daemon, no shared memory).

    Each :meth:`stream` has its own ring and reader and may use the whole budget: run one at a
    time to stay within it. ``reader_factory`` builds the reader (keyword arguments
    ``fs_strategy`` and ``environment``; default: for a load to a CUDA device
    :func:`~streamer_service.readers.choice.reader_for` the URI, else Run:ai's); tests may replace it. A
    device load whose reader would be the mapped reader is staged from the files' mappings instead
    (:mod:`~streamer_service.embedded.staged`). ``versions`` checks each loaded batch's objects
    against the catalog's versions before delivery.
    """

    def __init__(
        self,
        uri: StorageURI,
        catalog: Catalog,
        config: EngineConfig,
        *,
        reader_factory: ReaderFactory | None = None,
        versions: ObjectVersions | None = None,
        pool: PinnedPool | None = None,
    ) -> None:
        self.uri = uri
        self.catalog = catalog
        self.config = config
        self._versions = versions
        self.stats = EngineStats()
        self._reader_factory = reader_factory  # None: readers.choice.reader_for the URI and the device
        self._pool = pool  # page-locked slots of CUDA loads (default: the process's pool)

    def plan(self, select: list[str] | None = None, priority: list[str] | None = None) -> Plan:
        """Select (names / prefixes, see :func:`streamer_service.checkpoint.plan.select`) and plan for this
        engine's slots. Raises :class:`SelectionError` without reading anything."""
        tensors = select_tensors(self.catalog.tensors, select, priority)
        return build_plan(tensors, self.config.slot_size, align=self.config.align)

    def stream(
        self, plan: Plan, *, device: str | torch.device = "cpu", borrowed: bool = False
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` for every tensor of ``plan``, in plan order.

        Arguments are checked here, before anything is read; reading starts at the first ``next``.
        A storage failure raises the :class:`StorageError` Run:ai reported, naming the file and
        byte range; no tensor of the failed batch is yielded.
        """
        device = target(device, borrowed)
        self._check_plan(plan)
        return self._run(plan, device, borrowed)

    def _check_plan(self, plan: Plan) -> None:
        if plan.slot_size > self.config.slot_size:
            raise ConfigError(f"plan has slots of {plan.slot_size} bytes but this engine's slot size is {self.config.slot_size}")
        if mmap.PAGESIZE % plan.align:
            raise ConfigError(f"plan alignment {plan.align} does not divide the page size {mmap.PAGESIZE}")
        for tensor in plan.tensors:
            try:
                torch_dtype(tensor.dtype)
            except TypeError as exc:
                raise CheckpointError(f"tensor {tensor.name!r}: {exc}", key=tensor.name) from None

    def _run(self, plan: Plan, device: torch.device, borrowed: bool) -> Iterator[tuple[str, torch.Tensor]]:
        factory = self._reader_factory
        if factory is None:  # a CPU load's tensors are the bytes read: into the caller's memory
            factory = reader_for(self.uri, self.config.local_reader, into_callers_memory=device.type != "cuda")
        try:
            if device.type == "cuda" and reads_mappings(factory):
                # Local files to a device: staged from their mappings, no ring of ours.
                from .staged import StagedFiles

                yield from StagedFiles(self.uri, plan, device, self.stats, self._versions).run()
            else:
                yield from self._through_ring(plan, device, borrowed, factory)
        finally:
            if self._versions is not None:
                self._versions.close()

    def _through_ring(
        self, plan: Plan, device: torch.device, borrowed: bool, factory: ReaderFactory
    ) -> Iterator[tuple[str, torch.Tensor]]:
        pool = (self._pool or pinned_pool()) if device.type == "cuda" else None
        plan, ring = self._ring_for(plan, pool)
        stream = _Stream(self.uri, plan, ring, self.stats, device, borrowed, self._versions, self.config.in_flight)
        try:
            with open_reader(self.uri, factory, dict(self.config.storage_environment)) as reader:
                yield from stream.run(reader)
        finally:
            stream.close()  # after runai_end: only now is no read in flight into any of these buffers

    def _ring_for(self, plan: Plan, pool: PinnedPool | None) -> tuple[Plan, Slots]:
        """The plan as this load reads it, and its ring (``pool``: a device load's page-locked slots)."""
        slot_bytes = plan.slot_bytes
        if pool is not None:
            if plan.slot_size > DEVICE_SLOT_BYTES:  # the same tensors in the same order, in smaller slots
                plan = build_plan(plan.tensors, DEVICE_SLOT_BYTES, align=plan.align)
            slot_bytes = self._device_slot_bytes(plan)
            plan = in_parts(plan, slot_bytes)
        slot_batches = sum(b.kind is BatchKind.SLOT and b.buffer_bytes > 0 for b in plan.batches)
        # A device ring: at most DEVICE_RING_BYTES, but two slots (one filling, one copying).
        count = ring_slots(
            self.config.budget, slot_bytes, slot_batches, cap_bytes=DEVICE_RING_BYTES if pool is not None else None
        )
        return plan, Slots(slot_bytes, count, self.stats, pool)

    @staticmethod
    def _device_slot_bytes(plan: Plan) -> int:
        # Oversized tensors pass through the slots in parts: then slots are as large as allowed.
        slot_bytes = plan.slot_size if plan.oversized_bytes else plan.slot_bytes
        if slot_bytes:
            # Whole 2 MiB, so that the next load's slots have the same size and the pinned pool's
            # idle slots fit it; never past the plan's slot size (so never past the budget).
            slot_bytes = max(slot_bytes, min(-(-slot_bytes // _SLOT_GRANULE) * _SLOT_GRANULE, plan.slot_size))
        return slot_bytes

    def __repr__(self) -> str:
        return f"EmbeddedEngine({self.uri.normalized!r}, {self.config}, {self.stats})"


# --------------------------------------------------------------------------- one stream


class _Stream:
    """Keeps batches in flight as buffers allow; delivers their tensors in plan order."""

    def __init__(
        self,
        uri: StorageURI,
        plan: Plan,
        ring: Slots,
        stats: EngineStats,
        device: torch.device,
        borrowed: bool,
        versions: Versions | None = None,
        in_flight: int | None = None,
    ) -> None:
        self._uri = uri
        self._versions = versions
        self._in_flight = in_flight
        self._ring = ring
        self._stats = stats
        self._device = device
        self._borrowed = borrowed
        self._plan = plan
        self._oversized: HostBuffer | None = None  # the one engine-owned dedicated buffer (CPU loads)
        self._partial: torch.Tensor | None = None  # a device tensor arriving in parts
        self._in_hand: weakref.ref | None = None
        self._copier = PinnedCopier(device) if device.type == "cuda" else None
        # Safe CPU tensors are views over a buffer the caller keeps (no copy out of a reused slot).
        self._hand_over = device.type == "cpu" and not borrowed

    def run(self, reader: Reader) -> Iterator[tuple[str, torch.Tensor]]:
        if self._copier is not None:
            delivery.reserve(self._device, [t.nbytes for t in self._plan.tensors])
        pipeline = Pipeline(self._uri, self._plan, reader, self._acquire, self._stats, self._versions, in_flight=self._in_flight)
        for load in pipeline.loaded(self._wait_for_buffer):
            yield from self._deliver(load)
            if load.token is None or self._copier is not None:  # device copies release their own
                continue
            if self._hand_over:
                self._ring.hand_over(load.token)
            else:
                self._ring.release(load.token, self._in_hand)

    def close(self) -> None:
        copier, self._copier = self._copier, None
        self._partial = None
        try:
            if copier is not None:
                copier.close()  # waits for copies in flight, recycles their buffers
        finally:
            if self._oversized is not None:
                self._ring.release_oversized(self._oversized)
                self._oversized = None
            self._ring.close()

    # -------------------------------------------------------------- buffers

    def _acquire(self, batch: Batch) -> tuple[HostBuffer, Slot | None] | None:
        if batch.kind is BatchKind.SLOT:
            slot = self._ring.acquire(batch.buffer_bytes if self._hand_over else None)
            if slot is None and self._copier is not None:
                self._copier.poll()  # slots whose device copies have completed go back to the ring
                slot = self._ring.acquire()
            return None if slot is None else (slot.buffer, slot)
        buffer = self._ring.acquire_oversized(batch.buffer_bytes)
        if buffer is None:  # the one oversized buffer is out
            return None
        self._oversized = buffer
        return buffer, None

    def _wait_for_buffer(self) -> None:
        # With device copies every buffer may be waiting for its copies: wait for the oldest.
        if self._copier is not None and self._copier.wait_one():
            return
        # CPU delivery releases each buffer before the next batch is asked for.
        raise RuntimeError("engine bug: no batch in flight and none could be given a buffer")

    # -------------------------------------------------------------- delivery

    def _deliver(self, load: Load) -> Iterator[tuple[str, torch.Tensor]]:
        if self._copier is not None:
            yield from self._deliver_to_device(load)
            return
        for placement in load.batch.placements:
            tensor = self._materialize(load, placement)
            self._stats.tensors += 1
            yield placement.tensor.name, tensor
            del tensor  # hold no reference of ours while the caller works
        if load.batch.kind is BatchKind.OVERSIZED:
            # Handed over (CPU) or copied (device): no longer ours either way.
            self._ring.release_oversized(load.buffer)
            self._oversized = None

    def _deliver_to_device(self, load: Load) -> Iterator[tuple[str, torch.Tensor]]:
        """Queue every copy of the batch in one pass, fence them, hand the slot back once they completed."""
        copier = self._copier
        copies: deque[tuple[str, torch.Tensor]] = deque()
        pieces: list[tuple[int, int, torch.Tensor, int]] = []  # (offset in the buffer, bytes, tensor, offset in it)
        for placement in load.batch.placements:
            info = placement.tensor
            if load.buffer is None:  # empty tensors: no bytes were read
                copies.append((info.name, delivery.empty(info.dtype, info.shape, self._device)))
                continue
            if isinstance(placement, Part):
                if placement.start == 0:
                    self._partial = copier.empty(torch_dtype(info.dtype), info.shape)
                pieces.append((placement.buffer_offset, placement.nbytes, self._partial, placement.start))
                if placement.last:  # the tensor is yielded with its last part
                    copies.append((info.name, self._partial))
                    self._partial = None
            else:
                out = copier.empty(torch_dtype(info.dtype), info.shape)
                pieces.append((placement.buffer_offset, info.nbytes, out, 0))
                copies.append((info.name, out))
        if pieces:
            self._ring.pool.pin(load.buffer, self._device)  # once per slot and process: a lookup after that
            copier.copy_pieces(torch.from_numpy(load.buffer.array), pieces)
            self._stats.bytes_copied += sum(n for _, n, _, _ in pieces)
            pieces.clear()
        fence = copier.fence()  # the caller's stream waits for these copies; the host does not
        if load.token is not None:
            copier.release_after(functools.partial(self._ring.release, load.token, None), fence)
        while copies:
            name, tensor = copies.popleft()
            self._stats.tensors += 1
            yield name, tensor
            del tensor

    def _materialize(self, load: Load, placement: Placement) -> torch.Tensor:
        """A CPU tensor of ``placement`` (device loads: :meth:`_deliver_to_device`)."""
        info = placement.tensor
        if load.buffer is None:  # empty tensor: no bytes were read
            return delivery.empty(info.dtype, info.shape, self._device)
        view = load.buffer.view(placement.buffer_offset, info.nbytes)
        if self._borrowed and load.batch.kind is not BatchKind.OVERSIZED:
            tensor, self._in_hand = delivery.lend(load.token.leases, info.name, view, info.dtype, info.shape)
            return tensor
        # CPU: a buffer handed over, or an oversized tensor's own: never reused, no copy needed.
        return delivery.over(view, info.dtype, info.shape)
