"""The node daemon's state: sessions by key, the shared-memory budget, the reaper.

The HTTP layer (``api``) is a thin shell over :class:`Daemon`; tests and the
demo can drive the same object through it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from streamer_client.errors import SessionError, StorageAccessDeniedError, StreamerError

from .checkpoint import open_checkpoint
from .metadata import MetadataCache
from .metrics import Metrics, build_info
from .plan import select as select_tensors
from .resident import ResidentStore
from .runai import check_credentials, storage_environment
from .session import RankStatus, Session, SessionState
from .settings import Settings
from .shm import SegmentPool, SegmentStore, ShmBudget, small_pages_advice, sweep_stale_segments
from .uri import StorageURI, parse_uri
from .versions import ObjectVersions

__all__ = ["Daemon"]

log = logging.getLogger(__name__)

_REAP_INTERVAL_S = 0.5
_ENDED_KEPT = 256  # how many ended sessions' outcomes are remembered (rejoins, late requests)


def _remember(memory: dict, key, value) -> None:
    """``memory[key] = value``, forgetting the oldest entries beyond ``_ENDED_KEPT``."""
    memory[key] = value
    while len(memory) > _ENDED_KEPT:
        del memory[next(iter(memory))]


class Daemon:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.budget = ShmBudget(int(settings.shm_budget))
        # At least four slots fit the budget, so loading, delivery and release overlap.
        self.slot_size = min(int(settings.slot_size), max(int(settings.shm_budget) // 4, 1))
        self.sessions: dict[str, Session] = {}  # by key, while joining or streaming
        # Ranks of recently ended sessions that did not receive everything, by key: their rejoin is
        # served on its own instead of waiting for a whole new group.
        self._unfinished: dict[str, set[int]] = {}
        self._failures: dict[str, StreamerError] = {}  # errors of recently failed sessions, by id
        self._rejoins = 0
        self.resident = ResidentStore(int(settings.retention_budget))
        self.finished: list[dict] = []  # summaries of ended sessions, newest last (bounded)
        self.bytes_read = 0
        self._lock = threading.Lock()
        self._opening: dict[str, threading.Lock] = {}
        self._stop = threading.Event()
        self._reaper: threading.Thread | None = None
        self.store: SegmentStore | None = None
        self.pool: SegmentPool | None = None
        self._allow = [parse_uri(p).normalized for p in settings.allow]
        self.metrics = Metrics(self.stats, build=build_info(settings.build_revision))

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self.store = SegmentStore(Path(self.settings.shm_dir), 0o640 if self.settings.group_access else 0o600)
        sweep_stale_segments(self.store.shm_dir)
        self.pool = SegmentPool(self.store, self.budget, self.settings.segment_idle_s)
        if not self._allow:
            log.warning("no --allow prefixes: this daemon will read any URI its credentials reach")
        self._reaper = threading.Thread(target=self._reap_loop, name="reaper", daemon=True)
        self._reaper.start()
        pages = self.store.pages
        log.info(
            "daemon ready: shm %s (budget %d bytes, slots of %d, %d KiB pages: %s), cache %s",
            self.store.shm_dir, self.budget.limit, self.slot_size, pages.size // 1024, pages.source, self.settings.cache_dir,
        )  # fmt: skip
        if not pages.huge:
            log.warning("%s", small_pages_advice(self.store.shm_dir, pages))

    def stop(self) -> None:
        self._stop.set()
        if self._reaper is not None:
            self._reaper.join(timeout=5)
        with self._lock:
            sessions = list(self.sessions.values())
        for session in sessions:
            for rank in list(session.ranks):
                try:
                    session.leave(rank)
                except SessionError:
                    pass
            session.reap(float("inf"), 0.0)
        if self.pool is not None:
            self.pool.close()
        self.resident.close()

    def _reap_loop(self) -> None:
        while not self._stop.wait(_REAP_INTERVAL_S):
            with self._lock:
                sessions = list(self.sessions.values())
            now = time.monotonic()
            for session in sessions:
                session.reap(now, self.settings.rank_timeout_s)
            self.pool.trim(now)

    # ------------------------------------------------------------------ requests

    def check_allowed(self, uri: str) -> StorageURI:
        parsed = parse_uri(uri)
        if self._allow and not any(
            parsed.normalized == prefix or parsed.normalized.startswith(prefix.rstrip("/") + "/") for prefix in self._allow
        ):
            raise StorageAccessDeniedError(
                f"this daemon may not read {parsed.normalized}: not under any --allow prefix", uri=parsed.normalized
            )
        return parsed

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
    ) -> Session:
        parsed = self.check_allowed(uri)
        if world_size < 1:
            raise SessionError(f"world_size must be at least 1, got {world_size}")
        # Ranks join at once: one of them reads the headers, the others take the cached catalog.
        with self._lock:
            opening = self._opening.setdefault(parsed.cache_key, threading.Lock())
        with opening:
            checkpoint = open_checkpoint(parsed, self.settings, force=force, launch_id=launch_id)
        check_credentials(parsed, self.settings)
        # Refused before a session exists: a refused first join must not leave an empty session behind.
        if not 0 <= rank < world_size:
            raise SessionError(f"rank {rank} is outside world_size {world_size}", uri=parsed.normalized)
        chosen = select_tensors(checkpoint.catalog.tensors, select, priority)
        deadline = time.monotonic() + self.settings.rank_timeout_s + 4 * _REAP_INTERVAL_S
        while True:
            with self._lock:
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
        session.join(rank, world_size, chosen, priority)
        return session

    def _rejoining(self, key: str, session: Session | None, rank: int) -> bool:
        """Whether ``rank`` comes back to a load it did not finish (the others did, or still load)."""
        state = session.ranks.get(rank) if session is not None else None
        if session is not None and session.state is SessionState.STREAMING:
            return state is not None and state.status is not RankStatus.ACTIVE
        if session is not None and session.state is SessionState.DONE:  # ended, not yet reported
            return state is not None and state.status in (RankStatus.LEFT, RankStatus.RECLAIMED)
        return session is None and rank in self._unfinished.get(key, ())

    def _new_session(self, key: str, checkpoint, world_size: int, *, rejoin: tuple[str, int] | None = None) -> Session:
        return Session(
            key,
            checkpoint,
            world_size,
            slot_size=self.slot_size,
            pool=self.pool,
            join_timeout_s=self.settings.join_timeout_s,
            on_end=self._ended,
            resident=self.resident,
            rejoin=rejoin,
            storage_environment=storage_environment(self.settings),
            versions=ObjectVersions.of(checkpoint, self.settings),
        )

    def session(self, session_id: str) -> Session:
        with self._lock:
            for session in self.sessions.values():
                if session.id == session_id:
                    return session
            failed = self._failures.get(session_id)
        if failed is not None:  # a rank asking after its session failed learns why, not just "gone"
            raise type(failed)(failed.message, uri=failed.uri, key=failed.key)
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
                left = {r.rank for r in session.ranks.values() if r.status in (RankStatus.LEFT, RankStatus.RECLAIMED)}
                if left and session.state is SessionState.DONE:
                    _remember(self._unfinished, session.key, left)
            elif session.state is SessionState.DONE and all(r.status is RankStatus.DONE for r in session.ranks.values()):
                group, rank = session.rejoin  # caught up: its next join is its group's again
                self._unfinished.get(group, set()).discard(rank)
            self.bytes_read += session.stats.bytes_read
            self.finished.append(summary)
            del self.finished[:-64]
            if session.error is not None:
                _remember(self._failures, session.id, session.error)

    def stats(self) -> dict:
        with self._lock:
            active = [s.summary() for s in self.sessions.values()]
            finished = list(self.finished)
        return {
            "shm_budget": self.budget.limit,
            "shm_in_use": self.budget.in_use,
            "shm_peak": self.budget.peak,
            "shm_page_size": self.store.pages.size if self.store is not None else 0,
            "segments_idle": self.pool.idle,
            "segments_reused": self.pool.reused,
            "bytes_read": self.bytes_read + sum(s["bytes_read"] for s in active),
            **self.resident.stats(),
            "sessions": active,
            "finished": finished,
        }
