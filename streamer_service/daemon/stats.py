"""What the daemon reports about itself: sessions, ranks, shared memory, the resident copies.

Small frozen dataclasses, read by attribute where the daemon uses them (``metrics``, the
rejoin bookkeeping) and turned into the JSON of ``GET /v1/stats`` in one place, :meth:`to_json`
(the field names there are the public contract: docs/daemon.md, the tests). Programs of ours
that read another daemon's stats (the demo, the benchmarks) parse that JSON back with
:meth:`DaemonStats.from_json` and read attributes too.
"""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, field, fields

__all__ = ["DaemonStats", "RankSummary", "ResidentStats", "SessionSummary"]


@dataclass(frozen=True)
class RankSummary:
    status: str  # ledger.RankStatus value
    bytes_selected: int
    bytes_delivered: int  # handed to the rank (not counted in metrics for a failed rank)
    error: str | None = None  # why the rank failed
    waiting: int = 0  # its requests for handles waiting now (one, or others its client gave up on)

    def to_json(self) -> dict:
        out = {
            "status": self.status, "bytes_selected": self.bytes_selected, "bytes_delivered": self.bytes_delivered,
            "waiting": self.waiting,
        }  # fmt: skip
        if self.error:
            out["error"] = self.error
        return out

    @classmethod
    def from_json(cls, body: dict) -> RankSummary:
        return cls(body["status"], body["bytes_selected"], body["bytes_delivered"], body.get("error"), body["waiting"])


@dataclass(frozen=True)
class SessionSummary:
    id: str
    key: str
    uri: str
    state: str  # session.SessionState value
    world_size: int
    bytes_read: int  # from storage
    bytes_from_memory: int  # handed out from the resident copy
    rejoin_of: str | None
    ranks: dict[int, RankSummary]
    error: str | None

    def to_json(self) -> dict:
        out = asdict(self)
        out["ranks"] = {rank: r.to_json() for rank, r in self.ranks.items()}
        return out

    @classmethod
    def from_json(cls, body: dict) -> SessionSummary:
        # JSON object keys are strings: the ranks come back as ints.
        ranks = {int(rank): RankSummary.from_json(r) for rank, r in body["ranks"].items()}
        return cls(**{**body, "ranks": ranks})


@dataclass(frozen=True)
class ResidentStats:
    retention_budget: int
    resident_bytes: int
    resident_checkpoints: tuple[dict, ...]  # uri, bytes, tensors, pins; most recent first
    resident_bytes_served: int
    resident_evictions: int


@dataclass(frozen=True)
class DaemonStats:
    shm_budget: int
    shm_in_use: int
    shm_peak: int
    shm_page_size: int  # the page size backing the shm dir (2 MiB: huge pages)
    segments_idle: int
    segments_reused: int
    bytes_read: int  # from storage, every session so far
    resident: ResidentStats
    sessions: tuple[SessionSummary, ...] = field(default_factory=tuple)  # joining or streaming
    finished: tuple[SessionSummary, ...] = field(default_factory=tuple)  # ended, newest last
    segments_prepared: int = 0  # made at start for the first load (SegmentPool.start_preparing)
    preloaded: bool = True  # what the daemon prepares at start is done (daemon.preload)

    def to_json(self) -> dict:
        resident = asdict(self.resident)
        resident["resident_checkpoints"] = list(resident["resident_checkpoints"])
        return {
            "shm_budget": self.shm_budget,
            "shm_in_use": self.shm_in_use,
            "shm_peak": self.shm_peak,
            "shm_page_size": self.shm_page_size,
            "segments_idle": self.segments_idle,
            "segments_reused": self.segments_reused,
            "segments_prepared": self.segments_prepared,
            "preloaded": self.preloaded,
            "bytes_read": self.bytes_read,
            **resident,
            "sessions": [s.to_json() for s in self.sessions],
            "finished": [s.to_json() for s in self.finished],
        }

    @classmethod
    def from_json(cls, body: dict) -> DaemonStats:
        """The stats of a daemon, from its ``GET /v1/stats`` JSON (:meth:`to_json`'s inverse)."""
        resident = {f.name: body[f.name] for f in fields(ResidentStats)}
        resident["resident_checkpoints"] = tuple(resident["resident_checkpoints"])
        return cls(
            # A field with a default may be missing: a daemon of an earlier version (the benchmarks' baseline).
            **{
                f.name: body[f.name]
                for f in fields(cls)
                if f.name not in ("resident", "sessions", "finished") and (f.name in body or f.default is MISSING)
            },
            resident=ResidentStats(**resident),
            sessions=tuple(SessionSummary.from_json(s) for s in body["sessions"]),
            finished=tuple(SessionSummary.from_json(s) for s in body["finished"]),
        )
