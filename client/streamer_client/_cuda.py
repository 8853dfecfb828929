"""Host -> GPU copies out of host buffers that are page-locked once (docs/architecture.md).

Both data paths end here: the embedded engine's ring slots (private anonymous
``mmap`` s) and, in daemon mode, the shared-memory segment files a rank maps.
Either way a host buffer is named by its base address and size, is pinned once
(``cudaHostRegister`` through ``torch.cuda.cudart()``) and is reused for many
copies; pageable copies run several times slower (the driver stages them through a
buffer of its own).

Usage, for one target device::

    copier = PinnedCopier("cuda:0")
    copier.register(address, nbytes)           # once per buffer (a no-op when already pinned)
    tensors = [copier.copy(view, dtype, shape) for view, dtype, shape in batch]
    fence = copier.fence()                     # from here the tensors are safe on the current stream
    copier.release_after(recycle_buffer, fence)  # recycle_buffer() runs once those copies completed
    ...
    copier.poll()                              # runs the callbacks whose copies have completed
    copier.close()                             # waits for every copy, unpins what it pinned

Streams. Copies are ``non_blocking`` on the copier's own stream, so they overlap
both the host (the next slot's arrival) and the caller's GPU work. A result is
allocated on the caller's *current* stream (the stream that will use it), and
two event waits make that safe without ``record_stream``:

- before the first copy after a fence, the copy stream waits for the current
  stream: the caching allocator may hand out a block whose previous user is
  still queued there, and the copy must not overwrite it under that work;
- :meth:`PinnedCopier.fence` makes the current stream wait for every copy
  issued so far, so any later work there sees the bytes. No host thread blocks.

Chosen over ``Tensor.record_stream`` (allocate on the copy stream, mark each
result as used on the consumer's stream): that needs one allocator event per
tensor at free time and delays the memory's reuse, while the two waits above are
two events per batch, and a result then behaves like any tensor made on the
caller's stream (free it, reuse it, pass it on). A caller that moves a result to
another stream synchronizes as for any tensor.

A host buffer may be reused (or unmapped) only once the copies out of it have
completed: :meth:`PinnedCopier.release_after` calls back then, from
:meth:`~PinnedCopier.poll`, :meth:`~PinnedCopier.wait_one` or
:meth:`~PinnedCopier.drain`. Copies complete in the order they were issued (one
stream), so callbacks run in that order too.

Page-locking (registration, its process-wide registry and the pageable fallback) is
:mod:`streamer_client._pinning`'s.

Not thread-safe: one thread drives a copier.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from ._counters import Counters
from ._devices import resolve_device
from ._pinning import Cudart, HostPinner, registered_ranges
from .errors import ConfigError

# HostPinner and registered_ranges are .pinning's; importing them from here works too.
__all__ = [
    "CopyStats",
    "Fence",
    "HostPinner",
    "PinnedCopier",
    "address_of",
    "cuda_device",
    "registered_ranges",
]

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- device


def cuda_device(device: str | int | torch.device) -> torch.device:
    """``device`` as ``torch.device('cuda', N)``; :class:`ConfigError` when it cannot be used."""
    target = resolve_device(device)
    if target.type != "cuda":
        raise ConfigError(f"device {device!r} is not a CUDA device")
    return target


def address_of(buffer: Any) -> tuple[int, int]:
    """``(base address, nbytes)`` of a contiguous numpy array or CPU tensor (what :meth:`register` takes)."""
    if isinstance(buffer, torch.Tensor):
        if buffer.device.type != "cpu" or not buffer.is_contiguous():
            raise ValueError("address_of needs a contiguous CPU tensor")
        return buffer.data_ptr(), buffer.numel() * buffer.element_size()
    interface = getattr(buffer, "__array_interface__", None)
    if interface is not None and getattr(buffer, "flags", None) is not None and buffer.flags.c_contiguous:
        return interface["data"][0], buffer.nbytes
    raise ValueError(f"address_of needs a contiguous numpy array or CPU tensor, got {type(buffer).__name__}")


# --------------------------------------------------------------------------- completion


class _Event(Protocol):
    def query(self) -> bool: ...
    def synchronize(self) -> None: ...


class Fence:
    """The point on a copier's stream after the copies issued before it."""

    __slots__ = ("event",)

    def __init__(self, event: _Event) -> None:
        self.event = event

    def done(self) -> bool:
        return bool(self.event.query())

    def wait(self) -> None:
        self.event.synchronize()


