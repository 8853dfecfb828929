"""Shared-memory segments: files in the shm dir, mapped by the daemon and by the ranks.

Each segment is a file ``streamer-<daemon pid>-<instance token>-<n>`` created
0600 in ``STREAMER_SHM_DIR`` (``/dev/shm`` or a Kubernetes memory ``emptyDir``
shared by the daemon and the inference containers). Run:ai writes ranges
straight into the daemon's mapping; ranks map the same file read-only.

We do not use ``multiprocessing.shared_memory``: its resource tracker unlinks
or warns from the wrong process (DESIGN.md 6). Segments are unlinked when their
session ends, and a daemon sweeps segments of dead daemons when it starts.

Space is reserved with ``posix_fallocate`` when a segment is created, so a shm
filesystem smaller than the budget fails with a clear error here instead of a
SIGBUS in whichever process first touches a missing page.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import re
import secrets
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from streamer_client.errors import ConfigError

__all__ = ["SEGMENT_PREFIX", "Segment", "SegmentStore", "ShmBudget", "sweep_stale_segments"]

log = logging.getLogger(__name__)

SEGMENT_PREFIX = "streamer-"
_NAME_RE = re.compile(r"^streamer-(\d+)-[0-9a-f]+-\d+$")


class Segment:
    """One mapped segment file. ``address`` is where Run:ai may write ``nbytes``."""

    __slots__ = ("name", "path", "nbytes", "_mmap", "array", "address")

    def __init__(self, name: str, path: Path, nbytes: int) -> None:
        self.name = name
        self.path = path
        self.nbytes = nbytes
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as exc:
                os.unlink(path)
                if exc.errno in (errno.ENOSPC, errno.EFBIG):
                    raise ConfigError(
                        f"shared-memory dir {path.parent} has no room for a {nbytes}-byte segment: "
                        "make the shm filesystem larger than STREAMER_SHM_BUDGET or lower the budget"
                    ) from None
                raise
            self._mmap = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.array = np.frombuffer(self._mmap, dtype=np.uint8)
        self.address = self.array.ctypes.data

    def close(self) -> None:
        """Unlink and unmap. Ranks that still map the file keep their pages until they unmap."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self.array = None
        with contextlib.suppress(BufferError):  # a view still exported: the map goes with it
            self._mmap.close()

    def __repr__(self) -> str:
        return f"Segment({self.name!r}, {self.nbytes})"


@dataclass(frozen=True)
class Reservation:
    nbytes: int
    beyond_budget: bool  # the one oversized allocation allowed past the limit


class ShmBudget:
    """Daemon-wide accounting of segment bytes: at most ``limit``, plus one oversized segment."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_use = 0
        self.peak = 0
        self._beyond_out = False
        self._lock = threading.Lock()

    def try_take(self, nbytes: int, *, oversized: bool = False) -> Reservation | None:
        with self._lock:
            beyond = False
            if self.in_use + nbytes > self.limit:
                if not oversized or self._beyond_out:
                    return None
                beyond = self._beyond_out = True
            self.in_use += nbytes
            self.peak = max(self.peak, self.in_use)
            return Reservation(nbytes, beyond)

    def give_back(self, reservation: Reservation) -> None:
        with self._lock:
            self.in_use -= reservation.nbytes
            if reservation.beyond_budget:
                self._beyond_out = False


class SegmentStore:
    """Creates this daemon instance's segments; knows how to sweep those of dead daemons."""

    def __init__(self, shm_dir: Path) -> None:
        self.shm_dir = Path(shm_dir)
        if not self.shm_dir.is_dir():
            raise ConfigError(f"shared-memory dir {self.shm_dir} does not exist (STREAMER_SHM_DIR / --shm-dir)")
        self.prefix = f"{SEGMENT_PREFIX}{os.getpid()}-{secrets.token_hex(4)}-"
        self._counter = 0
        self._lock = threading.Lock()

    def create(self, nbytes: int) -> Segment:
        with self._lock:
            self._counter += 1
            name = f"{self.prefix}{self._counter}"
        return Segment(name, self.shm_dir / name, nbytes)

    def leftovers(self) -> list[Path]:
        """Segments of this instance still in the shm dir (tests assert none after a session)."""
        return sorted(self.shm_dir.glob(f"{self.prefix}*"))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale_segments(shm_dir: Path) -> list[str]:
    """Remove segments whose daemon process is gone; return their names."""
    removed = []
    for path in Path(shm_dir).glob(f"{SEGMENT_PREFIX}*"):
        match = _NAME_RE.match(path.name)
        if match is None or _alive(int(match.group(1))):
            continue
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed.append(path.name)
    if removed:
        log.info("removed %d shared-memory segments left by a dead daemon in %s", len(removed), shm_dir)
    return removed
