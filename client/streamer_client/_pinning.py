"""Page-locking host memory for CUDA copies: once per buffer, process-wide, with a fallback.

A host buffer is named by its base address and size and is pinned once (``cudaHostRegister``
through ``torch.cuda.cudart()``), then reused for many copies (:mod:`streamer_client._cuda`).

Fallback. If registration fails (a container's locked-memory limit, a kernel or
driver that refuses), copies go ahead from pageable memory: correct, several
times slower, announced by one ``RuntimeWarning`` per process; that copier
then stops trying to register. A range some other code already registered
(``cudaErrorHostMemoryAlreadyRegistered``) is page-locked, so it counts as
pinned and is never unregistered by us.

Registrations are process-wide (CUDA's are) and reference-counted by base
address: copiers for several devices, or the engine and a daemon client in one
process, share them. They use ``cudaHostRegisterPortable`` so a buffer pinned
for one device is pinned for every device of the process.
"""

from __future__ import annotations

import bisect
import ctypes
import logging
import threading
import time
import warnings
from typing import Protocol

import torch

__all__ = ["Cudart", "HostPinner", "registered_ranges"]

log = logging.getLogger(__name__)

HOST_REGISTER_PORTABLE = 0x01  # cudaHostRegisterPortable
HOST_REGISTER_READ_ONLY = 0x08  # cudaHostRegisterReadOnly (CUDA >= 11.1): for PROT_READ mappings
ERROR_ALREADY_REGISTERED = 712  # cudaErrorHostMemoryAlreadyRegistered
ERROR_NOT_REGISTERED = 713  # cudaErrorHostMemoryNotRegistered


class Cudart(Protocol):
    """The three runtime calls registration needs (real: :class:`_TorchCudart`; tests pass fakes)."""

    def host_register(self, address: int, nbytes: int, flags: int) -> int: ...
    def host_unregister(self, address: int) -> int: ...
    def error_string(self, code: int) -> str: ...


class _TorchCudart:
    """``torch.cuda.cudart()``: the CUDA runtime torch itself uses (so one error state, one context)."""

    def __init__(self) -> None:
        self._rt = torch.cuda.cudart()

    def host_register(self, address: int, nbytes: int, flags: int) -> int:
        code = int(self._rt.cudaHostRegister(address, nbytes, flags))
        if code:
            _clear_last_error()
        return code

    def host_unregister(self, address: int) -> int:
        code = int(self._rt.cudaHostUnregister(address))
        if code:
            _clear_last_error()
        return code

    def error_string(self, code: int) -> str:
        try:
            return str(self._rt.cudaGetErrorString(self._rt.cudaError(code)))
        except (TypeError, ValueError):  # a code pybind's enum does not name
            return f"CUDA error {code}"


_cudart_libraries: list[ctypes.CDLL] | None = None


def _clear_last_error() -> None:
    """Reset the runtime's sticky "last error" after a failed call we handled.

    A failed ``cudaHostRegister`` also records its error as the thread's last error, and
    torch checks ``cudaGetLastError()`` after its kernel launches: left there, our handled
    failure would surface later as an unrelated kernel's error. torch does not bind
    ``cudaGetLastError``, so call it in the libcudart this process has loaded (torch's,
    dynamically linked in its wheels). Nothing to do where cudart is linked statically.
    """
    global _cudart_libraries
    if _cudart_libraries is None:
        _cudart_libraries = []
        try:
            with open("/proc/self/maps") as maps:
                paths = {line.split(None, 5)[5].strip() for line in maps if "libcudart.so" in line}
        except OSError:
            paths = set()
        for path in sorted(paths):
            try:
                library = ctypes.CDLL(path)  # already loaded: the same handle, no second runtime
                library.cudaGetLastError.restype = ctypes.c_int
                _cudart_libraries.append(library)
            except (OSError, AttributeError):
                continue
    for library in _cudart_libraries:
        library.cudaGetLastError()


class _Entry:
    __slots__ = ("nbytes", "refs", "ours")

    def __init__(self, nbytes: int, refs: int, *, ours: bool) -> None:
        self.nbytes = nbytes
        self.refs = refs
        self.ours = ours  # False: registered by someone else before us; never unregistered here


class _Registration:
    """A registration in flight: ``done`` once ``cudaHostRegister`` answered ``code``."""

    __slots__ = ("done", "code")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.code = ERROR_NOT_REGISTERED  # until it answers (an exception from it leaves this)


