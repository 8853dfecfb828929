"""Watching a rank's process from the daemon: its PID from the unix socket (``SO_PEERCRED``).

A rank that dies is otherwise noticed only after ``STREAMER_RANK_TIMEOUT_S`` of silence
(30 s by default), holding its segments all that time. The kernel tells a unix-socket server
its peer's PID, translated into the server's PID namespace (0 where the peer is not visible
there: another container without a shared process namespace, or a TCP peer), and a pidfd for it
becomes readable when that process exits, with no PID-reuse race. The reaper asks every half
second, with ``poll(2)``, which takes any descriptor number (``select(2)`` refuses those from
1024 on, which a daemon with many connections and ranks reaches); where no PID is known, the
silence timeout still applies.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import struct

__all__ = ["ProcessWatch", "peer_pid"]

_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def peer_pid(sock: socket.socket | None) -> int | None:
    """The PID of the process at the other end of a unix socket, or None where unknown."""
    if sock is None or sock.family != socket.AF_UNIX:
        return None
    try:
        pid, _, _ = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    except OSError:
        return None
    return pid or None


class ProcessWatch:
    """A pidfd of one process: :meth:`exited` answers without blocking."""

    __slots__ = ("pid", "_fd")

    def __init__(self, pid: int, fd: int) -> None:
        self.pid = pid
        self._fd: int | None = fd

    @classmethod
    def of(cls, pid: int | None) -> ProcessWatch | None:
        """A watch of ``pid``; None where it cannot be had (no pidfd support, process already gone)."""
        if not pid or not hasattr(os, "pidfd_open"):
            return None
        try:
            return cls(pid, os.pidfd_open(pid))
        except OSError:
            return None

    def exited(self) -> bool:
        if self._fd is None:
            return False
        poller = select.poll()
        poller.register(self._fd, select.POLLIN)
        return bool(poller.poll(0))

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    def __repr__(self) -> str:
        return f"ProcessWatch(pid={self.pid})"
