"""What every bench source is: a checkpoint location for the ranks with a storage-side byte
counter (:class:`Source`), and the bucket and prefix the object-storage sources upload it to.
The sources themselves are :mod:`.sources` and :mod:`.azurite`.
"""

from __future__ import annotations

import subprocess

from .latency import LatencyProxy

__all__ = ["BUCKET", "HOST", "PREFIX", "Source"]

HOST = "127.0.0.1"
BUCKET = "streamer-bench"
PREFIX = "checkpoint"


class Source:
    """A checkpoint location for the ranks, with a storage-side byte counter."""

    name = ""
    uri = ""
    env: dict[str, str] = {}
    proc: subprocess.Popen | None = None  # the server process, if this source runs one
    proxy: LatencyProxy | None = None  # between the readers and the server (``with_latency``)

    counted_by_readers = False  # True: the kernel counts the bytes, per reading process (local)

    def bytes_served(self) -> int | None:
        """Bytes the storage has sent so far (monotonic), or ``None`` where the server cannot say."""
        return None

    def describe(self) -> str:
        return self.name

    def close(self) -> None:
        if self.proxy is not None:
            self.proxy.close()
            self.proxy = None
