"""Shared-memory segments: files in the shm dir, mapped by the daemon and by the ranks.

Each segment is a file ``streamer-<daemon pid>-<instance token>-<n>`` created
0600 in ``STREAMER_SHM_DIR`` (``/dev/shm`` or a Kubernetes memory ``emptyDir``
shared by the daemon and the inference containers). Run:ai writes ranges
straight into the daemon's mapping; ranks map the same file read-only.

We do not use ``multiprocessing.shared_memory``: its resource tracker unlinks
or warns from the wrong process (docs/architecture.md). Segments are unlinked when their
session ends, and a daemon sweeps segments of dead daemons when it starts.

Whether the daemons that made segments are alive is decided by a lock, not by
the PID in a segment's name: a PID says nothing in a container, where every
daemon is PID 1 of its own namespace. Each daemon holds a shared
``flock`` on the shm dir itself for its whole life; the kernel drops it when
the process dies, however it dies. A starting daemon that gets the exclusive
lock knows no other daemon uses the dir, so every segment there is stale. (Only
where another daemon shares the dir does it fall back to the PIDs.)

Space is reserved with ``posix_fallocate`` when a segment is created, so a shm
filesystem smaller than the budget fails with a clear error here instead of a
SIGBUS in whichever process first touches a missing page.

Huge pages: what backs the shm dir's files is :mod:`.pages`'s (:func:`~.pages.detect_pages`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import logging
import mmap
import os
import re
import secrets
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from streamer_client.errors import ConfigError

from .pages import Pages, detect_pages

__all__ = ["SEGMENT_PREFIX", "Segment", "SegmentPool", "SegmentStore", "ShmBudget", "sweep_stale_segments"]

log = logging.getLogger(__name__)

SEGMENT_PREFIX = "streamer-"
_NAME_RE = re.compile(r"^streamer-(\d+)-[0-9a-f]+-\d+$")


# Threads that make segments ahead of need (``SegmentStore.create_soon``). posix_fallocate zero-fills
# and MAP_POPULATE maps a segment on one thread; both release the GIL, so segments made side by side
# on a many-core host take the time of one (the reads they overlap have cores of their own). Not
# more: where new memory is slow to come (a VM's memory growing), more threads share that rate and
# the segment the load needs next comes later (8 threads: 0.60 s of a 4.3 GB retained load waiting
# for segments on an H200 VM, 4 threads: 0.40 s).
CREATE_WORKERS = max(1, min(4, os.cpu_count() or 1))


class Segment:
    """One mapped segment file. ``address`` is where Run:ai may write ``nbytes``."""

    __slots__ = ("name", "path", "nbytes", "_mmap", "array", "address")

    def __init__(self, name: str, path: Path, nbytes: int, mode: int = 0o600, pages: Pages | None = None) -> None:
        self.name = name
        self.path = path
        self.nbytes = nbytes
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
        try:
            try:
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.ENOMEM) and pages is not None and pages.hugetlbfs:
                    raise ConfigError(
                        f"hugetlbfs shared-memory dir {path.parent} has no free {pages.size // 2**20} MiB pages "
                        f"for a {nbytes}-byte segment (see HugePages_Free in /proc/meminfo): reserve more huge "
                        "pages (vm.nr_hugepages, or larger hugepages-2Mi requests in Kubernetes) or lower "
                        "STREAMER_SHM_BUDGET"
                    ) from None
                if exc.errno in (errno.ENOSPC, errno.EFBIG):
                    raise ConfigError(
                        f"shared-memory dir {path.parent} has no room for a {nbytes}-byte segment: "
                        "make the shm filesystem larger than STREAMER_SHM_BUDGET or lower the budget"
                    ) from None
                raise
            os.fchmod(fd, mode)  # exactly this mode, whatever the umask
            # MAP_POPULATE: the page tables of the (already allocated) pages in one call, instead of
            # a fault per 4 KiB page taken by Run:ai's reader threads as they write.
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self._mmap = mmap.mmap(fd, nbytes, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.unlink(path)  # whatever failed, no file is left behind: nothing maps it
            raise
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

    def __init__(self, shm_dir: Path, mode: int = 0o600) -> None:
        self.shm_dir = Path(shm_dir)
        self.mode = mode
        if not self.shm_dir.is_dir():
            raise ConfigError(f"shared-memory dir {self.shm_dir} does not exist (STREAMER_SHM_DIR / --shm-dir)")
        self.prefix = f"{SEGMENT_PREFIX}{os.getpid()}-{secrets.token_hex(4)}-"
        self.pages = detect_pages(self.shm_dir)
        self._counter = 0
        self._lock = threading.Lock()
        self._dir_fd: int | None = None
        self._makers: ThreadPoolExecutor | None = None

    def open(self) -> list[str]:
        """Sweep the segments of daemons that are gone, then mark the dir as used by this one
        (until :meth:`close` or death). Returns the names swept."""
        fd = os.open(self.shm_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            alone = _try_flock(fd, fcntl.LOCK_EX)
            removed = sweep_stale_segments(self.shm_dir, everything=alone)
            fcntl.flock(fd, fcntl.LOCK_SH)  # blocks only while another daemon sweeps
        except BaseException:
            os.close(fd)
            raise
        self._dir_fd = fd
        return removed

    def close(self) -> None:
        """This daemon no longer uses the dir (its segments are gone)."""
        with self._lock:
            makers, self._makers = self._makers, None
        if makers is not None:
            makers.shutdown(wait=True)  # every segment made is in someone's hands before we go
        fd, self._dir_fd = self._dir_fd, None
        if fd is not None:
            os.close(fd)

    def create(self, nbytes: int) -> Segment:
        """A new segment of at least ``nbytes``: whole huge pages where the dir has them (``pages.round``)."""
        with self._lock:
            self._counter += 1
            name = f"{self.prefix}{self._counter}"
        return Segment(name, self.shm_dir / name, self.pages.round(nbytes), self.mode, self.pages)

    def create_soon(self, nbytes: int) -> Future[Segment]:
        """:meth:`create` on one of ``CREATE_WORKERS`` threads; the future's result is the segment, or
        the same errors (a full dir is a ``ConfigError``). Whoever asked owns it: close it if unused."""
        with self._lock:
            if self._makers is None:
                self._makers = ThreadPoolExecutor(CREATE_WORKERS, thread_name_prefix="segment-maker")
            return self._makers.submit(self.create, nbytes)

    def leftovers(self) -> list[Path]:
        """Segments of this instance still in the shm dir (tests assert none after a session)."""
        return sorted(self.shm_dir.glob(f"{self.prefix}*"))


class SegmentPool:
    """Segments for every session of the daemon, within one :class:`ShmBudget`.

    A ring segment a session no longer needs stays mapped and idle for ``idle_s`` seconds, and
    the next session that needs one of its size takes it as it is: its pages are already
    allocated, so the load skips the zero-fill (about 60 ms per 256 MiB) and the first-touch
    faults (docs/architecture.md: "slots recycle"). Idle segments count against the budget; a request
    that does not fit evicts them first. ``idle_s = 0`` keeps nothing.

    Prepared segments (:meth:`start_preparing`, when the daemon starts): ring segments made ahead
    of the first load, in parallel and off any load's thread, so that the first load finds them
    as a later load finds the last one's. They wait for that first load however late it comes;
    from its first request on, they are idle segments like any other. A ring that grows past
    them asks for its next slots the same way (:meth:`make_ahead`).

    The standing ring (``standing=True`` when preparing): as many idle segments of that size as
    were prepared are never trimmed, so a load that comes after a long idle spell starts on
    segments whose pages are allocated and mapped, as the first load did (new shared memory comes
    only as fast as the kernel zero-fills and maps it). Only what a load grew past them goes after
    ``idle_s``; a request the budget cannot hold evicts them like any idle segment. A retained
    load adopts them for its first batches (:meth:`adopt`: its claim pays for them from then on)
    and the pool makes them again when its session ends (:meth:`restand`).
    """

    def __init__(self, store: SegmentStore, budget: ShmBudget, idle_s: float) -> None:
        self.store = store
        self.budget = budget
        self.idle_s = idle_s
        self.reused = 0
        self.prepared = 0  # segments made by start_preparing
        # (segment, reservation, idle since); since None: prepared, waiting for the first load
        self._idle: list[tuple[Segment, Reservation, float | None]] = []
        self._making = 0  # prepared segments on their way, of ``_making_size`` bytes
        self._making_size = 0
        self._closed = False
        self._first_taken = False
        self._standing: tuple[int, int] = (0, 0)  # (segment bytes, count) never trimmed
        self._lock = threading.Condition()

    def start_preparing(self, nbytes: int, count: int, *, standing: bool = False) -> None:
        """Make up to ``count`` idle segments of ``nbytes`` in the background, within the budget
        (segments of one size at a time: a call for another size while some are on their way
        makes none). ``standing``: keep that many of them idle for good (see the class docstring)."""
        nbytes = self.store.pages.round(nbytes)
        with self._lock:
            if self._closed or (self._making and self._making_size != nbytes):
                return
            if standing:
                self._standing = (nbytes, count)
            reservations = []
            while len(reservations) < count:
                reservation = self.budget.try_take(nbytes)
                if reservation is None:
                    break
                reservations.append(reservation)
            self._making += len(reservations)
            self._making_size = nbytes
        for reservation in reservations:
            try:
                future = self.store.create_soon(nbytes)
            except BaseException:
                self._made(None, reservation)
                raise
            future.add_done_callback(functools.partial(self._made, reservation=reservation))

    def make_ahead(self, nbytes: int, wanted: int) -> None:
        """Segments of ``nbytes`` idle or on their way: at least ``wanted`` (a ring that grew makes
        its next slots off the load's thread, so growing again does not wait for a zero-fill)."""
        if self.idle_s <= 0:  # no idle segments wanted: each is made when a load needs it
            return
        nbytes = self.store.pages.round(nbytes)
        have = self.available(nbytes)
        if wanted > have:
            self.start_preparing(nbytes, wanted - have)

    def _made(self, future: Future[Segment] | None, reservation: Reservation) -> None:
        segment = None
        if future is not None:
            try:
                segment = future.result()
            except Exception as exc:  # noqa: BLE001 - a load that needs the room says it as a ConfigError
                log.warning("could not make a shared-memory segment ahead of need: %s", exc)
        with self._lock:
            self._making -= 1
            if segment is not None and not self._closed:
                self._idle.append((segment, reservation, time.monotonic() if self._first_taken else None))
                self.prepared += 1
                segment = reservation = None
            self._lock.notify_all()
        if segment is not None:
            segment.close()
        if reservation is not None:
            self.budget.give_back(reservation)

    def take(self, nbytes: int, *, oversized: bool = False) -> tuple[Segment, Reservation] | None:
        """A segment of ``nbytes`` (in whole huge pages where the dir has them): an idle one, or a
        new one if the budget allows; else None. Waits for a prepared one of that size on its way."""
        nbytes = self.store.pages.round(nbytes)
        with self._lock:
            # An oversized batch takes an idle segment of its exact size too: a reload of the same
            # checkpoint skips the zero-fill and first touch of its largest tensors (0.4 s/GiB on 4 KiB
            # pages on an H200 host).
            got = self._take_idle(nbytes)
        if got is not None:
            return got
        reservation = self.budget.try_take(nbytes, oversized=oversized)
        if reservation is None and self._evict_idle():
            reservation = self.budget.try_take(nbytes, oversized=oversized)
        if reservation is None:
            return None
        try:
            try:
                return self.store.create(nbytes), reservation
            except ConfigError:  # a shm dir smaller than the budget: idle segments never stand in the way
                if not self._evict_idle():
                    raise
                return self.store.create(nbytes), reservation
        except BaseException:
            self.budget.give_back(reservation)
            raise

    def adopt(self, nbytes: int, count: int) -> list[Segment]:
        """Up to ``count`` idle segments of ``nbytes`` (waiting for prepared ones on their way), out of
        the pool for good: their bytes leave the budget, and whoever adopts them pays for them and
        closes them (a retained load's claim). :meth:`restand` makes the standing ring whole again."""
        nbytes = self.store.pages.round(nbytes)
        adopted = []
        with self._lock:
            while len(adopted) < count and (got := self._take_idle(nbytes)) is not None:
                adopted.append(got)
        for _, reservation in adopted:
            self.budget.give_back(reservation)
        return [segment for segment, _ in adopted]

    def available(self, nbytes: int) -> int:
        """Idle segments of ``nbytes``, and those on their way."""
        nbytes = self.store.pages.round(nbytes)
        with self._lock:
            return sum(s.nbytes == nbytes for s, _, _ in self._idle) + (self._making if self._making_size == nbytes else 0)

    def restand(self) -> None:
        """Make the standing ring whole again in the background, where segments of it were adopted."""
        size, count = self._standing
        if count:
            self.make_ahead(size, count)

    def _take_idle(self, nbytes: int) -> tuple[Segment, Reservation] | None:
        """An idle segment of exactly ``nbytes``, waiting for one on its way; ``None`` if there is
        none. Called under the lock."""
        # The first load has started: prepared segments it leaves are idle like any other from now.
        self._first_taken = True
        self._idle = [(s, r, time.monotonic() if since is None else since) for s, r, since in self._idle]
        while True:
            for i, (segment, reservation, _) in enumerate(self._idle):
                if segment.nbytes == nbytes:
                    del self._idle[i]
                    self.reused += 1
                    return segment, reservation
            if not (self._making and self._making_size == nbytes):
                return None
            self._lock.wait()  # it holds budget this request would otherwise not find

    def give(self, segment: Segment, reservation: Reservation, *, keep: bool, now: float) -> None:
        """Return a segment no session uses; ``keep`` it idle for reuse, or unlink it now."""
        with self._lock:
            if keep and self.idle_s > 0 and not reservation.beyond_budget:
                self._idle.append((segment, reservation, now))
                return
        segment.close()
        self.budget.give_back(reservation)

    def trim(self, now: float) -> None:
        """Unlink segments idle for longer than ``idle_s`` (prepared ones wait for the first load),
        but for the standing ring's."""
        with self._lock:
            size, count = self._standing
            fresh = [e for e in self._idle if e[2] is None or now - e[2] < self.idle_s]
            stale = [e for e in self._idle if e[2] is not None and now - e[2] >= self.idle_s]
            stand = max(0, count - sum(e[0].nbytes == size for e in fresh))
            kept, gone = [], []
            for entry in stale:
                (kept if entry[0].nbytes == size and len(kept) < stand else gone).append(entry)
            self._idle = fresh + kept
        self._close(gone)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            while self._making:  # every segment on its way is closed as it comes
                self._lock.wait()
            idle, self._idle = self._idle, []
        self._close(idle)

    @property
    def idle(self) -> int:
        with self._lock:
            return len(self._idle)

    @property
    def preparing(self) -> bool:
        with self._lock:
            return self._making > 0

    def _evict_idle(self) -> bool:
        with self._lock:
            idle, self._idle = self._idle, []
        self._close(idle)
        return bool(idle)

    def _close(self, entries: list[tuple[Segment, Reservation, float | None]]) -> None:
        for segment, reservation, _ in entries:
            segment.close()
            self.budget.give_back(reservation)


def _try_flock(fd: int, operation: int) -> bool:
    try:
        fcntl.flock(fd, operation | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale_segments(shm_dir: Path, *, everything: bool = False) -> list[str]:
    """Remove segments of daemons that are gone; return their names. ``everything``: the caller
    holds the dir's exclusive lock, so no daemon that made them is alive (see the module docstring);
    otherwise only segments whose daemon's PID is gone from this PID namespace."""
    removed = []
    for path in Path(shm_dir).glob(f"{SEGMENT_PREFIX}*"):
        match = _NAME_RE.match(path.name)
        if match is None or (not everything and _alive(int(match.group(1)))):
            continue
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed.append(path.name)
    if removed:
        log.info("removed %d shared-memory segments left by a dead daemon in %s", len(removed), shm_dir)
    return removed