class _Registry:
    """Process-wide page-locked ranges, by base address, reference-counted.

    The lock is never held across ``cudaHostRegister`` (a large range takes a while): lookups of
    registered ranges (:meth:`covers`, a copy's) go on while another range is being registered,
    and a second registration of a range in flight waits for that one and takes its outcome."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.entries: dict[int, _Entry] = {}
        self.starts: list[int] = []  # sorted keys of entries, for containment lookups
        self._registering: dict[int, _Registration] = {}  # by base address: registrations in flight

    def covers(self, address: int, nbytes: int) -> bool:
        """Whether ``[address, address + nbytes)`` lies inside one registered range."""
        with self.lock:
            i = bisect.bisect_right(self.starts, address) - 1
            if i < 0:
                return False
            start = self.starts[i]
            return address + nbytes <= start + self.entries[start].nbytes

    def acquire(self, cudart: Cudart, address: int, nbytes: int, flags: int) -> tuple[int, bool]:
        """Register (or take another reference); ``(error code, newly registered by us)``."""
        while True:
            with self.lock:
                entry = self.entries.get(address)
                if entry is not None:
                    if entry.nbytes < nbytes:
                        return ERROR_ALREADY_REGISTERED, False  # a smaller range at this base: not ours to grow
                    entry.refs += 1
                    return 0, False
                in_flight = self._registering.get(address)
                if in_flight is None:
                    mine = self._registering[address] = _Registration()
                    break
            in_flight.done.wait()
            if in_flight.code not in (0, ERROR_ALREADY_REGISTERED):
                return in_flight.code, False  # it failed: so does this one
            # It succeeded: take a reference (or, released since, register again).
        try:
            mine.code = cudart.host_register(address, nbytes, flags)
        finally:
            with self.lock:
                if mine.code == ERROR_ALREADY_REGISTERED:
                    # Registered outside this registry (user code, another library): page-locked already.
                    self._add(address, _Entry(nbytes, 1, ours=False))
                elif mine.code == 0:
                    self._add(address, _Entry(nbytes, 1, ours=True))
                del self._registering[address]
            mine.done.set()
        code = mine.code
        if code == ERROR_ALREADY_REGISTERED:
            return 0, False
        return code, code == 0

    def release(self, cudart: Cudart, address: int) -> None:
        with self.lock:
            entry = self.entries.get(address)
            if entry is None:
                return
            entry.refs -= 1
            if entry.refs > 0:
                return
            del self.entries[address]
            self.starts.remove(address)
            if entry.ours:
                code = cudart.host_unregister(address)
                if code and code != ERROR_NOT_REGISTERED:
                    log.warning("cudaHostUnregister(0x%x) failed: %s", address, cudart.error_string(code))

    def ranges(self) -> dict[int, int]:
        """``{base address: nbytes}`` of every range held."""
        with self.lock:
            return {address: entry.nbytes for address, entry in self.entries.items()}

    def _add(self, address: int, entry: _Entry) -> None:
        self.entries[address] = entry
        bisect.insort(self.starts, address)


_REGISTRY = _Registry()


def registered_ranges() -> dict[int, int]:
    """``{base address: nbytes}`` of every range pinned through this module (for tests, leak checks)."""
    return _REGISTRY.ranges()


_fallback_warned = False  # one warning per process, however many copiers fall back


def _warn_fallback(message: str) -> None:
    global _fallback_warned
    log.warning("%s", message)
    if not _fallback_warned:
        _fallback_warned = True
        warnings.warn(message, RuntimeWarning, stacklevel=4)


class HostPinner:
    """The buffers one user pinned: register once, fall back to pageable once, unpin at close.

    CUDA-free given a :class:`Cudart` (tests pass a fake one); :class:`PinnedCopier` uses one.
    """

    def __init__(self, cudart: Cudart | None = None, *, enabled: bool = True, registry: _Registry = _REGISTRY) -> None:
        self._cudart = cudart
        self._registry = registry
        self.enabled = enabled
        self.failure: str | None = None  # why this pinner stopped registering
        self.pinned_bytes = 0  # bytes of the ranges this pinner holds (ours or already pinned)
        self.register_seconds = 0.0
        self._held: dict[int, int] = {}  # address -> nbytes, one registry reference each

    @property
    def cudart(self) -> Cudart:
        if self._cudart is None:
            self._cudart = _TorchCudart()
        return self._cudart

    def pin(self, address: int, nbytes: int, *, read_only: bool = False) -> bool:
        """Page-lock ``[address, address + nbytes)`` once; whether it is page-locked now.

        ``read_only=True`` for memory mapped without PROT_WRITE (a registration without the
        read-only flag needs write access). A failure warns once and turns this pinner off.
        """
        if nbytes <= 0:
            return False
        if address in self._held:
            return self._held[address] >= nbytes
        if not self.enabled:
            return self._registry.covers(address, nbytes)
        flags = HOST_REGISTER_PORTABLE | (HOST_REGISTER_READ_ONLY if read_only else 0)
        start = time.perf_counter()
        code, _ = self._registry.acquire(self.cudart, address, nbytes, flags)
        self.register_seconds += time.perf_counter() - start
        if code:
            self.enabled = False
            self.failure = f"cudaHostRegister of {nbytes} bytes failed: {self.cudart.error_string(code)} ({code})"
            _warn_fallback(
                f"{self.failure}; copying to the GPU from pageable memory instead (correct, but several "
                "times slower). In containers, raise the locked-memory limit (ulimit -l) or grant IPC_LOCK."
            )
            return False
        self._held[address] = nbytes
        self.pinned_bytes += nbytes
        return True

    def is_pinned(self, address: int, nbytes: int) -> bool:
        return self._registry.covers(address, nbytes)

    def unpin(self, address: int) -> None:
        nbytes = self._held.pop(address, None)
        if nbytes is not None:
            self.pinned_bytes -= nbytes
            self._registry.release(self.cudart, address)

    def close(self) -> None:
        for address in list(self._held):
            self.unpin(address)
