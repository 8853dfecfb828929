"""Host bytes -> tensors: how both modes turn bytes in host memory into the tensors they yield.

The embedded engine (``streamer_service.embedded.engine``) has its bytes in ring slots it read into; the
daemon client (:mod:`streamer_client._daemon`) has them in the daemon's mapped segments. Either
way a tensor is delivered in one of these ways, each written once here:

- :func:`over`: a tensor over memory that is never reused (a buffer handed to the caller);
- :func:`lend`: a borrowed view of a reusable buffer, recorded in its :class:`Leases`;
- :func:`copy_to_cpu`: owned CPU tensors, the bytes copied by the native copier's threads
  (:mod:`streamer_client._native_copier`; numpy where it is not built), a batch at a time, into new
  memory advised for transparent huge pages;
- :func:`to_device`: a device tensor copied from page-locked memory on the copier's stream
  (:class:`streamer_client._cuda.PinnedCopier`: fence, release after completion);
- :class:`Staging`: device tensors from memory that is *not* page-locked (a segment read once):
  the native copier's threads copy it, a window at a time, into a small ring of page-locked
  buffers registered once per process, and each window's host-to-device copies run on the
  copier's stream while the next window is filled. Nothing proportional to the checkpoint is
  page-locked.

A source cut short under its mapping (a segment or file truncated while it is read) raises SIGBUS
in the thread copying it (one of the copier's, or the caller's for a batch under 256 KiB); the
copier's guard catches it and the caller's ``fault(i)`` names the tensor. Without the native
copier (no C compiler at install) nothing can catch it: such a SIGBUS ends the process.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch

from . import _native_copier as copier
from ._dtypes import tensor_over, torch_layout
from ._host_memory import anonymous, fault_in
from ._leases import Leases

if TYPE_CHECKING:
    from ._cuda import PinnedCopier
    from ._pinning import HostPinner

__all__ = [
    "STAGING_SLOTS", "STAGING_SLOT_BYTES", "Staging", "copy_to_cpu", "empty", "lend", "over", "reserve", "staging_pinned",
    "to_device",
]  # fmt: skip

STAGING_SLOT_BYTES = 32 * 1024 * 1024
STAGING_SLOTS = 3
"""The staging ring: 3 x 32 MiB page-locked, InstantTensor's choice (one window filling, one or two
copying to the device), made of :func:`~streamer_client._host_memory.anonymous` memory, faulted in
on the copier's threads and registered once per process, on its first staged load."""

_Key = TypeVar("_Key")  # what names a batch staged by Staging.copy_batch
Runs = tuple[np.ndarray, np.ndarray]  # (offsets, sizes) of the runs a tensor is gathered from

_HUGE_MIN_BYTES = 4 * 1024 * 1024
"""Owned CPU tensors of this size or more are advised for transparent huge pages before they are
written (numpy's threshold for the same advice): new memory is faulted in and zero-filled as it
is first written, and a huge page takes one fault where 4 KiB pages take 512."""
_NATIVE_MIN_BYTES = 256 * 1024  # below this a batch is copied on the calling thread: no thread hand-off


def over(view: np.ndarray, dtype: str, shape: Sequence[int]) -> torch.Tensor:
    """A tensor over ``view`` itself (it keeps the memory alive): for buffers never reused."""
    return tensor_over(view, dtype, shape)


def lend(leases: Leases, name: str, view: np.ndarray, dtype: str, shape: Sequence[int]) -> tuple[torch.Tensor, weakref.ref]:
    """A borrowed tensor over ``view``, recorded in ``leases``; with its lease (the item in hand)."""
    in_hand = leases.lend(name, view)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a read-only or private mapping: nothing to warn about
        return tensor_over(view, dtype, shape), in_hand


def empty(dtype: str, shape: Sequence[int], device: torch.device) -> torch.Tensor:
    torch_type, dims = torch_layout(dtype, shape)
    return torch.empty(dims, dtype=torch_type, device=device)


