"""The embedded engine's slots: a :class:`~streamer_service.load.ring.Ring` over private host
buffers (page-locked ones from the process's pool for a device load), counting the memory they
hold in the engine's counters (:class:`~streamer_service.embedded.stats.EngineStats`).

A slot's tensors are either copied out (device loads), handed over (safe CPU loads: the slot is
retired and the caller's tensors keep its memory) or lent (``borrowed=True``: the slot comes back
only once no view of the caller's is alive, else ``BorrowedTensorError``).
"""

from __future__ import annotations

import functools
import weakref
from typing import TYPE_CHECKING

from streamer_client._leases import Leases

from ..load.ring import Ring
from .buffers import HostBuffer, PinnedPool

if TYPE_CHECKING:
    from .stats import EngineStats

__all__ = ["Slot", "Slots"]


class Slot:
    __slots__ = ("buffer", "leases")

    def __init__(self, buffer: HostBuffer) -> None:
        self.buffer = buffer
        # (tensor name, weakref to the numpy view a borrowed tensor was built on), since last filled.
        self.leases = Leases()


class Slots:
    """The engine's slots: :class:`~streamer_service.load.ring.Ring` over private buffers of ``slot_bytes``."""

    def __init__(self, slot_bytes: int, count: int, stats: EngineStats, pool: PinnedPool | None = None) -> None:
        self.slot_bytes = slot_bytes
        self.count = count
        self._stats = stats
        self.pool = pool  # device loads: slots come from and go back to the process's pinned pool
        self._ring: Ring[Slot | HostBuffer] = Ring(count)

    def acquire(self, nbytes: int | None = None) -> Slot | None:
        """A free slot, or ``None`` while every slot is in use. ``nbytes``: a new slot of exactly
        that size (at most ``slot_bytes``), for a batch whose buffer is handed over."""
        return self._ring.take(functools.partial(self._new_slot, self.slot_bytes if nbytes is None else nbytes))

    def _new_slot(self, nbytes: int) -> Slot:
        self._stats.allocated(nbytes)
        buffer = self.pool.take(nbytes) if self.pool is not None else None
        return Slot(buffer if buffer is not None else HostBuffer(nbytes))

    def acquire_oversized(self, nbytes: int) -> HostBuffer | None:
        """A dedicated buffer for an oversized tensor, or ``None`` while another one is out."""
        # CPU loads only: a device load reads oversized tensors in parts through its slots.
        buffer = self._ring.take(functools.partial(HostBuffer, nbytes), oversized=True)
        if buffer is not None:
            self._stats.allocated(nbytes)
        return buffer

    def release_oversized(self, buffer: HostBuffer) -> None:
        """The oversized buffer is handed over to the caller: no longer ours."""
        self._stats.released(buffer.nbytes)
        self._ring.give(buffer, oversized=True)

    def release(self, slot: Slot, in_hand: weakref.ref | None) -> None:
        """Take a delivered slot back; refuse (and never reuse it) while borrowed views live.

        ``in_hand`` is the view of the item yielded last, which the caller's loop variable
        legitimately still holds.
        """
        slot.leases.end(in_hand)
        self._ring.give(slot)

    def hand_over(self, slot: Slot) -> None:
        """The slot's tensors were delivered and keep its memory: no longer ours; a new slot
        takes its place."""
        self._stats.released(slot.buffer.nbytes)
        self._ring.retire(slot)

    def close(self) -> None:
        """Drop every slot (their memory goes once no view of the caller's holds it); with a
        pool, its page-locked slots stay there for the next load. Only once nothing reads into
        or copies out of them."""
        slots = self._ring.drain()
        self._stats.released(sum(slot.buffer.nbytes for slot in slots))
        if self.pool is not None:
            self.pool.give_back([slot.buffer for slot in slots])
