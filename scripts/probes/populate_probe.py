"""How long a thread that maps memory waits while the daemon makes segments beside it: SEGMENTS
segments of 256 MiB made on shm.CREATE_WORKERS threads, mapped in one MAP_POPULATE call each (as
before) or piecewise (``streamer_client.segments.map_shared``), while another thread maps, touches and
unmaps 8 MiB at a time, as an S3 client allocating its part buffers does. Alternates the two ways,
ROUNDS each, in /dev/shm.

    python3 scripts/probes/populate_probe.py [SEGMENTS] [ROUNDS]
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from streamer_service.daemon import shm

MIB = 2**20
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def one_call(fd: int, nbytes: int, *, writable: bool, populate: bool, piece: int) -> mmap.mmap:
    return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def run(way: str, segments: int, directory: Path) -> tuple[float, float, float, int]:
    original = shm.map_shared
    if way == "one call":
        shm.map_shared = one_call
    done = threading.Event()
    waits: list[float] = []

    def allocate() -> None:
        while not done.is_set():
            began = time.perf_counter()
            p = libc.mmap(None, 8 * MIB, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
            ctypes.memset(p, 1, 8 * MIB)
            libc.munmap(p, 8 * MIB)
            waits.append(time.perf_counter() - began)

    other = threading.Thread(target=allocate)
    try:
        began = time.perf_counter()
        other.start()
        with ThreadPoolExecutor(shm.CREATE_WORKERS) as makers:
            made = list(makers.map(lambda i: shm.Segment(f"s{i}", directory / f"s{i}", 256 * MIB), range(segments)))
        took = time.perf_counter() - began
    finally:
        done.set()
        other.join()
        shm.map_shared = original
    for segment in made:
        segment.close()
    return took, max(waits), sum(waits) / max(1, len(waits)), len(waits)


def main() -> None:
    segments = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    print(f"{os.cpu_count()} CPUs, {segments} x 256 MiB on {shm.CREATE_WORKERS} threads; beside them 8 MiB mmap+touch+munmap")
    print(f"{'way':<10} {'made in s':>10} {'longest wait ms':>16} {'mean ms':>8} {'allocations':>12}")
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        for _ in range(rounds):
            for way in ("one call", "piecewise"):
                took, longest, mean, count = run(way, segments, Path(d))
                print(f"{way:<10} {took:>10.3f} {longest * 1e3:>16.1f} {mean * 1e3:>8.2f} {count:>12}")


if __name__ == "__main__":
    main()
