"""The embedded engine's host buffers, and the page-locked ones a process keeps across loads.

:class:`HostBuffer` is private anonymous memory that Run:ai writes into (a ring slot, an oversized
tensor's buffer in a CPU load, or, for safe CPU tensors, memory handed to the caller).

:class:`PinnedPool`. A load to a CUDA device page-locks its ring slots
(``cudaHostRegister``) so that the copies run at the link rate; registering costs time for every
page, and unregistering at the end of the load costs again, a large part of a first load. The
pool keeps a load's slots, still
page-locked, when the load ends, and the next load in the process takes them instead of making
and registering new ones. The rules:

- a slot is page-locked once, when a load first copies out of it, never ahead of use: the first
  load pins exactly the slots it fills;
- a load takes an idle slot of exactly the size it needs (sizes repeat: the engine rounds device
  slots up to whole 2 MiB); it makes (and pins) new ones only for the rest;
- the pool keeps the slots of the last load that ended and no others: idle slots of another size
  are unpinned and unmapped then, so idle pinned memory stays within one load's buffer budget;
- a device load has no oversized buffer to keep: it reads an oversized tensor in parts through
  its slots (``engine``), so the pool holds slots only;
- idle slots are unpinned and unmapped after ``idle_s`` seconds (:data:`IDLE_S`) by a janitor
  thread that runs only while idle slots exist, and at :meth:`PinnedPool.close`.

What is pinned is counted (:class:`PoolStats`); the CUDA part is :class:`streamer_client._pinning.HostPinner`
(tests pass one over a fake runtime, so these rules are checked without a GPU).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np

from streamer_client._counters import Counters
from streamer_client._devices import device_context
from streamer_client._host_memory import anonymous
from streamer_client._per_process import PerProcess
from streamer_client._pinning import HostPinner

__all__ = ["IDLE_S", "HostBuffer", "PinnedPool", "PoolStats", "pinned_pool"]

IDLE_S = 30.0  # idle page-locked slots are given back after this long (a reload comes sooner)


class HostBuffer:
    """Anonymous page-aligned memory that Run:ai writes into.

    The numpy array holds a buffer export of the mmap, and every tensor built over it holds the
    array, so the mapping lives exactly as long as its last view. (``torch.frombuffer`` would
    not do: it holds no export, and the mapping could be closed under the tensor.)
    """

    __slots__ = ("array", "address", "nbytes", "__weakref__")

    def __init__(self, nbytes: int) -> None:
        # Private and advised for huge pages (streamer_client._host_memory): fresh buffers are
        # filled only as fast as their pages fault in.
        self.array = anonymous(nbytes)
        self.address = self.array.ctypes.data
        self.nbytes = nbytes

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        return self.array[offset : offset + nbytes]


class PoolStats(Counters):
    pinned: int = 0  # slots page-locked (registrations asked of CUDA)
    pinned_bytes: int = 0  # page-locked through the pool right now, idle or in use
    reused: int = 0  # slots a load took from the pool, already page-locked
    released: int = 0  # idle slots unpinned and unmapped (another size, idle too long, closed)
    idle: int = 0  # idle slots now
    idle_bytes: int = 0


class PinnedPool:
    """Page-locked ring slots kept across the loads of one process (see the module docstring).

    ``pinner``: the :class:`HostPinner` that registers (made on first use); ``clock`` for the idle
    time (tests pass their own).
    """

    def __init__(
        self,
        *,
        pinner: HostPinner | None = None,
        idle_s: float = IDLE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._pinner = pinner
        self.idle_s = idle_s
        self._clock = clock
        self._lock = threading.Lock()
        self._idle: list[HostBuffer] = []  # page-locked, no load uses them; all of one size
        self._idle_since = 0.0
        self._pinned: set[int] = set()  # addresses page-locked through the pool
        self._janitor: threading.Thread | None = None
        self._wake = threading.Event()
        self.stats = PoolStats()

    @property
    def pinner(self) -> HostPinner:
        if self._pinner is None:
            self._pinner = HostPinner()
        return self._pinner

    def take(self, nbytes: int) -> HostBuffer | None:
        """An idle page-locked slot of exactly ``nbytes``, or ``None`` (make one, then :meth:`pin`)."""
        with self._lock:
            for i, buffer in enumerate(self._idle):
                if buffer.nbytes == nbytes:
                    del self._idle[i]
                    self.stats.reused += 1
                    self._count_idle()
                    return buffer
        return None

    def pin(self, buffer: HostBuffer, device=None) -> bool:
        """Page-lock ``buffer`` once (a no-op for a slot the pool already pinned); whether it is.

        ``device``: the CUDA device whose context registers it (``None``: the current one).
        """
        with self._lock:
            if buffer.address in self._pinned:
                return True
        with device_context(device):
            pinned = self.pinner.pin(buffer.address, buffer.nbytes)
        if pinned:
            with self._lock:
                self._pinned.add(buffer.address)
                self.stats.pinned += 1
                self.stats.pinned_bytes += buffer.nbytes
        return pinned

    def idle_ranges(self) -> dict[int, int]:
        """``{address: nbytes}`` of the idle page-locked slots (for leak checks)."""
        with self._lock:
            return {b.address: b.nbytes for b in self._idle}

    def is_pinned(self, buffer: HostBuffer) -> bool:
        with self._lock:
            return buffer.address in self._pinned

    def give_back(self, buffers: list[HostBuffer]) -> None:
        """A load ended and no copy out of ``buffers`` is in flight: keep the page-locked ones idle.

        Idle slots of other sizes go (unpinned, unmapped): the pool keeps one load's ring.
        Slots that were never page-locked are not kept.
        """
        kept = [b for b in buffers if self.is_pinned(b)]
        sizes = {b.nbytes for b in kept}
        with self._lock:
            stale = [b for b in self._idle if b.nbytes not in sizes] if kept else []
            self._idle = [b for b in self._idle if b not in stale] + kept
            self._idle_since = self._clock()
            self._count_idle()
        self._release(stale)
        if kept:
            self._start_janitor()

    def sweep(self) -> int:
        """Release the idle slots if they have been idle ``idle_s``; how many went."""
        with self._lock:
            if not self._idle or self._clock() - self._idle_since < self.idle_s:
                return 0
            stale, self._idle = self._idle, []
            self._count_idle()
        self._release(stale)
        return len(stale)

    def close(self) -> None:
        """Release every idle buffer now (a load still running gives its own back when it ends)."""
        with self._lock:
            stale, self._idle = self._idle, []
            self._count_idle()
        self._release(stale)
        self._wake.set()

    def _release(self, buffers: list[HostBuffer]) -> None:
        for buffer in buffers:
            with self._lock:
                self._pinned.discard(buffer.address)
                self.stats.pinned_bytes -= buffer.nbytes
                self.stats.released += 1
            self.pinner.unpin(buffer.address)  # the mapping goes with the last reference to it

    def _count_idle(self) -> None:
        self.stats.idle = len(self._idle)
        self.stats.idle_bytes = sum(b.nbytes for b in self._idle)

    def _start_janitor(self) -> None:
        with self._lock:
            if self._janitor is not None:
                return
            self._wake.clear()
            self._janitor = threading.Thread(target=self._janitor_loop, name="streamer-pinned-pool", daemon=True)
            self._janitor.start()

    def _janitor_loop(self) -> None:
        while True:
            self._wake.wait(max(0.5, self.idle_s / 4))
            try:
                self.sweep()
            finally:
                with self._lock:
                    if not self._idle or self._wake.is_set():
                        self._janitor = None
                        return

    def __repr__(self) -> str:
        return f"PinnedPool(idle_s={self.idle_s}, {self.stats})"


_POOL: PerProcess[PinnedPool] = PerProcess(PinnedPool)


def pinned_pool() -> PinnedPool:
    """The process's pool (made on first use, never at import; a forked child makes its own)."""
    return _POOL.get()
