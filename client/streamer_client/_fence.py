"""The generation fence: a rank's check that a batch's bytes were not replaced while it read them.

The daemon keeps one generations table per instance, a file in its shm dir (``JoinReply.generations``;
``streamer_service/daemon/generations.py`` writes it): before it writes new bytes into a segment
it writes a fresh, never repeated value into the segment's entry. Each handle names the entry and
the value it was issued under. A rank maps the table read-only and, after it copied a batch's
bytes and before it yields them, reads the entry (one 8-byte load per batch): a different value
means the segment was given to another batch while this rank held it, and the rank raises instead
of yielding what may be another checkpoint's bytes (the seqlock pattern: the daemon bumps before
it writes, the rank checks after it read).

The daemon makes the table with its first live segment and unlinks it with its last; a table made
again is a new file of the same name. On a mismatch the rank maps the file again where it is a
new one, and decides on that.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
from collections.abc import Sequence
from pathlib import Path

from ._protocol import Handle
from .errors import DaemonError, SessionError, StreamerError

__all__ = ["Fence", "unfenced"]

_ENTRY = struct.Struct("<Q")


class Fence:
    """The daemon's generations table at ``path``, mapped read-only (on the first check)."""

    def __init__(self, path: Path, session_id: str) -> None:
        self.path = path
        self.session_id = session_id
        self._mapping: mmap.mmap | None = None
        self._identity: tuple[int, int] | None = None

    def check(self, batch: Sequence[Handle], error: type[StreamerError] = SessionError) -> None:
        """Raise ``error`` (naming the tensor, its segment and the session) where a segment of
        ``batch`` is no longer at the generation its handles were issued under. Call it after the
        batch's bytes were copied (or before a borrowed view is used) and before yielding."""
        torn = self.torn(batch, error)
        if torn is not None:
            raise torn

    def torn(self, batch: Sequence[Handle], error: type[StreamerError] = SessionError) -> StreamerError | None:
        """:meth:`check`'s error, returned instead of raised (for a copy-completion callback)."""
        last = None
        for h in batch:
            if h.entry < 0 or (h.entry, h.generation) == last:
                continue  # no bytes, an unfenced handle, or the segment just checked
            last = (h.entry, h.generation)
            now = self._read(h.entry)
            if now != h.generation:
                now = self._read(h.entry, again=True)  # a table made again since it was mapped
            if now != h.generation:
                found = "gone" if now is None else f"now {now}"
                return error(
                    f"session {self.session_id}: tensor {h.name!r} was not handed out: shared-memory segment "
                    f"{h.segment} was given new bytes while this rank read it (generation {h.generation}, "
                    f"{found}; table {self.path}): the daemon reused a segment this rank still held",
                    key=h.name,
                )
        return None

    def _read(self, entry: int, *, again: bool = False) -> int | None:
        """Entry ``entry`` of the table (``None``: no such entry, or no table); ``again``: map the
        file again first where it is not the one mapped."""
        if self._mapping is None or (again and self._stat() != self._identity):
            self._map()
        if self._mapping is None or (entry + 1) * _ENTRY.size > len(self._mapping):
            return None
        return _ENTRY.unpack_from(self._mapping, entry * _ENTRY.size)[0]

    def _stat(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        return st.st_dev, st.st_ino

    def _map(self) -> None:
        self.close()
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return  # no live segment: every check fails
        try:
            st = os.fstat(fd)
            if st.st_size:
                self._mapping = mmap.mmap(fd, st.st_size, mmap.MAP_SHARED, mmap.PROT_READ)
                self._identity = st.st_dev, st.st_ino
        finally:
            os.close(fd)

    def close(self) -> None:
        mapping, self._mapping, self._identity = self._mapping, None, None
        if mapping is not None:
            with contextlib.suppress(BufferError):
                mapping.close()


def unfenced(socket: object) -> DaemonError:
    """What a rank says of a daemon whose join reply names no generations table: one older than the client."""
    return DaemonError(
        f"streamer daemon at {socket} does not fence its segments (no segment generations): it is "
        'older than this client; upgrade the daemon before the clients (docs/client.md, "Upgrades")'
    )