class _Releases:
    """Callbacks waiting for fences; fences of one stream complete in order, so FIFO."""

    def __init__(self) -> None:
        self._queue: deque[tuple[Fence, Callable[[], Any]]] = deque()

    def __len__(self) -> int:
        return len(self._queue)

    def add(self, fence: Fence, callback: Callable[[], Any]) -> None:
        self._queue.append((fence, callback))

    def poll(self) -> int:
        """Run the callbacks whose fence has passed (in order); how many ran."""
        ran = 0
        while self._queue and self._queue[0][0].done():
            _, callback = self._queue.popleft()
            callback()
            ran += 1
        return ran

    def wait_one(self) -> bool:
        """Wait for the oldest fence and run its callback (and any others done by then)."""
        if not self._queue:
            return False
        self._queue[0][0].wait()
        self.poll()
        return True

    def drain(self) -> None:
        while self._queue:
            self.wait_one()


# --------------------------------------------------------------------------- copies


class CopyStats(Counters):
    copies: int = 0
    bytes: int = 0
    pinned_bytes: int = 0  # copied out of page-locked memory
    pageable_bytes: int = 0
    fences: int = 0
    register_seconds: float = 0.0  # spent in cudaHostRegister
    registered_bytes: int = 0  # held right now
    fallback: str | None = None  # why copies went pageable, if they did


def _check_host(host: torch.Tensor, nbytes: int) -> None:
    if not isinstance(host, torch.Tensor):
        raise TypeError(f"host view must be a torch.Tensor, got {type(host).__name__}")
    if host.device.type != "cpu" or host.dtype != torch.uint8 or host.dim() != 1 or not host.is_contiguous():
        raise ValueError(
            f"host view must be a contiguous 1-D uint8 CPU tensor, got {host.dtype} {tuple(host.shape)} on {host.device}"
        )
    if host.numel() != nbytes:
        raise ValueError(f"host view has {host.numel()} bytes, the tensor needs {nbytes}")


def _nbytes(dtype: torch.dtype, shape: Sequence[int]) -> int:
    return math.prod(shape) * dtype.itemsize


