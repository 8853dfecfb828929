"""Daemon mode: join the node daemon's load session, map its segments, yield tensors.

The protocol is ``streamer_client.protocol`` (both sides import it; routes in
``streamer_service/daemon/api.py``). Segments are files in the daemon's shm dir (its join reply says
where; ``STREAMER_SHM_DIR`` overrides that where the rank mounts the same dir elsewhere), mapped
once per process and reused as the daemon recycles them (``segments``).

How a batch's bytes become tensors (``delivery``, shared with the embedded engine):

- CPU, owned: the native copier's threads copy the whole batch into new tensors; the batch is
  released to the daemon before its tensors are yielded;
- CPU, ``borrowed=True``: views of a private mapping, released when the next batch is asked for;
- CUDA, staged (``STREAMER_PIN_SEGMENTS=never``, and with ``auto`` a load the daemon serves whole
  from memory, or a process's first load of small-page segments that do not recycle): the
  copier's threads copy the segment, a window at a time, into the process's small page-locked
  staging ring, each window's host-to-device copy overlapping the next window; the batch is
  released as soon as its bytes are staged. The windows of successive replies form one stream: the
  last window of a reply is still being filled while the next reply is asked for. Nothing the
  size of the checkpoint is page-locked;
- CUDA, pinned (``always``, and with ``auto`` segments the daemon streams to a reloading process,
  huge-page ones, or a ring the daemon keeps to the slots it recycles, ``JoinReply.ring_slots``):
  each segment is page-locked once per process (on a worker thread, ahead of its copies) and
  copied from directly; the batch is released once its copies completed.

Every path checks the generation of each segment it read (``fence``) after its bytes are copied
and before its tensors are yielded: a segment the daemon gave new bytes while this rank held it
raises ``SessionError`` naming the tensor (a borrowed view: ``BorrowedTensorError``, checked before
it is lent and when its batch is finished). Page-locked copies are yielded before they land, so
their check runs once they completed: at the latest before the iterator ends and before ``leave``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import mmap
import weakref
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import torch

from . import copier, delivery, errors, protocol
from .connection import POLL_WAIT_S, DaemonClient
from .devices import resolve_device
from .errors import BorrowedTensorError, ConfigError, DaemonError, StreamerError
from .fence import Fence
from .leases import Leases
from .progress import track
from .protocol import Handle, JoinReply, NextReply
from .request import StreamRequest
from .segments import map_segment, segment_maps
from .settings import Settings

__all__ = ["DaemonClient", "daemon_stream"]  # DaemonClient: re-exported from .connection

log = logging.getLogger(__name__)


class _PrivateSegments:
    """Borrowed views: each segment mapped copy-on-write for this load only (see map_segment)."""

    def __init__(self, shm_dir: Path) -> None:
        self.shm_dir = shm_dir
        self._maps: dict[str, tuple[mmap.mmap, np.ndarray]] = {}

    def view(self, name: str, offset: int, nbytes: int) -> np.ndarray:
        if name not in self._maps:
            mapping, _ = map_segment(self.shm_dir / name, private=True)
            self._maps[name] = (mapping, np.frombuffer(mapping, dtype=np.uint8))
        return self._maps[name][1][offset : offset + nbytes]

    def drop(self, name: str) -> None:
        entry = self._maps.pop(name, None)
        if entry is not None:
            with contextlib.suppress(BufferError):  # a borrowed view still holds it: it goes with the view
                entry[0].close()

    def close(self) -> None:
        for name in list(self._maps):
            self.drop(name)


def _empty(h: Handle, device: torch.device) -> torch.Tensor:
    return delivery.empty(h.dtype, h.shape, device)


def _staged(
    pin_segments: str, reloading: bool, huge_pages: bool = False, from_memory: bool = False, recycled: bool = False
) -> bool:
    """Whether a CUDA load copies through the staging ring instead of page-locking segments
    (``STREAMER_PIN_SEGMENTS``; ``auto``: where the copier is built, a load of segments the daemon
    serves whole from memory, and a process's first load of small-page segments that are not a
    ring's recycled slots). Page-locking costs per page, and pays only where something hides it or
    many batches share it: while the daemon streams a load, registering huge-page segments passes
    beside its reads, so a first load pins them; a ring of recycled slots (``recycled``) is
    registered once for all the batches that pass through it; a process that reloads has its
    segments registered already; segments already whole in memory are staged faster than they are
    registered, and staged about as fast as page-locked ones are copied (docs/benchmarks.md)."""
    if pin_segments == "auto":
        return copier.available() and (from_memory or (not reloading and not huge_pages and not recycled))
    return pin_segments == "never"


def daemon_stream(client: DaemonClient, request: StreamRequest) -> Iterator[tuple[str, torch.Tensor]]:
    """Join (eagerly: selection errors raise here) and return the iterator over the tensors.
    ``request.launch_id`` is resolved already. The load owns ``client``: closed when the iterator
    ends (or when the join fails)."""
    try:
        return _joined(client, request)
    except BaseException:
        client.close()
        raise


def _joined(client: DaemonClient, request: StreamRequest) -> Iterator[tuple[str, torch.Tensor]]:
    device = resolve_device(request.device)
    cfg = Settings()
    body = protocol.JoinRequest(
        uri=request.uri, session=request.session_key, rank=request.rank, world_size=request.world_size,
        select=list(request.select) if request.select is not None else None,
        priority=list(request.priority) if request.priority else None, launch_id=request.launch_id,
        force=cfg.if_given("force_pull"), pins=device.type == "cuda" and not request.borrowed and cfg.pin_segments != "never",
        fence=True,
    )  # fmt: skip
    # Blocks until every rank joined; the daemon enforces the join timeout.
    try:
        reply = client.call(protocol.JOIN_PATH, body.to_wire(), read_timeout=None)
    except ConfigError as exc:
        if "body.fence: Extra inputs" not in exc.message:
            raise
        raise _unfenced(client) from None  # a daemon from before the fence refused the field
    joined = JoinReply.from_wire(reply)
    shm_dir = cfg.if_given("shm_dir") or Path(joined.shm_dir)
    if joined.generations is None:
        with contextlib.suppress(StreamerError):
            client.call(protocol.rank_path(joined.session_id, request.rank, "leave"), protocol.LeaveRequest().to_wire())
        raise _unfenced(client)
    copier.share_host(request.world_size)  # the session's ranks share this node's CPUs
    tensors = _Receiver(
        client,
        shm_dir,
        joined.session_id,
        request.rank,
        device,
        request.borrowed,
        pin_segments=cfg.pin_segments,
        nbytes=joined.bytes,
        huge_pages=joined.shm_page_size > mmap.PAGESIZE,
        from_memory=joined.from_memory,
        recycled=joined.ring_slots > 0,
        fence=Fence(shm_dir / joined.generations, joined.session_id),
    ).run()
    if request.progress == "off":
        return tensors
    return track(tensors, total=joined.bytes, desc=f"rank {request.rank}", mode=request.progress)


class _Receiver:
    def __init__(
        self, client: DaemonClient, shm_dir: Path, session_id: str, rank: int, device: torch.device, borrowed: bool,
        *, pin_segments: str = "always", nbytes: int = 0, huge_pages: bool = False, from_memory: bool = False,
        recycled: bool = False, fence: Fence,
    ) -> None:  # fmt: skip
        self._client = client
        self._fence = fence
        self._torn: StreamerError | None = None  # a page-locked batch's check failed once its copies completed
        self._next = protocol.rank_path(session_id, rank, "next")
        self._leave = protocol.rank_path(session_id, rank, "leave")
        self._device = device
        self._borrowed = borrowed
        self._nbytes = nbytes  # this rank's tensors' bytes, the join's answer (the small ones' too: a little more)
        self._release: list[int] = []
        self._leases = Leases()  # borrowed views of the batch in hand
        self._in_hand: weakref.ref | None = None
        self._copier = None
        self._staging: delivery.Staging | None = None
        staged = False
        if borrowed:
            self._segments = _PrivateSegments(shm_dir)
        else:
            # Owned copies map each segment once per process and keep it across loads (segments.py).
            maps = segment_maps(shm_dir)
            staged = device.type == "cuda" and _staged(pin_segments, maps.loads > 0, huge_pages, from_memory, recycled)
            # Populated for copies by numpy on this thread; the copier's threads fault the pages
            # in themselves, in parallel, and a registration does too (map_segment).
            self._segments = maps.load(populate=device.type != "cuda" and not copier.available())
        if device.type == "cuda":
            from .cuda import PinnedCopier

            self._copier = PinnedCopier(device)
        self._stage = staged  # the staging ring is taken when the load starts (run)

    def run(self) -> Iterator[tuple[str, torch.Tensor]]:
        try:
            if self._copier is not None:
                delivery.reserve(self._device, [self._nbytes])
            if self._stage:
                self._staging = delivery.Staging(self._copier)
            done = False
            while not done:
                # Copies stay in flight across the request: batches whose copies completed are
                # released with it; with copies pending the request does not long-poll, so a
                # batch waiting only for its copies is released as soon as they land. Staged, the
                # window still being filled holds its batch the same way: an empty reply finishes
                # it, and its release goes with the next request.
                pending = False
                if self._copier is not None:
                    self._copier.poll()
                    self._raise_if_torn()
                    # Staged batches are released once staged: pending copies hold no batch.
                    pending = self._staging is None and self._copier.pending > 0
                holding = self._staging is not None and self._staging.holding
                release, self._release[:] = list(self._release), []  # one list: callbacks append to it
                wait_s = 0.0 if pending or holding else POLL_WAIT_S
                reply = NextReply.from_wire(
                    self._client.call(self._next, protocol.NextRequest(release, wait_s, fence=True).to_wire())
                )
                done = reply.done
                # A reply holds whole batches, in order.
                batches = list(_by_batch(reply.handles))
                if not batches and holding:
                    yield from self._finish_held()
                    continue
                if not batches and pending:
                    self._copier.wait_one()
                    self._raise_if_torn()
                    continue
                if self._copier is not None and self._staging is None:
                    # Page-lock this reply's segments on the worker thread, in copy order: the next
                    # one is registered while the current one's copies run.
                    self._segments.prepare([b[0].segment for b in batches if b[0].segment is not None], self._device)
                if self._staging is not None:
                    yield from self._staged(batches, last=done)
                else:
                    for batch in batches:
                        yield from self._delivered(batch)
            if self._copier is not None:
                self._copier.drain()  # every page-locked batch checked before the iterator ends
                self._raise_if_torn()
            self._client.call(self._leave, protocol.LeaveRequest().to_wire())
        except (GeneratorExit, errors.BorrowedTensorError):
            # Abandoned (the caller closed the iterator, or kept a borrowed view against its
            # lifetime): hand everything back now rather than holding segments until the daemon
            # reclaims this rank as silent.
            self._stop_staging()
            with contextlib.suppress(StreamerError):
                self._client.call(self._leave, protocol.LeaveRequest().to_wire())
            raise
        except BaseException as exc:
            # Failed here (a segment it could not map, a copy that failed): the daemon counts this
            # rank as failed, not as delivered.
            self._stop_staging()
            with contextlib.suppress(StreamerError):
                self._client.call(self._leave, protocol.LeaveRequest(protocol.clipped(f"{type(exc).__name__}: {exc}")).to_wire())
            raise
        finally:
            try:
                if self._staging is not None:
                    self._staging.close()  # waits for the copies out of the ring, gives it back
            finally:
                if self._copier is not None:
                    self._copier.close()  # waits for copies in flight, unpins the segments
                self._segments.close()
                self._fence.close()
                self._client.close()

    def _stop_staging(self) -> None:
        """A load that ends early: a window still being filled reads this rank's segments, so it is
        waited for before the daemon hears that the rank left."""
        if self._staging is not None:
            self._staging.abandon()  # the held batch's tensors were never handed out

    def _delivered(self, batch: list[Handle]) -> Iterator[tuple[str, torch.Tensor]]:
        if self._copier is not None:
            return self._to_device(batch)
        if self._borrowed:
            return self._lent(batch)
        return self._copied(batch)

    def _lent(self, batch: list[Handle]) -> Iterator[tuple[str, torch.Tensor]]:
        self._fence.check(batch, BorrowedTensorError)
        for h in batch:
            if h.segment is None:
                tensor = _empty(h, self._device)
            else:
                view = self._segments.view(h.segment, h.offset, h.nbytes)
                tensor, self._in_hand = delivery.lend(self._leases, h.name, view, h.dtype, h.shape)
            yield h.name, tensor
            del tensor
        self._finish(batch[-1])

    def _copied(self, batch: list[Handle]) -> Iterator[tuple[str, torch.Tensor]]:
        """The whole batch copied at once on the copier's threads, released, then yielded."""
        items = [
            (self._segments.view(h.segment, h.offset, h.nbytes) if h.segment is not None else _NO_BYTES, h.dtype, h.shape)
            for h in batch
        ]
        tensors = delivery.copy_to_cpu(items, functools.partial(_cut_short, batch))
        items.clear()
        self._fence.check(batch)
        yield from self._hand_out(batch, tensors)

    def _staged(self, batches: list[list[Handle]], *, last: bool) -> Iterator[tuple[str, torch.Tensor]]:
        """A reply's batches staged to the device, in the stream of windows of every reply: a
        batch's tensors are yielded, and the batch released, once the next batch's first window
        is being filled, which for a reply's last batch is in the next reply (``last``: there is
        none; once its bytes are copied out). Releases go with the next request anyway."""
        for k, batch in enumerate(batches):
            with_bytes = [h for h in batch if h.segment is not None]
            items = [(self._segments.segment(h.segment).address + h.offset, h.dtype, h.shape) for h in with_bytes]
            hold = k + 1 < len(batches) or not last
            for done, outs in self._staging.copy_batch(batch, items, functools.partial(_cut_short, with_bytes), hold=hold):
                self._fence.check(done)  # its bytes are out of the segment
                yield from self._hand_out(done, self._with_empties(done, outs))

    def _finish_held(self) -> Iterator[tuple[str, torch.Tensor]]:
        """No batch came to follow the held one: finish its window, hand it out."""
        for done, outs in self._staging.flush_batch():
            self._fence.check(done)
            yield from self._hand_out(done, self._with_empties(done, outs))

    def _with_empties(self, batch: list[Handle], staged: list[torch.Tensor]) -> list[torch.Tensor]:
        """The batch's tensors in its order: the staged ones, and new empty ones for handles of no bytes."""
        staged.reverse()
        return [staged.pop() if h.segment is not None else _empty(h, self._device) for h in batch]

    def _hand_out(self, batch: list[Handle], tensors: list[torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        """A batch whose bytes are all copied out: released, then its tensors yielded."""
        self._finish(batch[-1])
        yield from _handed(batch, tensors)

    def _to_device(self, batch: list[Handle]) -> Iterator[tuple[str, torch.Tensor]]:
        """Queue the batch's copies from pinned shared memory, fence them, release after they land."""
        copier = self._copier
        head = batch[0]
        if head.segment is not None:
            # Registered once per process (dedicated ones too: registering and a pinned copy take
            # 0.07 s/GB on 4 KiB pages, a pageable copy 0.13 s/GB). Waits only for this segment.
            self._segments.pinned(head.segment, self._device)
        tensors = []
        for h in batch:
            if h.segment is None:
                tensors.append(_empty(h, self._device))
                continue
            view = self._segments.view(h.segment, h.offset, h.nbytes)
            tensors.append(delivery.to_device(copier, view, h.dtype, h.shape))
        fence = copier.fence()
        if head.segment is not None:
            # A dedicated segment stays mapped and pinned too: the daemon keeps it idle for a reload
            # of the same checkpoint, and the segment cache unmaps it once the daemon unlinks it.
            # Bound to the method, not to a list: this runs after later requests were sent.
            copier.release_after(functools.partial(self._released, batch), fence)
        for h, tensor in zip(batch, tensors):
            yield h.name, tensor
        tensors.clear()

    def _released(self, batch: list[Handle]) -> None:
        """A page-locked batch's copies completed: checked, and released with the next request."""
        self._torn = self._torn or self._fence.torn(batch)
        self._release.append(batch[0].batch)

    def _raise_if_torn(self) -> None:
        if self._torn is not None:
            raise self._torn

    def _finish(self, h: Handle) -> None:
        """Every tensor of ``h.batch`` for this rank was handed out: release it (borrowed: check views)."""
        if h.segment is None:
            return
        if self._borrowed:
            self._leases.end(self._in_hand)
            self._fence.check([h], BorrowedTensorError)  # the views lent were valid to the end
        self._release.append(h.batch)
        if h.dedicated:
            self._segments.drop(h.segment)


_NO_BYTES = np.empty(0, dtype=np.uint8)


def _handed(batch: list[Handle], tensors: list[torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the batch's tensors, holding none of them here once it is yielded."""
    tensors.reverse()
    for h in batch:
        tensor = tensors.pop()
        yield h.name, tensor
        del tensor


def _cut_short(batch: list[Handle], i: int) -> DaemonError:
    h = batch[i]
    return DaemonError(
        f"shared-memory segment {h.segment}: tensor {h.name!r} (bytes {h.offset}-{h.offset + h.nbytes}) was cut short "
        "while this rank read it: the segment file was truncated or replaced",
        key=h.name,
    )


def _unfenced(client: DaemonClient) -> DaemonError:
    return DaemonError(
        f"streamer daemon at {client.socket} does not fence its segments (no segment generations): it is "
        'older than this client; upgrade the daemon before the clients (docs/client.md, "Upgrades")'
    )


def _by_batch(handles: Iterable[Handle]) -> Iterator[list[Handle]]:
    group: list[Handle] = []
    for h in handles:
        if group and h.batch != group[-1].batch:
            yield group
            group = []
        group.append(h)
    if group:
        yield group
