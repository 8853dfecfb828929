"""Segment generations: the fence a rank checks after it copied a batch's bytes (the seqlock pattern).

Each live segment of a daemon has an entry in one generations table, a file in the shm dir beside
the segments (``streamer-<daemon pid>-<instance token>.generations``: an array of
:data:`TABLE_ENTRIES` little-endian u64, sparse). Before the daemon writes new bytes into a
segment it writes a fresh value from one daemon-wide counter into the segment's entry
(:meth:`Generations.bump`); a handle names the entry and the value it was issued under. A rank
maps the table read-only and compares the two after its copy and before it yields: a value that
changed means the bytes may be another batch's, and the rank raises instead of yielding them. The
counter never repeats, so an entry reused by another segment never matches an old handle.

The file exists while the daemon has a live segment: made with the first, unlinked with the last,
so an idle daemon's shm dir is empty. A table made again is a new file of the same name; the
counter goes on, so a rank that still maps the old one sees a mismatch and maps the new one
(``streamer_client._fence``) before it decides.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np

from streamer_client.errors import ConfigError

__all__ = ["TABLE_ENTRIES", "TABLE_SUFFIX", "Generations"]

TABLE_ENTRIES = 2**17
"""Live segments a daemon may have at once (the table is 1 MiB, sparse: only pages written take memory)."""

TABLE_SUFFIX = ".generations"


class Generations:
    """One daemon's generations table at ``shm_dir / name`` (see the module docstring). Thread-safe."""

    def __init__(
        self, shm_dir: Path, name: str, mode: int = 0o600, entries: int = TABLE_ENTRIES,
        create: Callable[[Path, int], int] | None = None,
    ) -> None:  # fmt: skip
        """``create(path, mode)`` makes the file and returns it open (the store's: with the shared
        ``flock`` its segments hold, so that a sweep leaves a live daemon's table alone); it is
        kept open until the table goes."""
        self.name = name
        self._create = create or (lambda path, mode: os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode))
        self._fd: int | None = None
        self.path = Path(shm_dir) / name
        self._mode = mode
        self._entries = entries
        self._lock = threading.Lock()
        self._counter = 0  # the last value written, daemon-wide: never repeats
        self._free: list[int] = []
        self._live = 0
        self._mmap: mmap.mmap | None = None
        self._table: np.ndarray | None = None

    def take(self) -> int:
        """An entry for a new segment (the table file is made with the first)."""
        with self._lock:
            if self._table is None:
                self._open()
            if not self._free:
                raise ConfigError(
                    f"generations table {self.path} is full: {self._entries} live shared-memory segments; "
                    "raise STREAMER_SLOT_SIZE so that fewer, larger segments hold the budget"
                )
            self._live += 1
            return self._free.pop()

    def give(self, entry: int) -> None:
        """A segment is gone: its entry is free (the table file goes with the last)."""
        with self._lock:
            if self._table is None:
                return  # the table was closed under it (the daemon stops)
            self._free.append(entry)
            self._live -= 1
            if self._live == 0:
                self._close()

    def bump(self, entry: int) -> int:
        """Write a fresh generation into ``entry`` before its segment gets new bytes; returns it."""
        with self._lock:
            self._counter += 1
            if self._table is not None:
                self._table[entry] = self._counter
            return self._counter

    def read(self, entry: int) -> int:
        with self._lock:
            return int(self._table[entry]) if self._table is not None else 0

    def close(self) -> None:
        """The daemon stops: the table file goes, whatever still maps it."""
        with self._lock:
            self._close()

    def _open(self) -> None:
        fd = self._create(self.path, self._mode)
        try:
            os.fchmod(fd, self._mode)  # ranks map it as they map the segments
            os.ftruncate(fd, self._entries * 8)
            self._mmap = mmap.mmap(fd, self._entries * 8, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.unlink(self.path)
            os.close(fd)
            raise
        self._fd = fd
        self._table = np.frombuffer(self._mmap, dtype="<u8")
        self._free = list(range(self._entries - 1, -1, -1))  # entry 0 first

    def _close(self) -> None:
        if self._mmap is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        if self._fd is not None:  # its lock goes with it
            os.close(self._fd)
            self._fd = None
        self._table = None
        self._mmap.close()
        self._mmap = None
        self._free = []
        self._live = 0
