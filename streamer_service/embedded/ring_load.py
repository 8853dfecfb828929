"""A load read into the engine's ring: a reader's ranged reads straight into our buffers, tensors
built over them, in plan order (:func:`through_ring`).

Every batch of the plan gets a buffer we allocated; the reader (Run:ai's, or the mapped reader
for a CPU load of a local directory) writes each range directly into it, with no copy through
Python. A load to a CUDA device reads this way where Run:ai reads it (object storage,
``STREAMER_LOCAL_READER=runai``, an operator's ``RUNAI_STREAMER_FS_STRATEGY``); a local
directory's is staged from its mappings instead (:mod:`~streamer_service.embedded.staged`).

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
  use) and reused, across loads too: when a load ends its slots stay page-locked in the process's
  :class:`~streamer_service.embedded.buffers.PinnedPool` for the next load (slot sizes
  rounded up to whole 2 MiB so that they repeat);
  each batch's copies are queued ``non_blocking`` on the stream's own CUDA
  stream (:class:`streamer_client._cuda.PinnedCopier`), overlapping the reads
  into other slots, and the caller's current stream waits for them before the
  first tensor is yielded. A slot goes back to the ring only once its copies
  have completed. An oversized tensor is read in parts of a slot each, each
  part copied to its place in the device tensor, which is yielded with its
  last part: no host buffer of its size is made, filled and page-locked.
- ``borrowed=True``: zero-copy CPU views into the ring, valid only until the
  next item is requested. When a slot is about to be reused, every view
  handed out from it must be gone; if the caller kept one,
  :class:`BorrowedTensorError` is raised instead of overwriting it. Blind spot:
  the item yielded last cannot be told apart from the caller's loop variable,
  which still holds it, so keeping only that one is not detected.
"""

from __future__ import annotations

import functools
import weakref
from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from streamer_client import _delivery as delivery
from streamer_client._cuda import PinnedCopier
from streamer_client._dtypes import torch_layout

from ..checkpoint.plan import Batch, BatchKind, Part, Placement, Plan, build_plan, in_parts
from ..load.pipeline import Load, Pipeline, Versions
from ..readers.base import Reader, ReaderFactory
from ..readers.choice import open_reader
from ..sizing import ring_slots
from ..uri import StorageURI
from .buffers import HostBuffer, PinnedPool, pinned_pool
from .slots import Slot, Slots

if TYPE_CHECKING:
    from .stats import EngineStats

__all__ = ["DEVICE_RING_BYTES", "DEVICE_SLOT_BYTES", "ring_for", "through_ring"]

_SLOT_GRANULE = 2 * 1024 * 1024  # device ring slots come in whole huge pages (see _device_slot_bytes)

DEVICE_SLOT_BYTES = 64 * 1024**2
DEVICE_RING_BYTES = 256 * 1024**2
"""A device load reads through slots of at most ``DEVICE_SLOT_BYTES``, at most ``DEVICE_RING_BYTES``
of them (four), whatever the budget and slot size. The copies drain a slot at the link rate, so a
few keep the reads busy; small slots start the first copy early and end the last one soon after
the last read; and page-locking is a first load's largest cost, paid for every byte of the ring.
The sizes were chosen by measurement on GPU hosts: larger and smaller rings or slots were
slower."""


def through_ring(
    uri: StorageURI,
    plan: Plan,
    device: torch.device,
    borrowed: bool,
    factory: ReaderFactory,
    stats: EngineStats,
    versions: Versions | None = None,
    pool: PinnedPool | None = None,
    *,
    budget: int,
    in_flight: int | None = None,
    environment: dict[str, str] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of every tensor of ``plan`` from ``uri``, in plan order, through a ring of
    the load's own within ``budget`` bytes, read by a reader of ``factory`` (with Run:ai's storage
    ``environment``; at most ``in_flight`` bytes asked for and not landed), to ``device`` (see the
    module docstring). Its counters go to ``stats`` (the engine's); ``pool``: a device load's
    page-locked slots (default: the process's pool)."""
    pool = (pool or pinned_pool()) if device.type == "cuda" else None
    plan, ring = ring_for(plan, budget, stats, pool)
    stream = _Stream(uri, plan, ring, stats, device, borrowed, versions, in_flight)
    try:
        with open_reader(uri, factory, environment) as reader:
            yield from stream.run(reader)
    finally:
        stream.close()  # after runai_end: only now is no read in flight into any of these buffers


def ring_for(plan: Plan, budget: int, stats: EngineStats, pool: PinnedPool | None) -> tuple[Plan, Slots]:
    """The plan as a load reads it, and its ring within ``budget`` (``pool``: a device load's
    page-locked slots)."""
    slot_bytes = plan.slot_bytes
    if pool is not None:
        if plan.slot_size > DEVICE_SLOT_BYTES:  # the same tensors in the same order, in smaller slots
            plan = build_plan(plan.tensors, DEVICE_SLOT_BYTES, align=plan.align)
        slot_bytes = _device_slot_bytes(plan)
        plan = in_parts(plan, slot_bytes)
    slot_batches = sum(b.kind is BatchKind.SLOT and b.buffer_bytes > 0 for b in plan.batches)
    # A device ring: at most DEVICE_RING_BYTES, but two slots (one filling, one copying).
    count = ring_slots(budget, slot_bytes, slot_batches, cap_bytes=DEVICE_RING_BYTES if pool is not None else None)
    return plan, Slots(slot_bytes, count, stats, pool)


def _device_slot_bytes(plan: Plan) -> int:
    # Oversized tensors pass through the slots in parts: then slots are as large as allowed.
    slot_bytes = plan.slot_size if plan.oversized_bytes else plan.slot_bytes
    if slot_bytes:
        # Whole 2 MiB, so that the next load's slots have the same size and the pinned pool's
        # idle slots fit it; never past the plan's slot size (so never past the budget).
        slot_bytes = max(slot_bytes, min(-(-slot_bytes // _SLOT_GRANULE) * _SLOT_GRANULE, plan.slot_size))
    return slot_bytes


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
                    self._partial = copier.empty(*torch_layout(info.dtype, info.shape))
                pieces.append((placement.buffer_offset, placement.nbytes, self._partial, placement.start))
                if placement.last:  # the tensor is yielded with its last part
                    copies.append((info.name, self._partial))
                    self._partial = None
            else:
                out = copier.empty(*torch_layout(info.dtype, info.shape))
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
