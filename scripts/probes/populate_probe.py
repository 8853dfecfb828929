"""How long other threads wait while the daemon makes segments beside them: SEGMENTS segments of
256 MiB made on shm.CREATE_WORKERS threads, mapped in one MAP_POPULATE call each, piecewise with
``mmap.madvise`` (which holds the GIL), or piecewise as ``streamer_client.segments.map_shared`` does
(through ctypes, which lets go of it), while one thread maps, touches and unmaps 8 MiB at a time, as
an S3 client allocating its part buffers does, and another, a Python thread like the daemon's
loading thread, sleeps 1 ms at a time (its longest stall). Alternates the ways, ROUNDS each, in
/dev/shm.

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

from streamer_client import segments
from streamer_service.daemon import shm

MIB = 2**20
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def one_call(fd: int, nbytes: int, *, writable: bool, populate: bool, piece: int) -> mmap.mmap:
    return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def gil_pieces(fd: int, nbytes: int, *, writable: bool, populate: bool, piece: int) -> mmap.mmap:
    mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    for offset in range(0, nbytes, piece):
        mapping.madvise(segments._POPULATE[True], offset, min(piece, nbytes - offset))  # the GIL held
    return mapping


WAYS = {"one call": one_call, "mmap.madvise": gil_pieces, "ctypes": None}


def run(way: str, segments: int, directory: Path) -> tuple[float, float, float, int, float]:
    original = shm.map_shared
    if WAYS[way] is not None:
        shm.map_shared = WAYS[way]
    done = threading.Event()
    waits: list[float] = []
    stalls: list[float] = []

    def tick() -> None:
        last = time.perf_counter()
        while not done.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            stalls.append(now - last)
            last = now

    def allocate() -> None:
        while not done.is_set():
            began = time.perf_counter()
            p = libc.mmap(None, 8 * MIB, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
            ctypes.memset(p, 1, 8 * MIB)
            libc.munmap(p, 8 * MIB)
            waits.append(time.perf_counter() - began)

    other = threading.Thread(target=allocate)
    ticker = threading.Thread(target=tick)
    try:
        began = time.perf_counter()
        other.start()
        ticker.start()
        with ThreadPoolExecutor(shm.CREATE_WORKERS) as makers:
            made = list(makers.map(lambda i: shm.Segment(f"s{i}", directory / f"s{i}", 256 * MIB), range(segments)))
        took = time.perf_counter() - began
    finally:
        done.set()
        other.join()
        ticker.join()
        shm.map_shared = original
    for segment in made:
        segment.close()
    return took, max(waits), sum(waits) / max(1, len(waits)), len(waits), max(stalls)


def main() -> None:
    segments = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    print(f"{os.cpu_count()} CPUs, {segments} x 256 MiB on {shm.CREATE_WORKERS} threads; beside them 8 MiB mmap+touch+munmap")
    print(f"{'way':<13} {'made in s':>10} {'longest wait ms':>16} {'mean ms':>8} {'allocations':>12} {'longest stall ms':>17}")
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        for _ in range(rounds):
            for way in WAYS:
                took, longest, mean, count, stall = run(way, segments, Path(d))
                print(f"{way:<13} {took:>10.3f} {longest * 1e3:>16.1f} {mean * 1e3:>8.2f} {count:>12} {stall * 1e3:>17.1f}")


if __name__ == "__main__":
    main()
