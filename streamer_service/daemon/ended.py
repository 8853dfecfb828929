"""What the daemon remembers of a session that ended: its outcome, for a rank that asks after it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from streamer_client.errors import SessionError, StreamerError

__all__ = ["ENDED_KEPT", "EndedSession", "remember"]

ENDED_KEPT = 256  # how many ended sessions' outcomes are remembered (rejoins, late requests)


@dataclass(frozen=True)
class EndedSession:
    """What the daemon remembers of a session that ended, for a rank that asks after it."""

    id: str
    key: str
    error: StreamerError | None
    done: frozenset[int] = field(default_factory=frozenset)  # ranks that received everything

    def next(self, rank: int, release: Sequence[int], wait_s: float, gone: object = None, peer_pid: int | None = None):
        if self.error is not None:  # a rank asking after its session failed learns why, not just "gone"
            raise type(self.error)(self.error.message, uri=self.error.uri, key=self.error.key)
        if rank in self.done:  # e.g. a load of zero tensors, over before its ranks first asked
            return [], True
        raise SessionError(f"unknown or finished session {self.id!r}")

    def leave(self, rank: int, error: str | None = None, peer_pid: int | None = None) -> None:
        """Leaving is idempotent."""


def remember(memory: dict, key, value) -> None:
    """``memory[key] = value``, forgetting the oldest entries beyond ``ENDED_KEPT``."""
    memory[key] = value
    while len(memory) > ENDED_KEPT:
        del memory[next(iter(memory))]
