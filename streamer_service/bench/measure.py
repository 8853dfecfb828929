"""What the kernel says about the benchmark's processes: I/O counters, resident memory, shm in use.

Nothing here asks our own code for a number: ``/proc/<pid>/io`` (``rchar``: bytes a process got
from read-like system calls, page cache hits included; memory-mapped reads are not in it),
``/proc/<pid>/status`` (``VmRSS``, ``VmHWM``) and the blocks of the files in the daemon's shm dir.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

__all__ = ["read_io", "read_status_kib", "dir_bytes", "Sampler"]


def read_io(pid: int | str = "self") -> dict[str, int]:
    """``/proc/<pid>/io`` as integers (rchar, wchar, read_bytes, ...)."""
    values = {}
    with open(f"/proc/{pid}/io") as f:
        for line in f:
            key, _, value = line.partition(":")
            values[key.strip()] = int(value)
    return values


def read_status_kib(pid: int | str, field: str) -> int:
    """A ``kB`` field of ``/proc/<pid>/status`` (``VmRSS``, ``VmHWM``), 0 for a process that is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def dir_bytes(directory: Path) -> int:
    """Bytes allocated to the files in ``directory`` (tmpfs: shared memory actually in use)."""
    total = 0
    try:
        with os.scandir(directory) as entries:
            for entry in entries:
                try:
                    total += entry.stat(follow_symlinks=False).st_blocks * 512
                except FileNotFoundError:
                    pass  # released while we looked
    except FileNotFoundError:
        pass
    return total


class Sampler:
    """Samples, every ``interval_s`` until stopped, the peaks of: the summed RSS of each group of
    processes, and the bytes in a shm dir. Peaks between two samples are missed: it is a sampler."""

    def __init__(
        self,
        groups: dict[str, Callable[[], Iterable[int]]],
        shm_dir: Path | None,
        interval_s: float = 0.05,
    ) -> None:
        self._groups = groups
        self._shm_dir = shm_dir
        self._interval = interval_s
        self.peak_rss = {name: 0 for name in groups}  # bytes
        self.peak_shm = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bench-sampler", daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()  # once more: short runs may end between two samples

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            self._sample()

    def _sample(self) -> None:
        for name, pids in self._groups.items():
            rss = sum(read_status_kib(pid, "VmRSS") for pid in pids()) * 1024
            self.peak_rss[name] = max(self.peak_rss[name], rss)
        if self._shm_dir is not None:
            self.peak_shm = max(self.peak_shm, dir_bytes(self._shm_dir))
