"""A daemon-mode rank's receiving side: its batches' handles become tensors (see
:mod:`streamer_client._daemon` for the ways a batch's bytes are copied and the order a load ends in).

:class:`Receiver` asks for handles, maps and checks their segments, copies (or lends) the bytes
with :mod:`streamer_client._delivery`, checks each batch's generations (``fence``) and releases
the batch; a rank's slices (:mod:`streamer_client._slicing`) are cut here, from the segment: a
slice of one run is a view of just that run, a slice of several runs is gathered by the copier's
threads.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from . import _delivery as delivery
from . import _handles as handles
from . import _native_copier as copier
from . import _protocol as protocol
from . import _slicing as slicing
from . import errors
from ._connection import POLL_WAIT_S, DaemonClient
from ._fence import Fence
from ._leases import Leases
from ._protocol import Handle, NextReply
from ._segments import PrivateSegments, segment_maps
from .errors import BorrowedTensorError, StreamerError

__all__ = ["Receiver", "leave", "staged"]

log = logging.getLogger(__name__)


def _empty(h: Handle, device: torch.device, shape: tuple[int, ...]) -> torch.Tensor:
    """The tensor of a handle of no segment (checked: it has no bytes), of ``shape`` (its slice's)."""
    handles.check(h, 0)
    return delivery.empty(h.dtype, shape, device)


def staged(
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
    registered, and staged about as fast as page-locked ones are copied."""
    if pin_segments == "auto":
        return copier.available() and (from_memory or (not reloading and not huge_pages and not recycled))
    return pin_segments == "never"


def leave(client: DaemonClient, path: str, error: BaseException | None) -> None:
    """Tell the daemon this rank is done with its session: finished (``error`` None; a failure
    to say so raises), abandoned (``GeneratorExit``: closed, dropped; ``BorrowedTensorError``: a
    view kept against its lifetime) or failed with ``error``, which the daemon records (the rank
    counts as failed, not delivered). Then, ``error`` is what the caller raises: the leave's own
    failure is not."""
    if error is None:
        client.call(path, protocol.LeaveRequest().to_wire())
        return
    abandoned = isinstance(error, (GeneratorExit, errors.BorrowedTensorError))
    body = protocol.LeaveRequest(None if abandoned else protocol.clipped(f"{type(error).__name__}: {error}"))
    with contextlib.suppress(StreamerError):
        client.call(path, body.to_wire())


class Receiver:
    def __init__(
        self, client: DaemonClient, shm_dir: Path, session_id: str, rank: int, device: torch.device, borrowed: bool,
        *, pin_segments: str = "always", nbytes: int = 0, huge_pages: bool = False, from_memory: bool = False,
        recycled: bool = False, fence: Fence, slices: slicing.Slices | None = None,
    ) -> None:  # fmt: skip
        self._client = client
        self._fence = fence
        self._torn: StreamerError | None = None  # a page-locked batch's check failed once its copies completed
        self._next = protocol.rank_path(session_id, rank, "next")
        self._leave = protocol.rank_path(session_id, rank, "leave")
        self._device = device
        self._borrowed = borrowed
        self._nbytes = nbytes  # this rank's tensors' bytes, the join's answer (the small ones' too: a little more)
        self._slices = slices or {}
        self._cuts: dict[str, slicing.Cut | None] = {}  # by name, made from the first handle of it
        self._gathered: dict[int, list[torch.Tensor]] = {}  # by batch: sliced bytes gathered for a device copy
        self._release: list[int] = []
        self._leases = Leases()  # borrowed views of the batch in hand
        self._in_hand: weakref.ref | None = None
        self._copier = None
        self._staging: delivery.Staging | None = None
        self._started = False  # run() began: its own finally ends the load
        self._ended = False
        staged = False
        if borrowed:
            self._segments = PrivateSegments(shm_dir)
        else:
            # Owned copies map each segment once per process and keep it across loads (_segments.py).
            maps = segment_maps(shm_dir)
            staged = device.type == "cuda" and staged(pin_segments, maps.loads > 0, huge_pages, from_memory, recycled)
            # Populated for copies by numpy on this thread; the copier's threads fault the pages
            # in themselves, in parallel, and a registration does too (map_segment).
            self._segments = maps.load(populate=device.type != "cuda" and not copier.available())
        try:
            if device.type == "cuda":
                from ._cuda import PinnedCopier

                self._copier = PinnedCopier(device)
        except BaseException:
            self._segments.close()
            raise
        self._stage = staged  # the staging ring is taken when the load starts (run)

    def run(self) -> Iterator[tuple[str, torch.Tensor]]:
        self._started = True
        error: BaseException | None = None
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
                batches = list(handles.by_batch(reply.handles))
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
        except BaseException as exc:
            # Closed (GeneratorExit), a borrowed view kept against its lifetime, or failed here (a
            # segment it could not map, a handle outside its segment, a copy that failed).
            error = exc
            raise
        finally:
            self._end(error)

    def abandon_unstarted(self) -> None:
        """The load's iterator was closed, dropped or collected before its first item: end the
        load now, as abandoned (nothing was copied)."""
        if not self._started:
            self._started = True  # run() never starts after this
            self._end(GeneratorExit())

    def _end(self, error: BaseException | None) -> None:
        """End the load (``error``: why, where it did not finish; see :func:`_leave`): everything
        given back in the order it was taken, each once the work that uses it is done. First the
        copies out of this rank's segments: a window of the staging ring still being filled (its
        tensors were never handed out) and every device copy, which reads a page-locked segment
        until it completes; then ``leave``, which hands this rank's batches back to the daemon, and
        the daemon may write another load's bytes into them at once (the segment idled last is
        the first one taken); then the segments unmapped (and unpinned), then the connection
        closed."""
        if self._ended:
            return
        self._ended = True
        try:
            try:
                self._drain()
                if error is None:
                    self._raise_if_torn()  # every page-locked batch checked before the iterator ends
            except BaseException as exc:
                error = error if error is not None else exc
                raise
            finally:
                leave(self._client, self._leave, error)
        finally:
            try:
                if self._copier is not None:
                    self._copier.close()  # drained already; unpins what it pinned
            finally:
                self._segments.close()
                self._fence.close()
                self._client.close()

    def _drain(self) -> None:
        """Wait for every copy out of this rank's segments, and give the staging ring back."""
        if self._staging is not None:
            self._staging.close()  # the window being filled, then every copy out of the ring
        if self._copier is not None:
            self._copier.drain()

    def _delivered(self, batch: list[Handle]) -> Iterator[tuple[str, torch.Tensor]]:
        if self._copier is not None:
            return self._to_device(batch)
        if self._borrowed:
            return self._lent(batch)
        return self._copied(batch)

    def _lent(self, batch: list[Handle]) -> Iterator[tuple[str, torch.Tensor]]:
        self._fence.check(batch, BorrowedTensorError)
        for h in batch:
            view, dtype, shape, runs = self._item(h)
            if h.segment is None:
                tensor = _empty(h, self._device, shape)
            elif runs is None:
                tensor, self._in_hand = delivery.lend(self._leases, h.name, view, dtype, shape)
            else:  # a view strided along a later dimension; a fused slice's pieces concatenated (a copy)
                whole, self._in_hand = delivery.lend(self._leases, h.name, view, h.dtype, h.shape)
                tensor = slicing.take(whole, self._cut(h), view=True)
                del whole
            yield h.name, tensor
            del tensor
        self._finish(batch[-1])

    def _copied(self, batch: list[Handle]) -> Iterator[tuple[str, torch.Tensor]]:
        """The whole batch copied at once on the copier's threads, released, then yielded."""
        items = [self._item(h) for h in batch]
        tensors = delivery.copy_to_cpu(items, functools.partial(handles.cut_short, batch))
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
            items = [self._contiguous(h) for h in with_bytes]
            hold = k + 1 < len(batches) or not last
            for done, outs in self._staging.copy_batch(batch, items, functools.partial(handles.cut_short, with_bytes), hold=hold):
                self._fence.check(done)  # its bytes are out of the segment
                self._gathered.pop(done[0].batch, None)
                yield from self._hand_out(done, self._with_empties(done, outs))

    def _finish_held(self) -> Iterator[tuple[str, torch.Tensor]]:
        """No batch came to follow the held one: finish its window, hand it out."""
        for done, outs in self._staging.flush_batch():
            self._fence.check(done)
            self._gathered.pop(done[0].batch, None)
            yield from self._hand_out(done, self._with_empties(done, outs))

    def _with_empties(self, batch: list[Handle], staged: list[torch.Tensor]) -> list[torch.Tensor]:
        """The batch's tensors in its order: the staged ones, and new empty ones for handles of no bytes."""
        staged.reverse()
        return [staged.pop() if h.segment is not None else _empty(h, self._device, self._item(h)[2]) for h in batch]

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
            view, dtype, shape, runs = self._item(h)
            if h.segment is None:
                tensors.append(_empty(h, self._device, shape))
            elif runs is None:
                tensors.append(delivery.to_device(copier, view, dtype, shape))
            else:  # a slice of several runs: gathered on the copier's threads, then copied from there
                tensors.append(self._gather(h, view, shape, runs).to(self._device))
        fence = copier.fence()
        if head.segment is not None:
            # A dedicated segment stays mapped and pinned too: the daemon keeps it idle for a reload
            # of the same checkpoint, and the segment cache unmaps it once the daemon unlinks it.
            # Bound to the method, not to a list: this runs after later requests were sent.
            copier.release_after(functools.partial(self._released, batch), fence)
        for h, tensor in zip(batch, tensors):
            yield h.name, tensor
        tensors.clear()

    def _cut(self, h: Handle) -> slicing.Cut | None:
        """The part of ``h``'s tensor this rank asked for (``None``: all of it), made once per name
        from the handle's dtype and shape (the daemon checked the slice against them at the join)."""
        if h.name not in self._slices:
            return None
        if h.name not in self._cuts:
            dim, pieces = self._slices[h.name]
            c = slicing.cut(h, dim, pieces)
            self._cuts[h.name] = None if c.whole else c
        return self._cuts[h.name]

    def _item(self, h: Handle) -> tuple[np.ndarray, str, tuple[int, ...], delivery.Runs | None]:
        """What this rank receives of ``h``: a view of the bytes, the dtype and shape of the tensor
        it yields, and where its slice is several runs of the view, those runs (``None``: the view
        is the tensor's bytes). A slice of one run is a view of just that run."""
        view = self._source(h)
        c = self._cut(h)
        if c is None:
            return view, h.dtype, tuple(h.shape), None
        runs = c.runs()
        if len(runs[0]) > 1:
            return view, h.dtype, c.header_shape, runs
        offset, nbytes = (int(runs[0][0]), int(runs[1][0])) if len(runs[0]) else (0, 0)
        return view[offset : offset + nbytes], h.dtype, c.header_shape, None

    def _gather(self, h: Handle, view: np.ndarray, shape: tuple[int, ...], runs: delivery.Runs) -> torch.Tensor:
        """The runs of ``h``'s slice gathered into a new CPU tensor (the copier's threads, guarded)."""
        return delivery.copy_to_cpu([(view, h.dtype, shape, runs)], functools.partial(handles.cut_short, [h]))[0]

    def _contiguous(self, h: Handle) -> tuple[int, str, tuple[int, ...]]:
        """A staged copy's source of ``h``: its slice's bytes in one run (gathered first where they
        are several, and kept until the batch is finished), with the dtype and shape it yields."""
        view, dtype, shape, runs = self._item(h)
        if runs is None:
            return view.ctypes.data, dtype, shape
        gathered = self._gather(h, view, shape, runs)
        self._gathered.setdefault(h.batch, []).append(gathered)
        return gathered.data_ptr(), dtype, shape

    def _source(self, h: Handle) -> np.ndarray:
        """The bytes of ``h`` in its segment as this rank mapped it, checked first (:func:`handles.check`):
        every way a handle's bytes are read starts here. A handle of no segment has none."""
        if h.segment is None:
            handles.check(h, 0)
            return _NO_BYTES
        segment = self._segments.array(h.segment)
        handles.check(h, segment.nbytes)
        return segment[h.offset : h.offset + h.nbytes]

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
