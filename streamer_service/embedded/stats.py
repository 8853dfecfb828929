"""The embedded engine's counters, over all its loads: those of its reads (``LoadStats``) and of
the buffers and copies of its own."""

from __future__ import annotations

from ..load.pipeline import LoadStats

__all__ = ["EngineStats"]


class EngineStats(LoadStats):
    """Counters of one engine, over all its streams (reads and submissions: :class:`LoadStats`)."""

    buffer_bytes: int = 0  # engine-owned buffer bytes right now
    peak_buffer_bytes: int = 0
    bytes_copied: int = 0  # copied out of ring slots or the files' mappings to a device (safe CPU tensors are handed over)
    tensors: int = 0

    def allocated(self, nbytes: int) -> None:
        self.buffer_bytes += nbytes
        self.peak_buffer_bytes = max(self.peak_buffer_bytes, self.buffer_bytes)

    def released(self, nbytes: int) -> None:
        self.buffer_bytes -= nbytes
