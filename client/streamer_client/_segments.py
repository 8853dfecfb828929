"""Daemon segment files, mapped and page-locked once per process and reused across loads.

A rank that maps the daemon's shared-memory segments pays twice per segment: the mapping
(page-table entries for every page) and, for CUDA targets, ``cudaHostRegister``, which locks the
segment page by page and on 4 KiB pages takes longer than the host-to-device copy that follows
it. Both are paid once per process here:
a reload served from the daemon's resident copy, and a load whose ring slots the daemon kept
idle from the last one (the standing ring; docs/architecture.md, "Segments", defines the words),
reuse the mapping and the registration as they are.

Identity. A segment is reused only while the path still names the file we mapped: the daemon names
each one ``streamer-<pid>-<instance token>-<n>`` and never gives a name twice, and a cached entry is
checked against ``os.stat`` of its path (``st_dev``, ``st_ino``, ``st_size``) before each load uses
it. Our mapping holds the inode, so its number cannot be given to another file while we hold it: a
segment the daemon unlinked, or unlinked and replaced under the same name, never matches.

No leaks. A mapping of an unlinked file keeps its memory alive, so :meth:`SegmentMaps.sweep` unmaps
(and unpins) every idle entry whose file is gone. It runs when a load starts and ends, and from a
janitor thread every ``SWEEP_S`` seconds while idle entries are kept: a rank holds memory the daemon
gave back (session ended, resident copy evicted, daemon restarted) for at most that long.

Overlap. Registration runs on one worker thread, in the order the segments were announced
(:meth:`Load.prepare`), so the next segment is page-locked while the copies out of the current one
run (the copy engine is not slowed by it). A copy waits only for its own segment. The
driver registers one range at a time, and on 4 KiB pages much of a fresh mapping's
registration is mapping its pages, one fault at a time on the registering thread: so a segment's
pages are mapped first, a share each on a few threads (:data:`FAULT_THREADS`), and the
registration only locks pages already there.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import logging
import mmap
import os
import threading
import time
from concurrent.futures import Executor, Future, ThreadPoolExecutor, wait
from pathlib import Path

import numpy as np

from ._counters import Counters
from .errors import DaemonError

__all__ = [
    "POPULATE_PIECE", "Load", "MappedSegment", "PrivateSegments", "SegmentMaps", "map_segment", "map_shared", "populate_pages",
    "populate_shares", "populates_piecewise", "segment_maps",
]  # fmt: skip

log = logging.getLogger(__name__)

SWEEP_S = 2.0  # how long a rank may keep mapping a segment the daemon unlinked


# A segment's page tables are made when it is mapped (``populate``), not by a fault per 4 KiB page as
# it is first written or read; and a few MiB at a time: each call holds the process's address-space
# lock, which every other thread needs to map memory (a daemon's S3 client mapping its buffers: a
# 256 MiB segment mapped in one call held its first reads up). The calls go through ctypes, which
# lets go of the GIL: ``mmap.madvise`` holds it for the whole call, and a daemon making segments on
# its maker threads would stall every other Python thread it has, its loading thread and its HTTP
# server among them, for as long as populating takes.
POPULATE_PIECE = 8 * 2**20
_POPULATE = {False: getattr(mmap, "MADV_POPULATE_READ", 22), True: getattr(mmap, "MADV_POPULATE_WRITE", 23)}  # Linux 5.14
FAULT_THREADS = 4  # threads that map a segment's pages before its registration
_piecewise = True  # False once the kernel refused it: one MAP_POPULATE call a mapping instead
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int


def populate_pages(address: int, nbytes: int, *, writable: bool, piece: int = POPULATE_PIECE) -> None:
    """Map every page of the ``nbytes`` at ``address`` now (``writable``: for writing), ``piece``
    bytes a call, without holding the GIL; ``OSError`` with the kernel's errno if it refuses
    (``EINVAL`` before Linux 5.14)."""
    for offset in range(0, nbytes, piece):
        if _libc.madvise(address + offset, min(piece, nbytes - offset), _POPULATE[writable]) != 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code))


def populate_shares(
    address: int, nbytes: int, *, writable: bool, threads: int, helpers: Executor, piece: int = POPULATE_PIECE
) -> None:
    """:func:`populate_pages` over ``threads`` contiguous shares of whole pieces side by side: the
    calling thread takes the first, ``helpers`` (at least ``threads - 1`` threads) the others. The
    first share's error, or the first other one's."""
    share = -(-nbytes // threads // piece) * piece
    starts = range(0, nbytes, share)
    populate = functools.partial(populate_pages, writable=writable, piece=piece)
    others = [helpers.submit(populate, address + start, min(share, nbytes - start)) for start in starts[1:]]
    try:
        populate(address, min(share, nbytes))
    finally:
        wait(others)
    for future in others:
        future.result()


def populates_piecewise() -> bool:
    """Whether :func:`populate_pages` is used here: False once the kernel refused it (before Linux
    5.14), when :func:`map_shared` falls back to one ``MAP_POPULATE`` call."""
    return _piecewise


def map_shared(fd: int, nbytes: int, *, writable: bool, populate: bool, piece: int = POPULATE_PIECE) -> mmap.mmap:
    """``fd``'s first ``nbytes`` mapped shared (``writable`` or read-only); ``populate``: every page
    mapped already, ``piece`` bytes (a multiple of the page size) per call (:func:`populate_pages`;
    before Linux 5.14, one ``MAP_POPULATE`` call, which holds the GIL)."""
    global _piecewise
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    if populate and _piecewise:
        mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=prot)
        view = np.frombuffer(mapping, dtype=np.uint8)  # its address (read-only mappings too)
        try:
            populate_pages(view.ctypes.data, nbytes, writable=writable, piece=piece)
            return mapping
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                return mapping  # pages not mapped now are mapped by the first touch of each
            _piecewise = False
            del view  # an exported buffer would keep the mapping from closing
            mapping.close()
    flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
    return mmap.mmap(fd, nbytes, flags=flags, prot=prot)


def map_segment(path: Path, *, private: bool = False, populate: bool = False) -> tuple[mmap.mmap, tuple[int, int, int]]:
    """Map a segment file read-only (``private``: copy-on-write, writable); ``(mapping, identity)``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise DaemonError(
            f"shared-memory segment {path} not found: the daemon and this process must share "
            "STREAMER_SHM_DIR (in Kubernetes, one emptyDir volume mounted in both containers)"
        ) from None
    try:
        st = os.fstat(fd)
        if private:
            # Borrowed views are handed to user code: a careless write stays in this process
            # instead of crashing on a read-only page. (Never populated: that would copy every page.)
            mapping = mmap.mmap(fd, st.st_size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        else:
            # Populated for CPU copies. Not for a CUDA registration, whose pages are mapped on
            # FAULT_THREADS threads before it instead of on this one.
            mapping = map_shared(fd, st.st_size, writable=False, populate=populate)
    finally:
        os.close(fd)
    return mapping, (st.st_dev, st.st_ino, st.st_size)


def _identity(path: Path) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino, st.st_size


class MappedSegment:
    """One segment mapped into this process, shared by the loads that use it."""

    __slots__ = ("name", "path", "identity", "mapping", "array", "users", "pinning")

    def __init__(self, name: str, path: Path, identity: tuple[int, int, int], mapping: mmap.mmap, array: np.ndarray) -> None:
        self.name, self.path, self.identity, self.mapping, self.array = name, path, identity, mapping, array
        self.users = 0  # loads using it now; only idle entries are swept
        self.pinning: Future | None = None  # the registration, once asked for (result: page-locked or not)

    @property
    def address(self) -> int:
        return self.array.ctypes.data


class MapStats(Counters):
    mapped: int = 0  # segments mapped
    reused: int = 0  # times a load found a segment already mapped
    pinned: int = 0  # registrations made
    dropped: int = 0  # unmapped (file gone, dedicated, or closed)
    register_seconds: float = 0.0


class SegmentMaps:
    """The segments of one shm dir mapped in this process (see the module docstring).

    ``pinner``: a :class:`streamer_client._pinning.HostPinner` (tests pass one over a fake runtime);
    made on first registration otherwise.
    """

    def __init__(self, shm_dir: Path, *, pinner=None, sweep_s: float = SWEEP_S) -> None:
        self.shm_dir = Path(shm_dir)
        self.stats = MapStats()
        self._pinner = pinner
        self._sweep_s = sweep_s
        self._lock = threading.Lock()
        self._entries: dict[str, MappedSegment] = {}
        self._stale: list[MappedSegment] = []  # replaced while a load still used them
        self._worker: ThreadPoolExecutor | None = None
        self._faulters: ThreadPoolExecutor | None = None
        self._janitor: threading.Thread | None = None
        self.loads = 0  # loads begun through this shm dir by this process

    # ------------------------------------------------------------------ per load

    def load(self, *, populate: bool) -> Load:
        """A load's view of the segments; ``populate``: map for CPU copies (see :func:`map_segment`)."""
        self.sweep()
        with self._lock:
            self.loads += 1
        return Load(self, populate)

    def _use(self, name: str, populate: bool) -> MappedSegment:
        path = self.shm_dir / name
        with self._lock:  # one lock for lookup and insert: two loads of one process map a file once
            entry = self._entries.get(name)
            if entry is not None and _identity(path) == entry.identity:
                self.stats.reused += 1
            else:
                if entry is not None:  # gone or replaced: never reused; unmapped once idle
                    del self._entries[name]
                    self._stale.append(entry)
                mapping, identity = map_segment(path, populate=populate)
                entry = MappedSegment(name, path, identity, mapping, np.frombuffer(mapping, dtype=np.uint8))
                self._entries[name] = entry
                self.stats.mapped += 1
            entry.users += 1
            return entry

    def _done(self, entries: list[MappedSegment]) -> None:
        with self._lock:
            for entry in entries:
                entry.users -= 1
        self.sweep()
        with self._lock:
            if self._entries and self._janitor is None:
                self._janitor = threading.Thread(target=self._sweep_loop, name="streamer-segments", daemon=True)
                self._janitor.start()

    # ------------------------------------------------------------------ registration

    def pin(self, entry: MappedSegment, device) -> Future:
        """Ask for ``entry``'s registration (once; in order, on the worker thread)."""
        with self._lock:
            if entry.pinning is None:
                if self._worker is None:
                    self._worker = ThreadPoolExecutor(1, thread_name_prefix="streamer-pin")
                entry.pinning = self._worker.submit(self._register, entry, device)
            return entry.pinning

    def _register(self, entry: MappedSegment, device) -> bool:
        from ._devices import device_context
        from ._pinning import HostPinner

        if self._pinner is None:
            self._pinner = HostPinner()
        start = time.perf_counter()
        self._fault_in(entry)
        with device_context(device):  # a thread of ours: make the copies' device current for the runtime
            pinned = self._pinner.pin(entry.address, entry.array.nbytes, read_only=True)
        self.stats.register_seconds += time.perf_counter() - start
        self.stats.pinned += pinned
        return pinned

    def _fault_in(self, entry: MappedSegment) -> None:
        """Map every page of ``entry`` on :data:`FAULT_THREADS` threads side by side, this one (the
        registration's) among them."""
        nbytes = entry.array.nbytes
        if not self._pinner.enabled or nbytes <= POPULATE_PIECE or not _piecewise:
            return
        if self._faulters is None:
            self._faulters = ThreadPoolExecutor(FAULT_THREADS - 1, thread_name_prefix="streamer-fault")
        try:
            populate_shares(entry.address, nbytes, writable=False, threads=FAULT_THREADS, helpers=self._faulters)
        except OSError:  # a kernel without MADV_POPULATE_READ: the registration maps them itself
            pass

    # ------------------------------------------------------------------ dropping

    def drop(self, entry: MappedSegment) -> None:
        """A load is done with ``entry`` and nobody will need it again (a dedicated segment, read
        once): unmap and unpin it as soon as no other load uses it."""
        with self._lock:
            entry.users -= 1
            if entry.users > 0:
                return
        self._forget(entry)

    def sweep(self) -> int:
        """Unmap every idle segment whose file is gone or replaced; how many."""
        with self._lock:
            idle = [e for e in self._entries.values() if e.users == 0]
            stale = [e for e in self._stale if e.users == 0]
            self._stale = [e for e in self._stale if e.users > 0]
        gone = [e for e in idle if _identity(e.path) != e.identity]
        with self._lock:  # a load may have taken one since (the janitor runs beside the loads)
            gone = [e for e in gone if e.users == 0]
            for entry in gone:  # out of the table first: a load from now on maps the file anew
                if self._entries.get(entry.name) is entry:
                    del self._entries[entry.name]
            gone += stale
        for entry in gone:
            self._forget(entry)
        return len(gone)

    def close(self) -> None:
        """Unmap and unpin every idle segment (tests; a process's end does this by itself)."""
        with self._lock:
            idle = [e for e in self._entries.values() if e.users == 0]
        for entry in idle:
            self._forget(entry)

    def mapped(self) -> dict[str, int]:
        """``{segment name: address}`` of what is mapped now."""
        with self._lock:
            return {name: e.address for name, e in self._entries.items()}

    def _forget(self, entry: MappedSegment) -> None:
        with self._lock:
            if self._entries.get(entry.name) is entry:
                del self._entries[entry.name]
        if entry.pinning is not None:
            if entry.pinning.result() and self._pinner is not None:
                self._pinner.unpin(entry.address)
        entry.array = None
        with contextlib.suppress(BufferError):  # a view still exported (a kept CPU view): it goes with it
            entry.mapping.close()
        self.stats.dropped += 1

    def _sweep_loop(self) -> None:
        while True:
            time.sleep(self._sweep_s)
            try:
                self.sweep()
            except Exception:  # never let the janitor die silently with memory held
                log.exception("sweeping unlinked shared-memory segments failed")
            with self._lock:
                if not self._entries:
                    self._janitor = None
                    return


class Load:
    """The segments one load uses; gives them back (to the cache) at :meth:`close`."""

    __slots__ = ("maps", "populate", "_used")

    def __init__(self, maps: SegmentMaps, populate: bool) -> None:
        self.maps, self.populate = maps, populate
        self._used: dict[str, MappedSegment] = {}

    def segment(self, name: str) -> MappedSegment:
        entry = self._used.get(name)
        if entry is None:
            entry = self._used[name] = self.maps._use(name, self.populate)
        return entry

    def array(self, name: str) -> np.ndarray:
        """Segment ``name`` as mapped here, whole (mapped now if this load had not yet)."""
        return self.segment(name).array

    def prepare(self, names: list[str], device) -> None:
        """Map ``names`` and ask for their registration, in this order (the order of their copies)."""
        for name in names:
            self.maps.pin(self.segment(name), device)

    def pinned(self, name: str, device) -> bool:
        """Wait for ``name``'s registration (asked for now if it was not); whether it is page-locked."""
        return self.maps.pin(self.segment(name), device).result()

    def drop(self, name: str) -> None:
        entry = self._used.pop(name, None)
        if entry is not None:
            self.maps.drop(entry)

    def close(self) -> None:
        used, self._used = list(self._used.values()), {}
        self.maps._done(used)


class PrivateSegments:
    """Borrowed views: each segment mapped copy-on-write for this load only (see map_segment)."""

    def __init__(self, shm_dir: Path) -> None:
        self.shm_dir = shm_dir
        self._maps: dict[str, tuple[mmap.mmap, np.ndarray]] = {}

    def array(self, name: str) -> np.ndarray:
        """Segment ``name`` as mapped here, whole."""
        if name not in self._maps:
            mapping, _ = map_segment(self.shm_dir / name, private=True)
            self._maps[name] = (mapping, np.frombuffer(mapping, dtype=np.uint8))
        return self._maps[name][1]

    def drop(self, name: str) -> None:
        entry = self._maps.pop(name, None)
        if entry is not None:
            with contextlib.suppress(BufferError):  # a borrowed view still holds it: it goes with the view
                entry[0].close()

    def close(self) -> None:
        for name in list(self._maps):
            self.drop(name)


_ALL: dict[Path, SegmentMaps] = {}
_ALL_LOCK = threading.Lock()


def segment_maps(shm_dir: Path) -> SegmentMaps:
    """The process-wide :class:`SegmentMaps` of ``shm_dir``."""
    key = Path(os.path.realpath(shm_dir))
    with _ALL_LOCK:
        maps = _ALL.get(key)
        if maps is None:
            maps = _ALL[key] = SegmentMaps(key)
        return maps
