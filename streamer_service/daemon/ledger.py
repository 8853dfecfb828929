"""The rank ledger of a session: which rank holds which batch (leases), release, reclaim.

A batch published to the ranks that need tensors of it is leased to each of them; its buffer
(``token``: the session's slot, or ``None`` for memory the session does not own) may be reused
once no rank holds it. The ledger says when: :meth:`RankLedger.release`,
:meth:`~RankLedger.leave`, :meth:`~RankLedger.reclaim` and :meth:`~RankLedger.end` return the
tokens that nobody holds any more.

The lifetime rule (docs/architecture.md, "Segments"): the lease on a batch a rank was *handed*
(its handles are in the rank's hands: it may be copying their bytes) ends only when the rank
releases it, says leave, or is known dead (its process gone). A session that fails or ends, or a
rank silent past the rank timeout, ends the leases of batches the rank was never handed and
fences a silent rank (:attr:`RankStatus.RECLAIMED`: its next request is refused), but a live
rank keeps what it holds. Only a rank whose process the daemon cannot watch (``process`` is
``None``: another PID namespace) loses its holds at the rank timeout; the segments' generations
then turn a late copy of reused bytes into an error at the rank.

Lease, release and reclaim are defined with the segments' other words in docs/architecture.md,
"Segments". Not thread-safe: the session calls it under its own lock. No I/O, no clock of its own.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from streamer_client._protocol import Handle

from .process import ProcessWatch
from .stats import RankSummary

__all__ = ["UNLEASED_SHARE", "RankLedger", "RankState", "RankStatus"]


class RankStatus(enum.Enum):
    ACTIVE = "active"
    DONE = "done"  # received every tensor and left
    LEFT = "left"  # left before receiving every tensor (abandoned)
    FAILED = "failed"  # left with an error of its own (e.g. it could not map a segment)
    RECLAIMED = "reclaimed"  # silent too long, or its process is gone


UNFINISHED = (RankStatus.LEFT, RankStatus.FAILED, RankStatus.RECLAIMED)
"""Ranks that did not receive everything: when they come back, they rejoin their group's load."""

UNLEASED_SHARE = 16
"""A reply holds about 16 times as many bytes of memory no ring waits for as of ring slots."""


@dataclass(eq=False)
class RankState:
    rank: int
    names: frozenset[str]
    nbytes: int  # of the tensors it selected, whole: what it is handed
    queue: deque[Handle] = field(default_factory=deque)
    outstanding: set[int] = field(default_factory=set)  # batches leased to this rank
    held: set[int] = field(default_factory=set)  # of those, the ones handed to it: what it may release
    to_hand_out: int = 0
    delivered_bytes: int = 0
    last_seen: float = 0.0
    status: RankStatus = RankStatus.ACTIVE
    error: str | None = None  # why the rank failed (RankStatus.FAILED)
    asking: int = 0  # requests of this rank waiting for handles: it is not silent while it waits for us
    polls: int = 0  # requests for handles so far: a newer one answers in place of those still waiting
    process: ProcessWatch | None = None  # the rank's process, where the daemon can see it
    keeps: int = 0  # of those bytes, the ones it keeps: fewer where it slices tensors (its join reply says it)

    @property
    def received_everything(self) -> bool:
        return self.status is RankStatus.DONE or (self.status is RankStatus.ACTIVE and not self.to_hand_out and not self.queue)

    @property
    def finished(self) -> bool:
        """Nothing more to do for this rank: gone, or handed and released everything."""
        return self.status is not RankStatus.ACTIVE or (not self.to_hand_out and not self.outstanding and not self.queue)

    def gone(self) -> bool:
        """Whether the rank's process is known to have exited."""
        return self.process is not None and self.process.exited()

    def stop_watching(self) -> None:
        if self.process is not None:
            self.process.close()
            self.process = None

    def summary(self) -> RankSummary:
        return RankSummary(self.status.value, self.nbytes, self.delivered_bytes, self.error, self.asking)


