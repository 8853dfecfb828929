"""Memory whose first touch the kernel holds: private anonymous pages registered with
userfaultfd (missing-page mode) and never supplied, so that any thread writing them blocks in the
kernel until :meth:`HeldPages.release`. A copy into them cannot end before the test lets it,
whatever the machine's speed or load. Needs root (or ``vm.unprivileged_userfaultfd``)."""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import platform
import select
import struct
import threading

import numpy as np
import pytest

_NR_USERFAULTFD = {"x86_64": 323, "aarch64": 282}
_UFFD_API = 0xAA
_UFFDIO_API = 0xC018AA3F  # _IOWR(0xAA, 0x3F, struct uffdio_api)
_UFFDIO_REGISTER = 0xC020AA00  # _IOWR(0xAA, 0x00, struct uffdio_register)
_UFFDIO_REGISTER_MODE_MISSING = 1


class HeldPages:
    """``nbytes`` of memory (``array``) whose pages are held until :meth:`release`, at the latest
    ``release_after_s`` from now (so that a test that wrongly waits for them fails, not hangs)."""

    def __init__(self, nbytes: int, release_after_s: float = 30.0) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        fd = libc.syscall(_NR_USERFAULTFD[platform.machine()], os.O_CLOEXEC | os.O_NONBLOCK)
        if fd < 0:  # a kernel without it, or a sandbox that forbids it: the test cannot be made here
            pytest.skip(f"userfaultfd: {os.strerror(ctypes.get_errno())}")
        self._fd = fd
        self._lock = threading.Lock()
        self._map = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.array = np.frombuffer(self._map, dtype=np.uint8)
        fcntl.ioctl(fd, _UFFDIO_API, bytearray(struct.pack("QQQ", _UFFD_API, 0, 0)))
        fcntl.ioctl(
            fd, _UFFDIO_REGISTER, bytearray(struct.pack("QQQQ", self.array.ctypes.data, nbytes, _UFFDIO_REGISTER_MODE_MISSING, 0))
        )
        self._timer = threading.Timer(release_after_s, self.release)
        self._timer.daemon = True
        self._timer.start()

    def wait_for_fault(self, timeout_s: float) -> bool:
        """Whether a thread is held on one of these pages within ``timeout_s``: from then until
        :meth:`release` that thread is inside the kernel, in the call that touched them."""
        poller = select.poll()
        poller.register(self._fd, select.POLLIN)
        return bool(poller.poll(int(timeout_s * 1000)))

    def release(self) -> None:
        """Let every held fault, and every later one, proceed as usual (closing the descriptor
        unregisters the range and wakes the threads it held)."""
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
        self._timer.cancel()
