"""The node daemon's state: sessions by key, the shared-memory budget, the reaper.

The HTTP layer (``api``) is a thin shell over :class:`Daemon`; tests and the
demo can drive the same object through it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from streamer_client import _slicing as slicing
from streamer_client._dtypes import WITH_TORCH_DTYPE, check_loadable
from streamer_client.errors import SessionError, StreamerError

from ..access import AllowList, file_mode
from ..checkpoint.open import open_checkpoint
from ..checkpoint.plan import select as select_tensors
from ..checkpoint.versions import ObjectVersions
from ..metadata.cache import MetadataCache
from ..readers.choice import reader_for
from ..readers.kept import KeptReaders
from ..readers.runai import check_credentials, storage_environment
from ..settings import Settings
from ..sizing import first_ring_slots, in_flight_bytes, slot_bytes
from ..uri import StorageURI
from .ended import EndedSession, remember
from .ledger import UNFINISHED, RankStatus
from .metrics import Metrics, build_info
from .pages import small_pages_advice
from .preload import start_preloading
from .process import ProcessWatch
from .resident import ResidentStore
from .segment_pool import SegmentPool
from .session import Session, SessionState
from .shm import SegmentStore, ShmBudget
from .stats import DaemonStats, SessionSummary

__all__ = ["Daemon"]

log = logging.getLogger(__name__)

_REAP_INTERVAL_S = 0.5
STOP_DRAIN_S = 2.0  # on SIGTERM, how long past the grace the reads in flight may drain (Daemon.stop)


@dataclass
class _Refusal:
    """A rank of a group was refused at its join: the rest of the group is told at once. The ranks
    told are kept, not those still to tell: a group of 65,536 ranks would otherwise hold a set of
    that size for each refused join."""

    rank: int
    error: SessionError
    world_size: int
    told: set[int]  # the refused rank, and those of the group told since
    until: float


class Daemon:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.budget = ShmBudget(int(settings.shm_budget))
        # At least four slots fit the budget, so loading, delivery and release overlap (``sizing``).
        self.slot_size = slot_bytes(int(settings.shm_budget), int(settings.slot_size))
        self.in_flight = in_flight_bytes(settings.target_gbps, self.slot_size, int(settings.shm_budget))
        self.sessions: dict[str, Session] = {}  # by key, while joining or streaming
        # Ranks of recently ended sessions that did not receive everything, by key: their rejoin is
        # served on its own instead of waiting for a whole new group.
        self._unfinished: dict[str, set[int]] = {}
        self._ended_sessions: dict[str, EndedSession] = {}  # recently ended sessions, by id
        # Ended sessions whose ranks still hold batches, by id: they answer those ranks' requests
        # (releases, leave) until they let go, and the reaper watches their processes meanwhile.
        self._holding: dict[str, Session] = {}
        self._refusals: dict[str, _Refusal] = {}  # by session key
        self._rejoins = 0
        self.resident = ResidentStore(int(settings.retention_budget))
        self.finished: list[SessionSummary] = []  # ended sessions, newest last (bounded)
        self.bytes_read = 0
        self._lock = threading.Lock()
        self._opening: dict[str, list] = {}  # by cache key: [lock, joins holding or waiting for it]
        self._stop = threading.Event()
        self.stopping = False  # the daemon tells its ranks it stops, then stops serving
        self._reaper: threading.Thread | None = None
        self.reaper_stopped: str | None = None  # why the reaper thread ended, if it ever does
        self.abandoned: list[Session] = []  # still reading when the stop gave up on them (stop)
        self.store: SegmentStore | None = None
        self.pool: SegmentPool | None = None
        # Run:ai's reader of the last load, kept started for the next (its buffers stay allocated).
        self.readers = KeptReaders(settings.segment_idle_s)
        self.allow = AllowList(settings.allow)
        self.metrics = Metrics(self.stats, build=build_info(settings.build_revision))

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self.store = SegmentStore(Path(self.settings.shm_dir), file_mode(self.settings))
        self.store.open()  # sweeps what daemons that are gone left behind
        self.pool = SegmentPool(self.store, self.budget, self.settings.segment_idle_s)
        if self.settings.segment_prepare and self.settings.segment_idle_s > 0:
            # The first load's ring, made now and kept between loads: a load otherwise pays the
            # zero-fill and mapping of every segment on its own thread (docs/deploy.md). A retained
            # load keeps them for its first batches, and the pool makes them again after it.
            first = first_ring_slots(self.budget.limit, self.slot_size, self.in_flight)
            self.pool.start_preparing(self.slot_size, first, standing=True)
        if self.allow.any:
            log.warning("no --allow prefixes: this daemon will read any URI its credentials reach")
        self._reaper = threading.Thread(target=self._reap_supervised, name="reaper", daemon=True)
        self._reaper.start()
        self._preloaded = start_preloading(self.allow.cloud_schemes)
        pages = self.store.pages
        log.info(
            "daemon ready: shm %s (budget %d bytes, slots of %d, at most %d bytes in flight for %d Gbit/s, %d KiB pages: %s), cache %s",
            self.store.shm_dir, self.budget.limit, self.slot_size, self.in_flight, self.settings.target_gbps,
            pages.size // 1024, pages.source, self.settings.cache_dir,
        )  # fmt: skip
        if not pages.huge:
            log.warning("%s", small_pages_advice(self.store.shm_dir, pages))

    def tell_stopping(self) -> None:
        """Refuse new joins, stop every session (reads in flight drain, nothing new is read) and
        answer each rank's next request ``SessionError`` "the daemon is stopping"; wait until every
        rank still reading was told, or ``STREAMER_STOP_GRACE_S`` passed, before the sessions give
        their segments back, and :data:`STOP_DRAIN_S` more for the reads in flight. A session
        still reading then is abandoned (:meth:`stop`). Called while the API still serves, before
        it stops."""
        with self._lock:
            if self.stopping:
                return
            self.stopping = True
            sessions = list(self.sessions.values())
        if self.pool is not None:  # a session that ends now leaves its segments for close to unlink
            self.pool.stop_making()
        grace = self.settings.stop_grace_s
        log.info("stopping: telling the ranks of %d sessions (for up to %g s)", len(sessions), grace)
        for session in sessions:
            session.cancel("the daemon is stopping", tell_s=grace)
        deadline = time.monotonic() + grace + STOP_DRAIN_S
        for session in sessions:
            if not session.wait_ended(max(deadline - time.monotonic(), 0.0)):
                self.abandoned.append(session)
        if self.abandoned:
            log.warning("sessions %s still wait for storage reads %g s after the stop began: the reads are abandoned; the daemon "
                        "unlinks its segments, leaves them mapped for the reads still writing into them, and exits at once",
                        ", ".join(s.key for s in self.abandoned), grace + STOP_DRAIN_S)  # fmt: skip

    def stop(self) -> None:
        """:meth:`tell_stopping` (where the API did not already), then give back the pool's
        segments and the resident copies. Where reads were abandoned, every segment file is unlinked
        and none unmapped: a native read may still write into them (the process exits: ``cli.main``)."""
        self.tell_stopping()
        self._stop.set()
        if self._reaper is not None:
            self._reaper.join(timeout=5)
        if self.abandoned:
            if self.store is not None:
                self.store.abandon()
            return
        self.readers.close()
        if self.pool is not None:
            self.pool.close()
        with self._lock:
            holding, self._holding = list(self._holding.values()), {}
        for session in holding:  # into the closed pool: unlinked
            session.let_go()
        self.resident.close()
        if self.store is not None:
            self.store.close()

    def reaper_alive(self) -> bool:
        return self._reaper is not None and self._reaper.is_alive()

    def _reap_supervised(self) -> None:
        try:
            self._reap_loop()
        except BaseException as exc:  # noqa: BLE001 - whatever ends the reaper is reported, never silent
            self.reaper_stopped = f"the reaper stopped ({type(exc).__name__}: {exc})"
            log.critical(
                "%s: dead ranks are no longer reclaimed and idle segments no longer trimmed; /readyz says not ready",
                self.reaper_stopped, exc_info=True,
            )  # fmt: skip

    def _reap_loop(self) -> None:
        while not self._stop.wait(_REAP_INTERVAL_S):
            with self._lock:
                sessions = [*self.sessions.values(), *self._holding.values()]
            now = time.monotonic()
            for session in sessions:
                session.reap(now, self.settings.rank_timeout_s)
            with self._lock:
                for session in [s for s in self._holding.values() if not s.holding]:
                    del self._holding[session.id]
            self.pool.trim(now)
            self.store.vanished()  # logged as soon as noticed, probed or not
            self.readers.trim(now)

    # ------------------------------------------------------------------ requests

    def check_allowed(self, uri: str) -> StorageURI:
        return self.allow.check(uri)

    def pull(self, uri: str, *, force: bool | None, launch_id: str | None) -> Path:
        parsed = self.check_allowed(uri)
        cache = MetadataCache(self.settings)
        path = cache.pull(parsed, force=force, launch_id=launch_id)
        self.metrics.metadata.labels(result="miss" if cache.downloads else "hit").inc()
        return path

    def join(
        self,
        *,
        uri: str,
        key: str,
        rank: int,
        world_size: int,
        select: Sequence[str] | None,
        priority: Sequence[str] | None,
        launch_id: str | None,
        force: bool | None = None,
        pins: bool = False,
        dtypes: Sequence[str] | None = None,
        slices: Mapping[str, list[list[int]]] | None = None,
        peer_pid: int | None = None,
    ) -> Session:
        """Join ``rank`` to the group's session ``key``; ``pins``: the rank may page-lock the
        segments it copies from; ``dtypes``: the safetensors dtypes the rank's torch has (None:
        every one of the table's with a torch dtype); ``slices``: the parts of tensors the rank keeps
        (checked here; the rank cuts them); ``peer_pid``: the rank's process, where the unix socket tells it.
        Returns once the rank is in the session, without waiting for the others: ``Session.on_joined``, then ``joined``."""
        self._refuse_if_stopping(key, rank, uri)
        self._told_of_refusal(key, rank)
        try:
            parsed, checkpoint, chosen, keeps = self._admit(
                uri, rank, world_size, select, priority, launch_id, force, dtypes, slices
            )
        except StreamerError as exc:
            self._refuse(key, rank, world_size, exc)
            raise
        session = self._join_session(key, rank, world_size, parsed, checkpoint)
        state = session.add(rank, world_size, chosen, priority, ProcessWatch.of(peer_pid), pins=pins)
        state.keeps = keeps  # read once the session started, for the rank's join reply
        return session

    def _admit(self, uri, rank, world_size, select, priority, launch_id, force, dtypes, slices):
        """Everything a join can be refused for, checked before a session exists: a refused join
        must not leave an empty session behind."""
        parsed = self.check_allowed(uri)
        if world_size < 1:
            raise SessionError(f"world_size must be at least 1, got {world_size}")
        # Ranks join at once: one of them reads the headers, the others take the cached catalog.
        with self._opening_lock(parsed.cache_key):
            checkpoint = open_checkpoint(parsed, self.settings, force=force, launch_id=launch_id)
        check_credentials(parsed, self.settings)
        if not 0 <= rank < world_size:
            raise SessionError(f"rank {rank} is outside world_size {world_size}", uri=parsed.normalized)
        chosen = select_tensors(checkpoint.catalog.tensors, select, priority)
        have = WITH_TORCH_DTYPE if dtypes is None else frozenset(dtypes)
        check_loadable(chosen, uri=parsed.normalized, have=have, whose=f"rank {rank}'s torch")
        kept = slicing.cuts(chosen, slicing.parse(slices), uri=parsed.normalized)
        return parsed, checkpoint, chosen, slicing.kept_bytes(chosen, kept)

    @contextlib.contextmanager
    def _opening_lock(self, cache_key: str) -> Iterator[None]:
        """Held while a checkpoint is opened: one opening per URI at a time. Kept only while some
        join holds or waits for it, so URIs that were opened once cost nothing afterwards."""
        with self._lock:
            entry = self._opening.get(cache_key)
            if entry is None:
                entry = self._opening[cache_key] = [threading.Lock(), 0]
            entry[1] += 1
        try:
            with entry[0]:
                yield
        finally:
            with self._lock:
                entry[1] -= 1
                if entry[1] == 0:
                    del self._opening[cache_key]

    def _refuse(self, key: str, rank: int, world_size: int, exc: StreamerError) -> None:
        """Rank ``rank`` of group ``key`` was refused: fail the group's joining session now and
        tell the ranks that have not joined yet when they do."""
        error = SessionError(
            f"rank {rank} of session {key!r} was refused ({type(exc).__name__}: {exc.message}); "
            "the other ranks cannot load without it",
            uri=exc.uri,
            key=exc.key,
        )
        with self._lock:
            session = self.sessions.get(key)
            told = set(session.ranks) if session is not None and session.state is SessionState.JOINING else set()
            if len(told | {rank}) < world_size:
                until = time.monotonic() + self.settings.join_timeout_s
                self._refusals[key] = _Refusal(rank, error, world_size, told | {rank}, until)
        if told:
            session.refuse(error)

    def _told_of_refusal(self, key: str, rank: int) -> None:
        """Raise the refusal of another rank of this group, once per rank; a refused rank that
        tries again starts over."""
        with self._lock:
            now = time.monotonic()
            for k in [k for k, r in self._refusals.items() if r.until < now]:
                del self._refusals[k]
            refusal = self._refusals.get(key)
            if refusal is None:
                return
            if rank == refusal.rank:
                del self._refusals[key]
                return
            if rank in refusal.told or rank >= refusal.world_size:
                return
            refusal.told.add(rank)
            if len(refusal.told) >= refusal.world_size:
                del self._refusals[key]
        error = refusal.error  # a copy per rank: ranks raise it in threads of their own
        raise SessionError(error.message, uri=error.uri, key=error.key)

    def _join_session(self, key, rank, world_size, parsed, checkpoint) -> Session:
        deadline = time.monotonic() + self.settings.rank_timeout_s + 4 * _REAP_INTERVAL_S
        while True:
            with self._lock:
                self._refuse_if_stopping(key, rank, parsed.normalized)  # under the lock tell_stopping takes
                session = self.sessions.get(key)
                if session is not None and session.checkpoint.uri != parsed:
                    raise SessionError(
                        f"session {key!r} is loading {session.checkpoint.uri}, not {parsed.normalized}", uri=parsed.normalized
                    )
                if self._rejoining(key, session, rank):
                    self._rejoins += 1
                    log.info("rank %d rejoins %s: a session of its own, from memory where it can", rank, key)
                    session = self._new_session(f"{key}#rank{rank}.{self._rejoins}", checkpoint, world_size, rejoin=(key, rank))
                    self.sessions[session.key] = session
                    break
                if session is None or session.state in (SessionState.DONE, SessionState.FAILED):
                    session = self._new_session(key, checkpoint, world_size)
                    self.sessions[key] = session
                    break
                if session.state is SessionState.JOINING or rank not in session.ranks:
                    break
            # The rank is loading already: a restarted process whose old self the reaper has not
            # reclaimed yet, or a second process with the same rank. Wait for the reaper.
            if time.monotonic() > deadline:
                raise SessionError(
                    f"rank {rank} is still loading in session '{key}' ({parsed.normalized}); "
                    "two processes cannot be the same rank (a dead one is reclaimed after "
                    f"STREAMER_RANK_TIMEOUT_S = {self.settings.rank_timeout_s:g} s)",
                    uri=parsed.normalized,
                )
            time.sleep(_REAP_INTERVAL_S / 2)
        return session

    def _refuse_if_stopping(self, key: str, rank: int, uri: str) -> None:
        if self.stopping:
            raise SessionError(f"session {key!r}: rank {rank} cannot join: the daemon is stopping", uri=uri)

    def _rejoining(self, key: str, session: Session | None, rank: int) -> bool:
        """Whether ``rank`` comes back to a load it did not finish (the others did, or still load)."""
        state = session.ranks.get(rank) if session is not None else None
        if session is not None and session.state is SessionState.STREAMING:
            return state is not None and state.status is not RankStatus.ACTIVE
        if session is not None and session.load_complete:  # ended, not yet reported
            return state is not None and state.status in UNFINISHED
        return session is None and rank in self._unfinished.get(key, ())

    def _new_session(self, key: str, checkpoint, world_size: int, *, rejoin: tuple[str, int] | None = None) -> Session:
        return Session(
            key,
            checkpoint,
            world_size,
            slot_size=self.slot_size,
            in_flight=self.in_flight,
            pool=self.pool,
            join_timeout_s=self.settings.join_timeout_s,
            on_end=self._ended,
            resident=self.resident,
            rejoin=rejoin,
            storage_environment=storage_environment(self.settings),
            versions=ObjectVersions.of(checkpoint, self.settings),
            reader_factory=reader_for(checkpoint.uri, self.settings.local_reader),
            readers=self.readers,
        )

    def session(self, session_id: str) -> Session | EndedSession:
        with self._lock:
            for session in self.sessions.values():
                if session.id == session_id:
                    return session
            held = self._holding.get(session_id)
            if held is not None:
                return held
            ended = self._ended_sessions.get(session_id)
        if ended is not None:
            return ended
        raise SessionError(f"unknown or finished session {session_id!r}")

    def _ended(self, session: Session) -> None:
        summary = session.summary()
        union = set().union(*(r.names for r in session.ranks.values()))
        self.metrics.session_ended(
            summary,
            session.checkpoint.uri.scheme.value,
            session.stats.read_seconds,
            unique_bytes=sum(t.nbytes for t in session.checkpoint.catalog.tensors if t.name in union),
            times=session.times,
            error=type(session.error).__name__ if session.error is not None else None,
        )
        with self._lock:
            if self.sessions.get(session.key) is session:
                del self.sessions[session.key]
            if session.rejoin is None:
                self._unfinished.pop(session.key, None)
                left = {r.rank for r in session.ranks.values() if r.status in UNFINISHED}
                if left and session.load_complete:
                    remember(self._unfinished, session.key, left)
            elif session.state is SessionState.DONE and all(r.status is RankStatus.DONE for r in session.ranks.values()):
                group, rank = session.rejoin  # caught up: its next join is its group's again
                self._unfinished.get(group, set()).discard(rank)
            self.bytes_read += session.stats.bytes_read
            self.finished.append(summary)
            del self.finished[:-64]
            done = frozenset(r.rank for r in session.ranks.values() if r.received_everything)
            remember(self._ended_sessions, session.id, EndedSession(session.id, session.key, session.error, done))
            if session.holding:
                self._holding[session.id] = session

    def stats(self) -> DaemonStats:
        with self._lock:  # summaries outside it: a session ending holds its own lock and takes this one
            sessions = list(self.sessions.values())
            finished = tuple(self.finished)
        active = tuple(s.summary() for s in sessions)
        return DaemonStats(
            shm_budget=self.budget.limit,
            shm_in_use=self.budget.in_use,
            shm_peak=self.budget.peak,
            shm_page_size=self.store.pages.size if self.store is not None else 0,
            segments_idle=self.pool.idle,
            segments_reused=self.pool.reused,
            segments_prepared=self.pool.prepared,
            bytes_read=self.bytes_read + sum(s.bytes_read for s in active),
            resident=self.resident.stats(),
            sessions=active,
            finished=finished,
            preloaded=self._preloaded.is_set(),
        )
