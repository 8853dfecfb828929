"""An inter-process file lock with a timeout and "still waiting" logs.

``flock`` is released by the kernel when its holder dies, so a puller killed
with SIGKILL never leaves the lock held. The lock only prevents doing work
twice; correctness comes from the temp dir + rename in ``metadata``.

Why not ``filelock`` (installed with torch): the daemon must not need torch's
dependencies, and filelock 4.3 on Linux does more than ``flock``: it creates and unlinks
``.filelock-probe-*`` files in the lock's directory (our cache root) to detect filesystems
without ``flock``, may fall back to "soft" locks, and swaps a lock file aside when it finds an
interrupted one (``filelock/_native/_unix.py``). Our rule is a lock file beside the dir it
guards, and nothing else in the cache root. It also logs no "still waiting": we would wrap it in
this same loop. This loop is 40 lines over one system call.

A pull that cached nothing (a URI with no objects, refused credentials) removes its lock file
while it holds it (:meth:`FileLock.discard`), so that bad URIs leave nothing in the cache root. A
waiter that then gets the lock holds a file no longer at the path: it sees that (the path names
another inode, or none) and opens the path again.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from streamer_client.errors import CacheLockTimeoutError

log = logging.getLogger(__name__)

_POLL_S = 0.05


class FileLock:
    """Exclusive lock on ``path`` (created if missing; removed only by :meth:`discard`).

    ``what`` names the thing guarded, for log lines and the timeout error.
    """

    def __init__(
        self,
        path: Path,
        *,
        timeout_s: float,
        log_interval_s: float,
        what: str,
        mode: int = 0o644,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = path
        self.mode = mode
        self.timeout_s = timeout_s
        self.log_interval_s = log_interval_s
        self.what = what
        self._clock = clock
        self._fd: int | None = None

    def acquire(self) -> None:
        start = next_log = self._clock()
        next_log += self.log_interval_s
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, self.mode)
            try:
                while True:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except OSError as exc:
                        if exc.errno not in (errno.EAGAIN, errno.EACCES):
                            raise
                    now = self._clock()
                    if now - start >= self.timeout_s:
                        raise CacheLockTimeoutError(
                            f"gave up after {self.timeout_s:g} s waiting for lock {self.path} held by another pull of {self.what}",
                            uri=self.what,
                        )
                    if now >= next_log:
                        log.info("still waiting for lock %s (pull of %s, %.0f s so far)", self.path, self.what, now - start)
                        next_log = now + self.log_interval_s
                    time.sleep(_POLL_S)
                if self._still_at_path(fd):
                    break
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)  # its holder discarded it while we waited: lock the path's file now
        self._fd = fd

    def _still_at_path(self, fd: int) -> bool:
        held = os.fstat(fd)
        try:
            current = os.stat(self.path)
        except FileNotFoundError:
            return False
        return (held.st_dev, held.st_ino) == (current.st_dev, current.st_ino)

    def discard(self) -> None:
        """Remove the lock file, then release it (held: nobody else can be using the path's file)."""
        if self._fd is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            self.release()

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> FileLock:
        self.acquire()
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.release()
