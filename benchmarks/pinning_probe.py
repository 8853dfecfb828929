"""What page-locking a ring of host buffers costs a fresh process, and what it does to copies.

    python benchmarks/pinning_probe.py [--rings 4x64,3x32,4x32,2x32,4x16,8x8] [--reps 3]

Needs CUDA. For each ring (``COUNTxMiB``), new buffers each repetition, median printed:

- ``fresh``: private anonymous memory (``streamer_client.host_memory.anonymous``), registered
  (``cudaHostRegister``) untouched, so registration faults in every page;
- ``shmem``: Python's default anonymous ``mmap`` (shared memory), the same;
- ``touched, 1 thread``: every page written first by this thread, then registered;
- ``fault_in``: faulted in on the native copier's threads (``host_memory.fault_in``), then
  registered;
- ``again``: registered, unregistered and registered again (the pages present and pinned once);
- ``torch pin_memory``: ``torch.empty(..., pin_memory=True)`` (``cudaHostAlloc``; torch's cache
  of page-locked blocks emptied between repetitions).

Each line also says how much of the ring the kernel backed with transparent huge pages
(``AnonHugePages`` of the process). Then: 40 host-to-device copies of 32 MiB from page-locked
memory alone, and again while another thread registers a fresh 4 x 64 MiB ring (whether
registration holds up copies queued meanwhile); and the interpreter's cost of queueing one
window of device copies through ``streamer_client.cuda.PinnedCopier`` (two pieces, a fence, a
release), against two bare ``copy_`` calls. Figures in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import mmap
import statistics
import threading
import time
from collections.abc import Callable

import numpy as np
import torch

MIB = 1024 * 1024


def _sys(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError as exc:
        return f"? ({exc})"


def _anon_huge_bytes() -> int:
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) * 1024
    return 0


class _Runtime:
    """Registration as the client does it (:class:`streamer_client.pinning.HostPinner`), timed."""

    def __init__(self) -> None:
        from streamer_client.pinning import HostPinner

        self.pinner = HostPinner()

    def register(self, buffers: list[np.ndarray]) -> float:
        start = time.perf_counter()
        for b in buffers:
            if not self.pinner.pin(b.ctypes.data, b.nbytes):
                raise SystemExit(self.pinner.failure)
        return time.perf_counter() - start

    def unregister(self, buffers: list[np.ndarray]) -> None:
        for b in buffers:
            self.pinner.unpin(b.ctypes.data)


def rings(args, rt: _Runtime) -> None:
    from streamer_client import copier
    from streamer_client.host_memory import anonymous, fault_in

    def shmem(nbytes: int) -> np.ndarray:
        return np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8)

    def touch_here(buffers: list[np.ndarray]) -> None:
        for b in buffers:
            b[:: mmap.PAGESIZE] = 0

    cases: list[tuple[str, Callable[[int], np.ndarray], Callable[[list[np.ndarray]], None] | None, bool]] = [
        ("fresh", anonymous, None, False),
        ("shmem", shmem, None, False),
        ("touched, 1 thread", anonymous, touch_here, False),
        ("fault_in" + ("" if copier.available() else " (no native copier: nothing)"), anonymous, fault_in, False),
        ("again", anonymous, None, True),
    ]
    print(f"{'ring':<10} {'case':<24} {'touch ms':>9} {'register ms':>12} {'huge pages':>11}")
    for ring in args.rings.split(","):
        count, mib = (int(x) for x in ring.split("x"))
        for label, make, touch, again in cases:
            touches, registers, huge = [], [], []
            for _ in range(args.reps):
                buffers = [make(mib * MIB) for _ in range(count)]
                before = _anon_huge_bytes()
                start = time.perf_counter()
                if touch is not None:
                    touch(buffers)
                touches.append(time.perf_counter() - start)
                took = rt.register(buffers)
                huge.append((_anon_huge_bytes() - before) / (count * mib * MIB))
                if again:
                    rt.unregister(buffers)
                    took = rt.register(buffers)
                registers.append(took)
                rt.unregister(buffers)
                del buffers
            print(f"{ring:<10} {label:<24} {statistics.median(touches) * 1e3:>9.1f} "
                  f"{statistics.median(registers) * 1e3:>12.1f} {statistics.median(huge):>10.0%}")  # fmt: skip
        empty_host_cache = getattr(torch._C, "_host_emptyCache", None)  # torch's caching host allocator
        if empty_host_cache is None:
            print(f"{ring:<10} {'torch pin_memory':<24} not measured: this torch cannot empty its pinned-memory cache")
            continue
        took = []
        for _ in range(args.reps):
            start = time.perf_counter()
            pinned = [torch.empty(mib * MIB, dtype=torch.uint8, pin_memory=True) for _ in range(count)]
            took.append(time.perf_counter() - start)
            del pinned
            empty_host_cache()  # else the next repetition gets the cached blocks back
        print(f"{ring:<10} {'torch pin_memory':<24} {'':>9} {statistics.median(took) * 1e3:>12.1f}")


def copies_while_registering(rt: _Runtime) -> None:
    from streamer_client.host_memory import anonymous

    source = anonymous(256 * MIB)
    source[:] = 7
    rt.register([source])
    host = torch.from_numpy(source)
    target = torch.empty(256 * MIB, dtype=torch.uint8, device="cuda:0")
    stream = torch.cuda.Stream()

    def copies(n: int = 40) -> float:
        start = time.perf_counter()
        with torch.cuda.stream(stream):
            for i in range(n):
                at = (i % 8) * 32 * MIB
                target[at : at + 32 * MIB].copy_(host[at : at + 32 * MIB], non_blocking=True)
                if i % 4 == 3:
                    stream.synchronize()
        stream.synchronize()
        return time.perf_counter() - start

    alone = min(copies() for _ in range(3))
    other = [anonymous(64 * MIB) for _ in range(4)]
    took: dict[str, float] = {}
    thread = threading.Thread(target=lambda: took.setdefault("register", rt.register(other)))
    thread.start()
    together = copies()
    thread.join()
    rt.unregister(other + [source])
    print(f"40 x 32 MiB host-to-device copies: alone {alone * 1e3:.1f} ms ({40 * 32 * MIB / alone / 1e9:.1f} GB/s); "
          f"while another thread registers 4 x 64 MiB fresh ({took['register'] * 1e3:.1f} ms): {together * 1e3:.1f} ms")  # fmt: skip


def queueing() -> None:
    from streamer_client.cuda import PinnedCopier
    from streamer_client.host_memory import anonymous

    source = anonymous(8192)
    pinned = PinnedCopier("cuda:0")
    pinned.register(source.ctypes.data, source.nbytes)
    host = torch.from_numpy(source)
    outs = [torch.empty(4096, dtype=torch.uint8, device="cuda:0") for _ in range(2)]
    n = 400
    start = time.perf_counter()
    for _ in range(n):
        pinned.copy_pieces(host, [(0, 4096, outs[0], 0), (4096, 4096, outs[1], 0)])
        pinned.release_after(lambda: None, pinned.fence())
        pinned.poll()
    pinned.drain()
    per_window = (time.perf_counter() - start) / n
    start = time.perf_counter()
    with torch.cuda.stream(pinned.stream):
        for _ in range(n):
            outs[0].copy_(host[:4096], non_blocking=True)
            outs[1].copy_(host[4096:], non_blocking=True)
    pinned.stream.synchronize()
    bare = (time.perf_counter() - start) / n
    pinned.close()
    print(f"one window of device copies queued (2 pieces, fence, release): {per_window * 1e6:.0f} us; "
          f"two bare copy_ calls: {bare * 1e6:.0f} us")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rings", default="4x64,3x32,4x32,2x32,4x16,8x8")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("pinning_probe needs CUDA")
    torch.empty(1, device="cuda:0")
    torch.cuda.synchronize()
    print(f"transparent huge pages: {_sys('/sys/kernel/mm/transparent_hugepage/enabled')}; "
          f"defrag: {_sys('/sys/kernel/mm/transparent_hugepage/defrag')}")  # fmt: skip
    rt = _Runtime()
    rings(args, rt)
    copies_while_registering(rt)
    queueing()


if __name__ == "__main__":
    main()