class PinnedCopier:
    """Copies out of host buffers into owned tensors on one CUDA device (see the module docstring).

    ``pin=False`` never registers (pageable copies, no warning). ``stream``: the copy stream
    (default: a new one on ``device``).
    """

    def __init__(
        self,
        device: str | int | torch.device,
        *,
        pin: bool = True,
        stream: torch.cuda.Stream | None = None,
        cudart: Cudart | None = None,
    ) -> None:
        self.device = cuda_device(device)
        self.stream = stream if stream is not None else torch.cuda.Stream(device=self.device)
        self.pinner = HostPinner(cudart, enabled=pin)
        self._releases = _Releases()
        self._stats = CopyStats()
        self._issued = False  # copies issued since the last fence
        self._last_fence: Fence | None = None
        self._closed = False

    # ------------------------------------------------------------------ buffers

    def register(self, address: int, nbytes: int, *, read_only: bool = False) -> bool:
        """Page-lock a host buffer once (idempotent per base address); whether it is pinned.

        On failure: one warning per process, and this copier copies pageable from then on.
        """
        with torch.cuda.device(self.device):
            return self.pinner.pin(address, nbytes, read_only=read_only)

    def unregister(self, address: int) -> None:
        """Unpin a buffer this copier registered, after every copy in flight (from it or not)."""
        self.drain()
        self.pinner.unpin(address)

    def is_pinned(self, address: int, nbytes: int) -> bool:
        return self.pinner.is_pinned(address, nbytes)

    # ------------------------------------------------------------------ copies

    def copy(self, host: torch.Tensor, dtype: torch.dtype | str, shape: Sequence[int]) -> torch.Tensor:
        """A new tensor on the device holding ``host`` 's bytes as ``dtype``/``shape`` (a torch
        dtype and shape, or a safetensors dtype name and its header shape).

        ``host``: a contiguous 1-D uint8 CPU tensor over the bytes (e.g. ``torch.from_numpy``
        of a slice of a mapped buffer). The copy is queued on the copy stream and this returns at
        once; the result must not be used before :meth:`fence` (which makes the current stream
        wait for it), and ``host`` 's memory must stay untouched until the copy has completed
        (:meth:`release_after`). The result is owned: nothing reuses its memory.
        """
        if isinstance(dtype, str):
            from ._dtypes import torch_layout

            dtype, shape = torch_layout(dtype, shape)
        shape = tuple(int(d) for d in shape)
        _check_host(host, _nbytes(dtype, shape))
        out = self.empty(dtype, shape)
        self.copy_into(host, out, 0)
        return out

    def empty(self, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
        """A new owned tensor on the device, for :meth:`copy_into` to fill (on the current stream)."""
        if self._closed:
            raise RuntimeError("PinnedCopier is closed")
        return torch.empty(tuple(int(d) for d in shape), dtype=dtype, device=self.device)

    def copy_into(self, host: torch.Tensor, out: torch.Tensor, offset: int) -> None:
        """Queue the copy of ``host`` 's bytes into bytes ``[offset, offset + len(host))`` of ``out``
        (a tensor from :meth:`empty`): a tensor larger than any host buffer arrives in parts. Same
        rules as :meth:`copy`: use ``out`` after :meth:`fence`, keep ``host`` until the copy completed."""
        _check_host(host, host.numel())
        self.copy_pieces(host, [(0, host.numel(), out, offset)])

    def copy_pieces(self, host: torch.Tensor, pieces: Sequence[tuple[int, int, torch.Tensor, int]]) -> None:
        """Queue, for each ``(at, nbytes, out, offset)``, the copy of ``host[at : at + nbytes]`` into
        bytes ``[offset, offset + nbytes)`` of ``out``: one window of a staging buffer, its pieces
        going to several tensors, queued with one pass over the stream. Rules of :meth:`copy_into`."""
        if self._closed:
            raise RuntimeError("PinnedCopier is closed")
        if not pieces:
            return
        if not self._issued:
            # The allocator may have handed us a block whose last user is still queued on the
            # consumer's stream: copy only after that work.
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            self._issued = True
        total = 0
        with torch.cuda.stream(self.stream):
            for at, nbytes, out, offset in pieces:
                if at < 0 or nbytes < 0 or at + nbytes > host.numel() or offset < 0 or offset + nbytes > out.nbytes:
                    raise ValueError(
                        f"copy of host bytes [{at}, {at + nbytes}) of {host.numel()} into bytes "
                        f"[{offset}, {offset + nbytes}) of a {out.nbytes}-byte tensor is out of bounds"
                    )
                if nbytes:
                    target = out.reshape(-1).view(torch.uint8)[offset : offset + nbytes]
                    target.copy_(host[at : at + nbytes], non_blocking=True)
                    total += nbytes
        stats = self._stats
        stats.copies += len(pieces)
        stats.bytes += total
        if self.pinner.is_pinned(host.data_ptr(), host.numel()):
            stats.pinned_bytes += total
        else:
            stats.pageable_bytes += total

    def fence(self) -> Fence:
        """Mark the copies issued so far: the current stream waits for them (no host blocking).

        After this the results may be used on the current stream. Returns the fence to wait on or
        pass to :meth:`release_after`.
        """
        if not self._issued and self._last_fence is not None:
            return self._last_fence
        event = torch.cuda.Event()
        event.record(self.stream)
        torch.cuda.current_stream(self.device).wait_event(event)
        self._issued = False
        self._last_fence = Fence(event)
        self._stats.fences += 1
        return self._last_fence

    def release_after(self, callback: Callable[[], Any], fence: Fence | None = None) -> None:
        """Call ``callback()`` once the copies before ``fence`` (default: a new fence) completed.

        Callbacks run from :meth:`poll`, :meth:`wait_one`, :meth:`drain` or :meth:`close`, on the
        calling thread, in order.
        """
        self._releases.add(fence if fence is not None else self.fence(), callback)

    def poll(self) -> int:
        """Run the callbacks whose copies have completed, without blocking; how many ran."""
        return self._releases.poll()

    def wait_one(self) -> bool:
        """Block until the oldest pending callback's copies completed and run it; False if none."""
        return self._releases.wait_one()

    @property
    def pending(self) -> int:
        """Callbacks still waiting for their copies."""
        return len(self._releases)

    def drain(self) -> None:
        """Wait for every copy issued so far and run every pending callback."""
        if self._issued:
            self.fence()
        self._releases.drain()
        self.stream.synchronize()

    def close(self) -> None:
        """Drain, then unpin every buffer this copier registered. Idempotent."""
        if self._closed:
            return
        try:
            self.drain()
        finally:
            self._closed = True
            self.pinner.close()

    @property
    def stats(self) -> CopyStats:
        self._stats.register_seconds = self.pinner.register_seconds
        self._stats.registered_bytes = self.pinner.pinned_bytes
        self._stats.fallback = self.pinner.failure
        return self._stats

    def __enter__(self) -> PinnedCopier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"PinnedCopier({self.device}, {self.stats})"
