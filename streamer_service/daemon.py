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

from streamer_client.errors import SessionError, StorageAccessDeniedError

from .checkpoint import open_checkpoint
from .metadata import MetadataCache
from .metrics import Metrics
from .plan import select as select_tensors
from .runai import check_credentials, storage_environment
from .session import Session, SessionState
from .settings import Settings
from .shm import SegmentPool, SegmentStore, ShmBudget, sweep_stale_segments
from .uri import StorageURI, parse_uri
from .versions import ObjectVersions

__all__ = ["Daemon"]

log = logging.getLogger(__name__)

_REAP_INTERVAL_S = 0.5


class Daemon:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.budget = ShmBudget(int(settings.shm_budget))
        # At least four slots fit the budget, so loading, delivery and release overlap.
        self.slot_size = min(int(settings.slot_size), max(int(settings.shm_budget) // 4, 1))
        self.sessions: dict[str, Session] = {}  # by key, while joining or streaming
        self.finished: list[dict] = []  # summaries of ended sessions, newest last (bounded)
        self.bytes_read = 0
        self._lock = threading.Lock()
        self._opening: dict[str, threading.Lock] = {}
        self._stop = threading.Event()
        self._reaper: threading.Thread | None = None
        self.store: SegmentStore | None = None
        self.pool: SegmentPool | None = None
        self._allow = [parse_uri(p).normalized for p in settings.allow]
        self.metrics = Metrics(self.stats)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self.store = SegmentStore(Path(self.settings.shm_dir), 0o640 if self.settings.group_access else 0o600)
        sweep_stale_segments(self.store.shm_dir)
        self.pool = SegmentPool(self.store, self.budget, self.settings.segment_idle_s)
        if not self._allow:
            log.warning("no --allow prefixes: this daemon will read any URI its credentials reach")
        self._reaper = threading.Thread(target=self._reap_loop, name="reaper", daemon=True)
        self._reaper.start()
        log.info(
            "daemon ready: shm %s (budget %d bytes, slots of %d), cache %s",
            self.store.shm_dir, self.budget.limit, self.slot_size, self.settings.cache_dir,
        )  # fmt: skip

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
    ) -> Session:
        parsed = self.check_allowed(uri)
        if world_size < 1:
            raise SessionError(f"world_size must be at least 1, got {world_size}")
        # Ranks join at once: one of them reads the headers, the others take the cached catalog.
        with self._lock:
            opening = self._opening.setdefault(parsed.cache_key, threading.Lock())
        with opening:
            checkpoint = open_checkpoint(parsed, self.settings, launch_id=launch_id)
        check_credentials(parsed, self.settings)
        # Refused before a session exists: a refused first join must not leave an empty session behind.
        if not 0 <= rank < world_size:
            raise SessionError(f"rank {rank} is outside world_size {world_size}", uri=parsed.normalized)
        select_tensors(checkpoint.catalog.tensors, select, priority)
        with self._lock:
            session = self.sessions.get(key)
            if session is None or session.state in (SessionState.DONE, SessionState.FAILED):
                session = Session(
                    key,
                    checkpoint,
                    world_size,
                    slot_size=self.slot_size,
                    pool=self.pool,
                    join_timeout_s=self.settings.join_timeout_s,
                    on_end=self._ended,
                    storage_environment=storage_environment(self.settings),
                    versions=ObjectVersions(parsed, checkpoint.catalog.files, self.settings),
                )
                self.sessions[key] = session
            elif session.checkpoint.uri != parsed:
                raise SessionError(
                    f"session {key!r} is loading {session.checkpoint.uri}, not {parsed.normalized}", uri=parsed.normalized
                )
        session.join(rank, world_size, select, priority)
        return session

    def session(self, session_id: str) -> Session:
        with self._lock:
            for session in self.sessions.values():
                if session.id == session_id:
                    return session
        raise SessionError(f"unknown or finished session {session_id!r}")

    def _ended(self, session: Session) -> None:
        summary = session.summary()
        self.metrics.session_ended(summary, session.checkpoint.uri.scheme.value)
        with self._lock:
            if self.sessions.get(session.key) is session:
                del self.sessions[session.key]
            self.bytes_read += session.stats.bytes_read
            self.finished.append(summary)
            del self.finished[:-64]

    def stats(self) -> dict:
        with self._lock:
            active = [s.summary() for s in self.sessions.values()]
            finished = list(self.finished)
        return {
            "shm_budget": self.budget.limit,
            "shm_in_use": self.budget.in_use,
            "shm_peak": self.budget.peak,
            "segments_idle": self.pool.idle,
            "segments_reused": self.pool.reused,
            "bytes_read": self.bytes_read + sum(s["bytes_read"] for s in active),
            "sessions": active,
            "finished": finished,
        }