def copy_to_cpu(
    items: Sequence[tuple[np.ndarray, str, Sequence[int]] | tuple[np.ndarray, str, Sequence[int], Runs | None]],
    fault: Callable[[int], BaseException],
) -> list[torch.Tensor]:
    """Owned CPU tensors with the bytes of ``items`` (``(uint8 view, dtype, shape)``, or with a
    fourth member, the runs of the view the tensor is gathered from, in order: ``(offsets,
    sizes)`` arrays, :meth:`streamer_client._slicing.Cut.runs`), copied on the native copier's
    threads; ``fault(i)``: the error of item ``i`` whose source hit SIGBUS."""
    outs = [empty(item[1], item[2], torch.device("cpu")) for item in items]
    # One copy per whole item, in lists; a gathered item's runs stay arrays (a slice of a later
    # dimension has one run per row), joined to the lists only where there are some.
    dst: Sequence[int] = []
    src: Sequence[int] = []
    size: Sequence[int] = []
    index: Sequence[int] = []  # the item of each copy
    runs_dst, runs_src, runs_size, runs_index = [], [], [], []
    for i, (item, out) in enumerate(zip(items, outs)):
        view = item[0]
        runs = item[3] if len(item) > 3 else None
        if runs is None:
            if view.nbytes:
                dst.append(out.data_ptr())
                src.append(view.ctypes.data)
                size.append(view.nbytes)
                index.append(i)
        elif len(runs[1]):
            offsets, lengths = runs
            runs_dst.append(out.data_ptr() + np.cumsum(lengths) - lengths)
            runs_src.append(view.ctypes.data + offsets)
            runs_size.append(lengths)
            runs_index.append(np.full(len(lengths), i))
    if runs_size:
        dst = np.concatenate([np.array(dst, np.int64), *runs_dst]).astype(np.uint64)
        src = np.concatenate([np.array(src, np.int64), *runs_src]).astype(np.uint64)
        size = np.concatenate([np.array(size, np.int64), *runs_size]).astype(np.uint64)
        index = np.concatenate([np.array(index, np.int64), *runs_index])
    total = int(sum(size)) if isinstance(size, list) else int(size.sum())
    if not total:
        return outs
    if copier.available():
        if total >= _NATIVE_MIN_BYTES:
            for out in outs:
                nbytes = out.numel() * out.element_size()
                if nbytes >= _HUGE_MIN_BYTES:
                    copier.advise_huge(out.data_ptr(), nbytes)  # before the copying threads first touch it
            failed = copier.copy(dst, src, size)
        else:
            failed = copier.copy_here(dst, src, size)
        if failed >= 0:
            raise fault(int(index[failed]))
    else:  # no native copier: nothing to guard a copy with
        for d, s_, n in zip(dst, src, size):
            _memmove(int(d), int(s_), int(n))
    return outs


_ALLOCATION_GRANULE = 512  # the caching allocator rounds every block up to this
_LARGE_BLOCK = 1024 * 1024  # smaller tensors come from the allocator's pool of small blocks


def reserve(device: torch.device, sizes: Sequence[int]) -> None:
    """Have the caching allocator hold a load's device tensors (``sizes`` in bytes) in one
    segment before they are allocated: one ``cudaMalloc`` instead of one per large tensor, each a
    driver call in a fresh process. The block is freed at once; the tensors are carved out of it.
    Skipped where the allocator already holds that much unused, or cannot get it in one piece."""
    if device.type != "cuda":
        return
    nbytes = sum(-(-n // _ALLOCATION_GRANULE) * _ALLOCATION_GRANULE for n in sizes if n >= _LARGE_BLOCK)
    if nbytes <= 0 or torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device) >= nbytes:
        return
    try:
        block = torch.empty(nbytes, dtype=torch.uint8, device=device)
    except torch.cuda.OutOfMemoryError:
        return  # no room in one piece: the tensors are allocated one by one
    del block


def to_device(pinned: PinnedCopier, view: np.ndarray, dtype: str, shape: Sequence[int]) -> torch.Tensor:
    """A device tensor with ``view`` 's bytes, queued on ``pinned`` 's stream (see its ``copy``)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a read-only mapping: it is only read
        host = torch.from_numpy(view)
    return pinned.copy(host, dtype, shape)


# --------------------------------------------------------------------------- staging


class _StagingRing:
    """Page-locked staging buffers: the process's one ring (made and registered on first use,
    kept), or a load's own while another load of the process holds that one."""

    def __init__(self, slots: int, slot_bytes: int) -> None:
        self.slot_bytes = slot_bytes
        self._count = slots
        self._lock = threading.Lock()
        self._busy = False
        self._slots: list[np.ndarray] | None = None
        self._pinner: HostPinner | None = None
        self.pinned = False

    def claim(self) -> bool:
        with self._lock:
            if self._busy:
                return False
            self._busy = True
            return True

    def slots(self, device: torch.device) -> list[np.ndarray]:
        if self._slots is None:
            from ._pinning import HostPinner

            buffers = [anonymous(self.slot_bytes) for _ in range(self._count)]
            fault_in(buffers)
            self._pinner = HostPinner()
            with torch.cuda.device(device):
                self.pinned = all(self._pinner.pin(b.ctypes.data, b.nbytes) for b in buffers)
            self._slots = buffers
        return list(self._slots)

    def give_back(self) -> None:
        with self._lock:
            self._busy = False

    def release(self) -> None:
        """Unpin (a load's own ring, at its end); the memory goes with the last view."""
        if self._pinner is not None:
            self._pinner.close()
        self._slots = None
        self.pinned = False


