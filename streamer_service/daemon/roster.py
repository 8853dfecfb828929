"""Who joins a session: the rules a rank's join is checked against, each rank's selection, and
the join deadline.

A session waits for ``world_size`` ranks (a rejoin session for its one rank) before it plans the
union of their selections. A rank is refused, with a :class:`SessionError` naming the session,
when its world size differs from the session's, its rank is outside it, the session serves
another single rank, the load already started, or the rank joined already. A session still
waiting at its deadline fails, naming the missing ranks. The session holds the lock; the roster
only decides.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

from streamer_client.errors import SessionError

from ..checkpoint.catalog import TensorInfo
from ..checkpoint.plan import union_order
from ..uri import StorageURI
from .ledger import RankState

__all__ = ["Roster"]


class Roster:
    def __init__(
        self, key: str, uri: StorageURI, world_size: int, *, only: int | None, join_timeout_s: float, now: float
    ) -> None:
        self.key = key
        self.uri = uri
        self.world_size = world_size
        self.only = only  # the one rank a rejoin session serves; None for a group's session
        self._deadline = now + join_timeout_s
        self._timeout_s = join_timeout_s
        self._chosen: dict[int, tuple[Sequence[TensorInfo], Sequence[str] | None]] = {}  # each rank's selection
        self._callbacks: list[Callable[[], None]] = []

    @property
    def expected(self) -> int:
        """How many ranks must join before the load starts."""
        return 1 if self.only is not None else self.world_size

    @property
    def deadline(self) -> float:
        return self._deadline

    def check(self, rank: int, world_size: int, *, joined: Collection[int], started: bool) -> None:
        """Refuse ``rank``'s join where a rule says so (module docstring)."""
        if world_size != self.world_size:
            raise SessionError(
                f"rank {rank} joined session {self.key!r} with world_size {world_size}, "
                f"but the session has world_size {self.world_size}",
                uri=self.uri.normalized,
            )
        if not 0 <= rank < self.world_size:
            raise SessionError(f"rank {rank} is outside world_size {self.world_size}")
        if self.only is not None and rank != self.only:
            raise SessionError(f"session {self.key!r} serves rank {self.only} only, not rank {rank}")
        if started:
            raise SessionError(
                f"session {self.key!r} for {self.uri} already started; rank {rank} joined too late",
                uri=self.uri.normalized,
            )
        if rank in joined:
            raise SessionError(f"rank {rank} already joined session {self.key!r}", uri=self.uri.normalized)

    def choose(self, rank: int, chosen: Sequence[TensorInfo], priority: Sequence[str] | None) -> None:
        self._chosen[rank] = (chosen, priority)

    def drop(self, rank: int) -> None:
        self._chosen.pop(rank, None)

    def union(self, tensors: Sequence[TensorInfo]) -> list[TensorInfo]:
        """What the session streams: the union of the ranks' selections, in the one order."""
        return union_order(tensors, [self._chosen[r] for r in sorted(self._chosen)])

    def error(self, why: str) -> SessionError:
        """The session's error: ``session <key> for <uri>: <why>``."""
        return SessionError(f"session {self.key!r} for {self.uri}: {why}", uri=self.uri.normalized)

    def left_early(self, rank: int, error: str | None) -> SessionError:
        """The session's error when joined rank ``rank`` leaves (having failed with ``error``) before every rank joined."""
        return self.error(f"rank {rank} left before every rank joined" + (f" ({error})" if error else ""))

    def expired(self, now: float, joined: Collection[int]) -> SessionError | None:
        """The error of a session still waiting for ranks at ``now``, past its deadline."""
        if now < self._deadline:
            return None
        missing = sorted(set(range(self.world_size)) - set(joined))
        return self.error(
            f"only {len(joined)} of {self.world_size} ranks joined within {self._timeout_s:g} s (missing ranks {missing})"
        )

    def member(self, rank: int, state: RankState | None, peer_pid: int | None = None) -> RankState:
        """``rank``'s state for one of its requests: refused when it never joined, or when the
        request's process (``peer_pid``) is not the one that joined as the rank, where the daemon
        knows both (a unix-socket peer it can watch). A reclaimed rank is a member still: it may
        release what it holds and leave, and is refused anything more (the session's ``next``)."""
        if state is None:
            raise SessionError(f"rank {rank} is not part of session {self.key!r}")
        joined = state.process.pid if state.process is not None else None
        if joined and peer_pid and peer_pid != joined:
            raise SessionError(
                f"rank {rank} of session {self.key!r} joined from process {joined}; this request came from process "
                f"{peer_pid}, and only the rank's own process may ask for its tensors, release them or leave",
                uri=self.uri.normalized,
            )
        return state

    def reclaimed(self, rank: int) -> SessionError:
        """What a rank reclaimed by the reaper is answered."""
        return SessionError(
            f"rank {rank} of session {self.key!r} was reclaimed after being silent too long "
            "(STREAMER_RANK_TIMEOUT_S); restart the load",
            uri=self.uri.normalized,
        )

    def on_joined(self, callback: Callable[[], None]) -> None:
        self._callbacks.append(callback)

    def joined_callbacks(self) -> list[Callable[[], None]]:
        """The callbacks waiting for the join to end, taken (each is called once)."""
        callbacks, self._callbacks = self._callbacks, []
        return callbacks
