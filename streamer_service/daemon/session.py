"""Load sessions: the ranks of one launch on this node, their union streamed once.

A session is keyed by the client (default: launch id + URI). It waits for all ``world_size`` ranks
to join (who may join: ``roster``), plans the union of their selections, and streams it once through
a reader into a bounded ring of shared-memory segments. Each loaded batch is published to the ranks
that need tensors of it, as handles (``streamer_client._protocol.Handle``: batch, segment, offset,
nbytes, name, dtype, shape and whether the segment is the batch's own); a segment is recycled when
every rank that got handles into it has released them. A slow rank holds segments and so applies
backpressure; nothing is ever fetched twice.

Which rank holds which batch is the rank ledger's (``ledger``); which segment a batch lands in — a
ring slot from the node's pool or a segment kept resident — is the session buffers'
(``session_buffers``); what the loading thread hands the ranks — resident tensors, then the rest
streamed by the pipeline through a reader built by ``reader_factory`` (``readers.choice.reader_for``
the URI; tests pass a fake one and drive a session in-process), each batch published as it lands —
is the feed's (``session_feed``). This module is the state machine that ties them together: the
joins, the loading thread's start and end, and the ranks' requests.

A rank whose process is gone, or that is silent for ``rank_timeout_s``, is reclaimed; the others
finish. A load no rank reads any more stops reading, as does every load when the daemon stops. When
the session ends its segments go back to the pool, but those kept resident (``resident``) and those
a live rank still holds (the ledger's lifetime rule): an ended session answers its holders'
releases and leave until they let go (:attr:`Session.holding`). With a retention budget, the tensors
a previous load left in memory are handed out from there first, and only the rest is streamed, each
batch into a segment of its own that stays for the next load. A session can also serve a single rank
(``only``): one that rejoins a load after dying.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence

from streamer_client._protocol import Handle
from streamer_client.errors import ObjectChangedError, ObjectNotFoundError, SessionError, StreamerError

from ..checkpoint.catalog import TensorInfo
from ..checkpoint.open import Checkpoint
from ..checkpoint.versions import ObjectVersions
from ..load.pipeline import LoadStats
from ..readers.base import ReaderFactory
from ..readers.choice import reader_for
from ..readers.kept import KeptReaders
from ..sizing import PINNING_RANKS
from .ledger import RankLedger, RankState, RankStatus
from .metrics import LoadTimes
from .process import ProcessWatch
from .resident import ResidentStore
from .roster import Roster
from .segment_pool import SegmentPool
from .session_buffers import SegmentSlot, SessionBuffers
from .session_feed import Cancelled, SessionFeed
from .stats import SessionSummary

__all__ = ["Session", "SessionState"]

log = logging.getLogger(__name__)

MAX_HANDLES_PER_REPLY = 8192


class SessionState(enum.Enum):
    JOINING = "joining"
    STREAMING = "streaming"
    DONE = "done"
    FAILED = "failed"


class Session:
    def __init__(
        self,
        key: str,
        checkpoint: Checkpoint,
        world_size: int,
        *,
        slot_size: int,
        pool: SegmentPool,
        in_flight: int | None = None,
        join_timeout_s: float,
        on_end: Callable[[Session], None],
        resident: ResidentStore | None = None,
        rejoin: tuple[str, int] | None = None,
        storage_environment: Mapping[str, str] | None = None,
        versions: ObjectVersions | None = None,
        reader_factory: ReaderFactory | None = None,
        readers: KeptReaders | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.id = uuid.uuid4().hex
        self.key = key
        self.checkpoint = checkpoint
        self.world_size = world_size
        self.state = SessionState.JOINING
        self.error: StreamerError | None = None
        self._ledger = RankLedger()
        self.ranks: dict[int, RankState] = self._ledger.ranks
        self.stats = LoadStats()
        self.times = LoadTimes()  # for the load-duration and first-tensor histograms
        self.rejoin = rejoin  # (group key, rank): a session for one rank coming back to its group's load after dying
        self._slot_size = slot_size
        self._in_flight = in_flight
        only = rejoin[1] if rejoin is not None else None
        self._roster = Roster(key, checkpoint.uri, world_size, only=only, join_timeout_s=join_timeout_s, now=clock())
        self._on_end = on_end
        self._versions = versions  # checks each loaded batch's objects before publishing it
        self._clock = clock
        self._cond = threading.Condition()
        self._buffers = SessionBuffers(pool, slot_size, resident, lock=self._cond, clock=clock)
        self._cancelled = False
        self._feed = SessionFeed(
            key, checkpoint, slot_size=slot_size, buffers=self._buffers, ledger=self._ledger, lock=self._cond,
            cancelled=lambda: self._cancelled, times=self.times, stats=self.stats, versions=versions,
            reader_factory=reader_factory or reader_for(checkpoint.uri), storage_environment=storage_environment,
            in_flight=in_flight, readers=readers if readers is not None else KeptReaders(0),
        )  # fmt: skip
        self._told: set[int] = set()  # ranks that were answered the error of a cancelled load
        self._from_memory: set[int] = set()  # ranks whose every byte was resident when the load started
        self._pinning: set[int] = set()  # ranks that may page-lock the segments they copy from
        self._tell_until = 0.0  # a cancelled load keeps its segments until then for ranks not told yet
        self.load_complete = False  # every batch was loaded and published
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ joining

    def join(
        self,
        rank: int,
        world_size: int,
        chosen: Sequence[TensorInfo],
        priority: Sequence[str] | None,
        process: ProcessWatch | None = None,
        *,
        pins: bool = False,
    ) -> RankState:
        """:meth:`add` ``rank``, then block until every rank has joined (or the join timeout passes)."""
        self.add(rank, world_size, chosen, priority, process, pins=pins)
        with self._cond:
            while self.state is SessionState.JOINING:
                self._expire_join(self._clock())
                self._cond.wait(max(min(self._roster.deadline - self._clock(), 1.0), 0.01))
        return self.joined(rank)

    def add(
        self,
        rank: int,
        world_size: int,
        chosen: Sequence[TensorInfo],
        priority: Sequence[str] | None,
        process: ProcessWatch | None = None,
        *,
        pins: bool = False,
    ) -> RankState:
        """Add ``rank`` with its selected tensors (``plan.select``) and start the load once every
        rank is in; never waits. ``process`` watches the rank's process, so that a rank whose
        process is gone is reclaimed at once; ``pins``: the rank may page-lock the segments it
        copies from (:meth:`ring_slots`). Wait for the others with :meth:`on_joined` (the
        daemon's API, without a thread) or :meth:`join`, then :meth:`joined`."""
        with self._cond:
            self._roster.check(rank, world_size, joined=self.ranks, started=self.state is not SessionState.JOINING)
            names = frozenset(t.name for t in chosen)
            state = self._ledger.add(rank, names, sum(t.nbytes for t in chosen), len(chosen), process, self._clock())
            self._roster.choose(rank, chosen, priority)
            if pins:
                self._pinning.add(rank)
            if len(self.ranks) == self._roster.expected:
                self._start()
                self._cond.notify_all()
            return state

    def from_memory(self, rank: int) -> bool:
        """Whether every byte ``rank`` selected was in the daemon's resident copy of this checkpoint
        when the load started (a hint for how the rank copies them: its join reply says it). Set
        once, as the load starts and before any rank hears that it joined: read without the lock,
        from the daemon's event loop."""
        return rank in self._from_memory

    def ring_slots(self, rank: int) -> int:
        """The slots of the ring ``rank``'s streamed batches come through, each reused batch after
        batch, where the ring is kept to them because :data:`PINNING_RANKS` or more of the ranks
        streamed to may page-lock (its join reply says it; 0: not bounded). Set with
        :meth:`from_memory`'s hint, and read the same way."""
        return self._buffers.ring_bound if rank in self._pinning and rank not in self._from_memory else 0

    def on_joined(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (from any thread, so it must not block) once the session no longer
        waits for ranks: every rank joined, or it failed. At once if that is so already."""
        with self._cond:
            if self.state is SessionState.JOINING:
                self._roster.on_joined(callback)
                return
        callback()

    def joined(self, rank: int) -> RankState:
        """``rank``'s state once the session no longer waits for ranks; its error if it failed."""
        with self._cond:
            if self.state is SessionState.FAILED and self.error is not None:
                raise self.error
            return self.ranks[rank]

    def withdraw(self, rank: int) -> None:
        """``rank`` went away while the session waited for the others (its connection closed): it
        is no longer part of the session, which ends once no rank waits in it."""
        with self._cond:
            if self.state is not SessionState.JOINING or rank not in self.ranks:
                return
            self._ledger.drop(rank)
            self._roster.drop(rank)
            self._pinning.discard(rank)
            log.info("session %s: rank %d went away before every rank joined", self.key, rank)
            if not self.ranks:
                self._fail(self._roster.error("every rank that joined went away"))

    def _expire_join(self, now: float) -> None:
        """Fail a session still waiting for ranks past the join timeout (under the lock)."""
        error = self._roster.expired(now, self.ranks) if self.state is SessionState.JOINING else None
        if error is not None:
            self._fail(error)

    def refuse(self, error: SessionError) -> None:
        """A rank of this group was refused: the ranks waiting for it fail now, not at the join timeout."""
        with self._cond:
            if self.state is SessionState.JOINING:
                self._fail(error)

    def _start(self) -> None:
        wanted = self._roster.union(self.checkpoint.catalog.tensors)
        catalog, uri, generation = self.checkpoint.catalog, self.checkpoint.uri.normalized, self.checkpoint.generation
        self._from_memory = {
            r.rank for r in self.ranks.values() if self._buffers.in_memory(uri, generation, (catalog[n] for n in r.names))
        }
        if len(self._pinning - self._from_memory) >= PINNING_RANKS:
            self._buffers.bound_ring(self._in_flight)
        self.state = SessionState.STREAMING
        self.times.mark("started")
        now = self._clock()
        for r in self.ranks.values():
            r.last_seen = now
        self._thread = threading.Thread(target=self._run, args=(wanted,), name=f"session-{self.id[:8]}", daemon=True)
        self._thread.start()
        self._no_longer_joining()

    def _no_longer_joining(self) -> None:
        for callback in self._roster.joined_callbacks():
            callback()

    # ------------------------------------------------------------------ streaming thread

    def _run(self, wanted: list[TensorInfo]) -> None:
        started, began = self._clock(), time.monotonic()
        try:
            if self._versions is not None:
                self._versions.open_soon()  # the first batch's check then finds the client made
            self._feed.run(wanted)
            with self._cond:
                self.load_complete = True
                while not self._ledger.all_finished():
                    if self._cancelled:
                        raise Cancelled
                    self._cond.wait(0.5)
                failed = [r for r in self.ranks.values() if r.status is RankStatus.FAILED]
                if failed:  # a rank that could not use what it was handed did not receive it
                    self._fail(self._roster.error(f"rank {failed[0].rank} failed: {failed[0].error}"))
                else:
                    self._ledger.finish()
                    self._end(SessionState.DONE)
            log.info(
                "session %s (%s, %d ranks): %d bytes read from storage, %d served from memory, in %.2f s; %s; %d version checks; a ring of %d slots%s%s",
                self.key, self.checkpoint.uri, len(self.ranks), self.stats.bytes_read, self.resident_bytes,
                self._clock() - started, self.stats.describe(began), self._versions.checks if self._versions else 0, self._buffers.ring_slots,
                f" (at most {self._buffers.ring_bound}: its ranks page-lock)" if self._buffers.ring_bound else "",
                "; read through a reader kept from an earlier load" if self._feed.reader_kept else "",
            )  # fmt: skip
        except Cancelled:
            with self._cond:
                # Ranks still reading are answered the error before the segments they were handed go.
                while any(r.rank not in self._told for r in self._ledger.active()) and self._clock() < self._tell_until:
                    self._cond.wait(min(self._tell_until - self._clock(), 0.5))
                self._end(SessionState.FAILED)
            log.warning(
                "session %s (%s): %s; stopped after %d bytes read",
                self.key, self.checkpoint.uri, self.error or "no rank is left to read it", self.stats.bytes_read,
            )  # fmt: skip
        except StreamerError as exc:
            if isinstance(exc, (ObjectChangedError, ObjectNotFoundError)):
                self._buffers.drop_resident(str(exc))
            with self._cond:
                self._fail(exc)
            log.error("session %s (%s) failed: %s", self.key, self.checkpoint.uri, exc)
        except Exception as exc:  # noqa: BLE001 - a bug must fail the session, not hang its ranks
            log.exception("session %s (%s) crashed", self.key, self.checkpoint.uri)
            with self._cond:
                self._fail(StreamerError(f"daemon error while streaming {self.checkpoint.uri}: {exc!r}"))
        finally:
            if self._versions is not None:
                self._versions.close()
            with self._cond:
                self._recycle_all(self._ledger.end())
            self._buffers.release(held=self._ledger.held_tokens, holding=lambda: self._ledger.holding)
            if self.holding:
                holders = sorted(r.rank for r in self.ranks.values() if r.outstanding)
                log.warning("session %s ended while ranks %s hold batches: kept until they let go", self.key, holders)
            self._on_end(self)

    # ------------------------------------------------------------------ rank requests

    def next(
        self, rank: int, release: Sequence[int], wait_s: float, gone: threading.Event | None = None, peer_pid: int | None = None
    ) -> tuple[list[Handle], bool]:
        """Release ``release``; return ready handles (waiting up to ``wait_s``) and whether this rank is done.
        A newer request of the rank answers in place of one still waiting (its client gave up on
        it), which returns none; so does one whose connection closed (``gone``). ``peer_pid``: the
        requesting process, refused unless it is the rank's (``Roster.member``)."""
        with self._cond:
            state = self._rank(rank, peer_pid)
            self._recycle_all(self._ledger.release(state, release))  # (which wakes every waiter)
            if state.status is RankStatus.RECLAIMED:  # fenced: what it released is taken, nothing more is given
                raise self._roster.reclaimed(rank)
            poll = state.polls = state.polls + 1  # an earlier request still waiting gives way when woken
            state.last_seen = self._clock()
            deadline = self._clock() + wait_s
            state.asking += 1
            try:
                while (
                    not state.queue and self.state is SessionState.STREAMING and state.to_hand_out and not self._cancelled
                    and poll == state.polls
                ):  # fmt: skip
                    remaining = deadline - self._clock()
                    if remaining <= 0:
                        break
                    self._cond.wait(remaining)
            finally:
                state.asking -= 1
            if self.error is not None and (self._cancelled or self.state is SessionState.FAILED):
                self._told.add(rank)
                self._cond.notify_all()
                raise self.error
            if state.status is RankStatus.RECLAIMED:
                raise self._roster.reclaimed(rank)
            if poll != state.polls or (gone is not None and gone.is_set()):
                return [], False
            # About a slot's worth per reply: a load served from memory has everything ready at once.
            handles = self._ledger.take(state, MAX_HANDLES_PER_REPLY, self._slot_size)
            state.last_seen = self._clock()
            return handles, state.to_hand_out == 0

    def leave(self, rank: int, error: str | None = None, peer_pid: int | None = None) -> None:
        """The rank is finished, abandons the load, or failed with ``error``: release everything it
        holds. Before every rank joined, the group cannot form: its session fails, nothing is read."""
        with self._cond:
            state = self._rank(rank, peer_pid)
            if self.state is SessionState.JOINING:
                return self._fail(self._roster.left_early(rank, error))
            self._recycle_all(self._ledger.leave(state, error))
            self._stop_if_abandoned()

    def cancel(self, reason: str, tell_s: float = 0.0) -> None:
        """Stop this session (the daemon stops): reads in flight drain, nothing new is submitted,
        its segments go back; waiting ranks get ``reason``, and every rank's next request does.
        Its segments stay for up to ``tell_s`` until each rank still reading has been told."""
        with self._cond:
            error = self._roster.error(reason)
            if self.state is SessionState.JOINING:
                self._fail(error)
            elif self.state is SessionState.STREAMING:
                self.error = error
                self._cancelled = True
                self._tell_until = self._clock() + tell_s
            self._cond.notify_all()

    def wait_ended(self, timeout_s: float) -> bool:
        """Wait for the streaming thread to have given everything back."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout_s)
        return thread is None or not thread.is_alive()

    def _stop_if_abandoned(self) -> None:
        """A load no rank reads any more (its ranks left or were reclaimed) stops: no storage read for nobody."""
        if self.state is SessionState.STREAMING and not self._ledger.any_active():
            self._cancelled = True
        self._cond.notify_all()

    def reap(self, now: float, rank_timeout_s: float) -> None:
        """Reclaim ranks whose process is gone or that were silent for longer than ``rank_timeout_s``;
        fail a session still waiting for ranks after the join timeout."""
        with self._cond:
            self._expire_join(now)
            if self.state is SessionState.JOINING or not (self.state is SessionState.STREAMING or self.holding):
                return
            for state, why, freed in self._ledger.reclaim(now, rank_timeout_s):
                log.warning("session %s: rank %d %s", self.key, state.rank, why)
                self._recycle_all(freed)
            self._stop_if_abandoned()

    def _rank(self, rank: int, peer_pid: int | None = None) -> RankState:
        return self._roster.member(rank, self.ranks.get(rank), peer_pid)

    def _recycle_all(self, slots: Sequence[SegmentSlot]) -> None:
        for slot in slots:
            self._buffers.recycle(slot)
        if not self._ledger.holding:
            self._buffers.unheld()
        self._cond.notify_all()

    def let_go(self) -> None:
        """The daemon stops: what ranks still hold goes back (unlinked: a rank mapping it keeps its pages)."""
        with self._cond:
            for state in self.ranks.values():
                self._recycle_all(self._ledger.leave(state, "the daemon stopped"))

    @property
    def holding(self) -> bool:  # a rank still holds a batch of this session (after its end: until it lets go)
        with self._cond:
            return self._ledger.holding

    # ------------------------------------------------------------------ ending

    def _fail(self, error: StreamerError) -> None:
        self.error = error
        self._end(SessionState.FAILED)

    def _end(self, state: SessionState) -> None:
        if self.state in (SessionState.DONE, SessionState.FAILED):
            return
        self.state = state
        self.times.mark("ended")
        self._cond.notify_all()
        if self._thread is None:  # never started streaming: nothing else will call on_end
            self._ledger.end()  # the joined ranks' process watches
            self._no_longer_joining()
            self._on_end(self)

    @property
    def resident_bytes(self) -> int:
        """Bytes handed out from memory kept by earlier loads."""
        return self._feed.resident_bytes

    def summary(self) -> SessionSummary:
        with self._cond:
            return SessionSummary(
                id=self.id, key=self.key, uri=self.checkpoint.uri.normalized, state=self.state.value,
                world_size=self.world_size, bytes_read=self.stats.bytes_read, bytes_from_memory=self.resident_bytes,
                rejoin_of=self.rejoin[0] if self.rejoin else None, ranks=self._ledger.summary(),
                error=str(self.error) if self.error else None,
            )  # fmt: skip