_RING = _StagingRing(STAGING_SLOTS, STAGING_SLOT_BYTES)


def staging_pinned() -> bool:
    """Whether the process's staging ring is page-locked (false before first use, or where
    registering failed: its copies are then pageable, with the copier's one warning)."""
    return _RING.pinned


class _Filling:
    """A window being copied into a staging slot: the copier's ticket (``None``: copied already),
    the window's items and their offsets in the slot, and the tensors and fault of its call."""

    __slots__ = ("slot", "ticket", "window", "offsets", "outs", "fault")

    def __init__(self, slot: np.ndarray, ticket: int | None, window, offsets: list[int], outs: list[torch.Tensor], fault) -> None:
        self.slot, self.ticket, self.window, self.offsets, self.outs, self.fault = slot, ticket, window, offsets, outs, fault


class Staging:
    """One load's device copies through the process's staging ring (see the module docstring).

    Successive :meth:`copy` calls may form one stream of windows (``hold``): the last window of
    one call is queued to the device by the next call, once the next call's first window is
    being filled, so that the copier's threads never wait for the caller between calls.
    :meth:`copy_batch` does it by batch and says which batches each call finished (both modes
    stage that way: a daemon's rank its segments, an embedded load its files' mappings).

    Not thread-safe: the thread that drives ``pinned`` (a :class:`PinnedCopier`) drives this.
    :meth:`close` gives the ring back after every copy out of it has completed.
    """

    def __init__(self, pinned: PinnedCopier) -> None:
        self._pinned = pinned
        self._own = not _RING.claim()  # another load of this process holds the ring: one of its own
        self._ring = _StagingRing(STAGING_SLOTS, STAGING_SLOT_BYTES) if self._own else _RING
        try:
            self._free = self._ring.slots(pinned.device)
        except BaseException:
            self._finish()
            raise
        self._filling: _Filling | None = None
        self._held: tuple[Any, list[torch.Tensor]] | None = None  # (key, tensors) of copy_batch's held batch
        self._closed = False

    def copy(
        self,
        items: Sequence[tuple[int, str, Sequence[int]]],
        fault: Callable[[int], BaseException],
        *,
        hold: bool = False,
    ) -> list[torch.Tensor]:
        """Device tensors of ``items`` (``(source address, dtype, shape)``), their bytes staged.

        Returns once every byte was copied out of the sources (they may be reused from now on);
        the tensors may be used on the current stream (fenced), their copies may still run.
        ``hold``: more items follow at once; the last window of these is still being filled when
        this returns, and the next :meth:`copy` (or :meth:`flush`) finishes it: only then are all
        of these sources read and all of these tensors fenced. ``fault(i)`` is the error of item
        ``i`` whose source was cut short, raised by whichever call finishes its window.
        """
        outs = [self._pinned.empty(*torch_layout(dtype, shape)) for _, dtype, shape in items]
        held = self._filling  # the window a held call left, if any: the first fill below queues it
        window: list[tuple[int, int, int, int]] = []  # (item, source address, nbytes, offset in the tensor)
        filled = 0
        try:
            for i, ((address, _, _), out) in enumerate(zip(items, outs)):
                nbytes, done = out.numel() * out.element_size(), 0
                while done < nbytes:
                    n = min(nbytes - done, self._ring.slot_bytes - filled)
                    window.append((i, address + done, n, done))
                    filled += n
                    done += n
                    if filled == self._ring.slot_bytes:
                        self._fill(window, outs, fault)
                        window, filled = [], 0
            if window:
                self._fill(window, outs, fault)
            if not hold or self._filling is held:  # (nothing filled here: finish the held window now)
                self.flush()
        except BaseException:
            self.abandon()
            raise
        return outs

    def copy_batch(
        self,
        key: _Key,
        items: Sequence[tuple[int, str, Sequence[int]]],
        fault: Callable[[int], BaseException],
        *,
        hold: bool = False,
    ) -> list[tuple[_Key, list[torch.Tensor]]]:
        """:meth:`copy` of one batch (``key`` names it), in the stream of windows of every batch:
        the batches finished by this call, in order, each with its tensors: every source of them
        read, every tensor fenced. The batch before this one is finished now (its last window was
        queued when this one's first was filled, or flushed); this one too unless ``hold`` left
        its last window filling, in which case the next :meth:`copy_batch` or :meth:`flush_batch`
        finishes it. A batch of no items finishes at once."""
        outs = self.copy(items, fault, hold=hold)
        finished = [self._held] if self._held is not None else []
        self._held = None
        if self.holding:
            self._held = (key, outs)
        else:
            finished.append((key, outs))
        return finished

    def flush_batch(self) -> list[tuple[Any, list[torch.Tensor]]]:
        """Finish the batch :meth:`copy_batch` left held, if any: it, with its tensors."""
        self.flush()
        held, self._held = self._held, None
        return [held] if held is not None else []

    @property
    def holding(self) -> bool:
        """A held call's last window is still being filled: :meth:`copy` or :meth:`flush` finishes it."""
        return self._filling is not None

    def flush(self) -> None:
        """Finish the window being filled, if any: once this returns every source given to
        :meth:`copy` was read and every tensor it returned is fenced."""
        try:
            self._send()
        except BaseException:
            self.abandon()
            raise

    def _fill(self, window: list[tuple[int, int, int, int]], outs: list[torch.Tensor], fault) -> None:
        """Start copying ``window`` into a free slot on the copier's threads; while they copy, queue
        the device copies of the window filled before it (the host's work overlaps the copying)."""
        pinned = self._pinned
        while not self._free:
            # The oldest window's device copies completed: its slot is free again. (Three slots, at
            # most one being filled: another one is always free or on its way back.)
            if not pinned.wait_one():
                raise RuntimeError("staging bug: no free slot and no device copy to wait for")
        slot = self._free.pop()
        offsets, at = [], 0
        for _, _, n, _ in window:
            offsets.append(at)
            at += n
        base = slot.ctypes.data
        dsts, srcs, sizes = [base + o for o in offsets], [src for _, src, _, _ in window], [n for _, _, n, _ in window]
        if copier.available():
            ticket = copier.submit(dsts, srcs, sizes)
        else:  # no native copier: nothing to guard a copy with
            ticket = None
            for dst, src, n in zip(dsts, srcs, sizes):
                _memmove(dst, src, n)
        previous, self._filling = self._filling, _Filling(slot, ticket, window, offsets, outs, fault)
        if previous is not None:
            self._queue(previous)

    def _send(self) -> None:
        """Queue the device copies of the window being filled, if any."""
        filling, self._filling = self._filling, None
        if filling is not None:
            self._queue(filling)

    def _queue(self, filling: _Filling) -> None:
        """Wait for a filled window's host copies, then queue its device copies."""
        slot, window, outs = filling.slot, filling.window, filling.outs
        failed = copier.wait(filling.ticket) if filling.ticket is not None else -1
        if failed >= 0:
            self._free.append(slot)
            raise filling.fault(window[failed][0])
        pinned = self._pinned
        pieces = [(o, n, outs[i], start) for o, (i, _, n, start) in zip(filling.offsets, window)]
        pinned.copy_pieces(torch.from_numpy(slot), pieces)
        pinned.release_after(lambda: self._free.append(slot), pinned.fence())

    def abandon(self) -> None:
        """A copy failed, or the load ends with a window still held: wait for the window being
        filled (its threads write into a slot of ours and read sources the caller may free once
        we return) and take its slot back; its tensors were never handed out."""
        self._held = None  # its tensors were never handed out
        filling, self._filling = self._filling, None
        if filling is not None:
            if filling.ticket is not None:
                copier.wait(filling.ticket)
            self._free.append(filling.slot)

    def close(self) -> None:
        """Wait for every copy out of the ring, then give the ring back. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.abandon()  # a window still held: its tensors were never handed out
            self._pinned.drain()
        finally:
            self._finish()

    def _finish(self) -> None:
        if self._own:
            self._ring.release()
        else:
            self._ring.give_back()


def _memmove(dst: int, src: int, nbytes: int) -> None:
    import ctypes

    ctypes.memmove(dst, src, nbytes)