class RankLedger:
    """The ranks of one session and the batches leased to them."""

    def __init__(self) -> None:
        self.ranks: dict[int, RankState] = {}
        self._leases: dict[int, tuple[int, Any]] = {}  # batch -> (ranks holding it, token)

    def add(
        self, rank: int, names: frozenset[str], nbytes: int, count: int, process: ProcessWatch | None, now: float
    ) -> RankState:
        state = RankState(rank, names, nbytes, to_hand_out=count, last_seen=now, process=process, keeps=nbytes)
        self.ranks[rank] = state
        return state

    def drop(self, rank: int) -> None:
        """Forget ``rank``, which never received anything (it went away while the others joined)."""
        state = self.ranks.pop(rank, None)
        if state is not None:
            state.stop_watching()

    def active(self) -> Iterator[RankState]:
        return (r for r in self.ranks.values() if r.status is RankStatus.ACTIVE)

    def any_active(self) -> bool:
        return any(True for _ in self.active())

    def all_finished(self) -> bool:
        return all(r.finished for r in self.ranks.values())

    def publish(self, index: int, handles: Sequence[Handle], token: Any, *, leased: bool = True) -> tuple[bool, bool]:
        """Queue batch ``index``'s ``handles`` to every active rank, those of the tensors it selected; with
        ``leased`` (the batch has bytes in a buffer) each such rank holds it until it releases it.
        Returns whether any rank was handed some, and whether any holds it now (if not, its token
        is free at once)."""
        handed = False
        holders = 0
        for r in self.active():
            mine = [h for h in handles if h.name in r.names]
            if not mine:
                continue
            r.queue.extend(mine)
            handed = True
            if leased:
                r.outstanding.add(index)
                holders += 1
        if holders:
            self._leases[index] = (holders, token)
        return handed, holders > 0

    def take(self, state: RankState, max_handles: int, max_bytes: int) -> list[Handle]:
        """The next handles for ``state``: whole batches only (the client releases every batch of a
        reply once consumed), about ``max_bytes`` of ring slots per reply, so that a slot goes back
        to the ring as the rank consumes and the rank polls (and shows it is alive) meanwhile.
        Batches no ring waits for (an earlier load's resident copy: their token is ``None``) count
        for :data:`UNLEASED_SHARE` of their bytes: a load served from memory has everything ready
        at once, and each reply is a round trip on the rank's loading thread."""
        handles: list[Handle] = []
        nbytes = 0
        queue = state.queue
        while queue and ((len(handles) < max_handles and nbytes < max_bytes) or queue[0].batch == handles[-1].batch):
            handle = queue.popleft()
            handles.append(handle)
            if handle.batch in state.outstanding:
                state.held.add(handle.batch)
            lease = self._leases.get(handle.batch)
            nbytes += handle.nbytes if lease is None or lease[1] is not None else handle.nbytes // UNLEASED_SHARE
            state.delivered_bytes += handle.nbytes
        state.to_hand_out -= len(handles)
        return handles

    def release(self, state: RankState, batches: Iterable[int]) -> list[Any]:
        """``state`` is done with ``batches`` it was handed (others are not its to release: their
        bytes may not have been read yet); return the tokens nobody holds any more."""
        return self._unlease(state, [index for index in batches if index in state.held])

    def _unlease(self, state: RankState, batches: Iterable[int]) -> list[Any]:
        freed = []
        for index in batches:
            if index not in state.outstanding:
                continue
            state.outstanding.discard(index)
            state.held.discard(index)
            holders, token = self._leases[index]
            if holders > 1:
                self._leases[index] = (holders - 1, token)
            else:
                del self._leases[index]
                if token is not None:
                    freed.append(token)
        return freed

    def leave(self, state: RankState, error: str | None = None) -> list[Any]:
        """The rank is finished, abandons the load, or failed with ``error``: it holds nothing any
        more. A rank that was fenced, or that outlived its session, gives back what it still held."""
        if state.status is not RankStatus.ACTIVE:
            return self._let_go(state)
        complete = not state.to_hand_out and not state.queue
        if error is not None:
            status = RankStatus.FAILED
        else:
            status = RankStatus.DONE if complete else RankStatus.LEFT
        return self._end(state, status, error)

    def reclaim(self, now: float, rank_timeout_s: float) -> list[tuple[RankState, str, list[Any]]]:
        """Reclaim active ranks whose process is gone or that were silent for longer than
        ``rank_timeout_s`` (a rank waiting in a long-poll is not silent), and end the holds of
        ranks no longer active once their process is gone: ``(rank, why, freed tokens)``. A silent
        rank whose process lives is fenced and keeps the batches it was handed (the module docstring)."""
        out = []
        for state in list(self.ranks.values()):
            silent = not state.asking and now - state.last_seen > rank_timeout_s
            gone = state.gone()
            if state.status is not RankStatus.ACTIVE:
                if state.outstanding and (gone or (state.process is None and silent)):
                    held = len(state.outstanding)
                    why = "its process is gone" if gone else f"silent for {now - state.last_seen:.1f} s"
                    out.append((state, f"{why}; the {held} batches it held are free", self._let_go(state)))
                continue
            if gone:
                why, keep = "its process is gone", False
            elif silent:
                why, keep = f"silent for {now - state.last_seen:.1f} s", state.process is not None
            else:
                continue
            freed = self._end(state, RankStatus.RECLAIMED, keep_held=keep)
            if state.outstanding:
                why += f"; fenced, it keeps the {len(state.outstanding)} batches it was handed until it releases them or its process is gone"
            out.append((state, f"{why}; reclaimed", freed))
        return out

    def _end(self, state: RankState, status: RankStatus, error: str | None = None, *, keep_held: bool = False) -> list[Any]:
        """``state`` is no longer active (:meth:`_let_go`)."""
        freed = self._let_go(state, keep_held=keep_held)
        state.queue.clear()
        state.status, state.error = status, error
        return freed

    def _let_go(self, state: RankState, *, keep_held: bool = False) -> list[Any]:
        """End ``state``'s leases: those of batches it was not handed, and those it was handed
        unless ``keep_held`` (it may still be copying their bytes); its process is watched only
        while it holds some. Returns the tokens nobody holds any more."""
        freed = self._unlease(state, [i for i in state.outstanding if not (keep_held and i in state.held)])
        if not state.outstanding:
            state.stop_watching()
        return freed

    def finish(self) -> None:
        """The load is done: a rank still active has been handed and has released everything (it
        had not said leave yet), so it is done; its summary must not say "active" once the session
        has ended."""
        for state in list(self.active()):
            if state.finished:
                self._end(state, RankStatus.DONE)

    def end(self) -> list[Any]:
        """The session ended (done, failed or cancelled): the leases of batches not handed out
        end, and those of ranks whose process is gone; what live ranks were handed stays leased
        until they release it (:attr:`holding`). Returns the tokens nobody holds any more."""
        freed = []
        for state in self.ranks.values():
            freed += self._let_go(state, keep_held=not state.gone())
            state.queue.clear()
        return freed

    @property
    def holding(self) -> bool:
        """Whether some rank still holds a batch leased to it."""
        return bool(self._leases)

    def held_tokens(self) -> list[Any]:
        """The tokens of the batches some rank holds."""
        return [token for _, token in self._leases.values() if token is not None]

    def summary(self) -> dict[int, RankSummary]:
        return {r.rank: r.summary() for r in self.ranks.values()}

    def __repr__(self) -> str:
        counts: dict[str, int] = {}
        for r in self.ranks.values():
            counts[r.status.value] = counts.get(r.status.value, 0) + 1
        return f"RankLedger(ranks={counts}, leased_batches={len(self._leases)})"
