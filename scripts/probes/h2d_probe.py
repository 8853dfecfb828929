"""Where the time of a shared-memory -> GPU load goes: mapping, registration, staging, overlap.

    python scripts/probes/h2d_probe.py [--size-gb 4] [--dir /dev/shm] [--label shm-4k]

Every row moves one random file in ``--dir`` (GB = 1e9 bytes) and prints seconds and GB/s:

- ``mmap`` / ``mmap MAP_POPULATE``: mapping the file read-only (populate builds every page-table
  entry up front);
- ``register``: ``cudaHostRegister`` (read-only, portable) of the whole mapping, fresh or populated;
  ``register xN threads``: N registrations of 1/N of it at once, from N threads;
- ``copy registered``: 32 MiB copies out of the registered mapping (CUDA events);
- ``copy while registering``: the same copies from the first half while a thread registers the
  second half (does registration stall the copy engine?);
- ``staged T threads, S MiB``: T threads ``memcpy`` (numpy, GIL released) from a fresh, unregistered
  mapping into a ring of 4 pinned buffers of S MiB, each copied to the GPU once filled; what a
  process pays that registers nothing.

Data is random; every path's last bytes are checked against the source.
"""

from __future__ import annotations

import argparse
import mmap
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

GB = 1e9
MIB = 2**20
RO = 0x01 | 0x08  # portable | read-only


def write_file(path: Path, nbytes: int) -> np.ndarray:
    g = torch.Generator(device="cuda").manual_seed(7)
    with open(path, "w+b") as f:
        f.truncate(nbytes)
        m = mmap.mmap(f.fileno(), nbytes, flags=mmap.MAP_SHARED)
    view = np.frombuffer(m, dtype=np.uint8)
    step = 256 * MIB
    for o in range(0, nbytes, step):
        n = min(step, nbytes - o)
        view[o : o + n] = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda", generator=g).cpu().numpy()
    tail = view[-4096:].copy()
    del view
    m.close()
    return tail


def fresh_map(path: Path, populate: bool) -> tuple[mmap.mmap, np.ndarray, float]:
    fd = os.open(path, os.O_RDONLY)
    t = time.perf_counter()
    flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
    m = mmap.mmap(fd, os.fstat(fd).st_size, flags=flags, prot=mmap.PROT_READ)
    dt = time.perf_counter() - t
    os.close(fd)
    return m, np.frombuffer(m, dtype=np.uint8), dt


def register(ptr: int, n: int) -> float:
    t = time.perf_counter()
    code = int(torch.cuda.cudart().cudaHostRegister(ptr, n, RO))
    if code:
        raise SystemExit(f"cudaHostRegister failed: {code}")
    return time.perf_counter() - t


def unregister(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)


def copies(host: torch.Tensor, stream: torch.cuda.Stream, chunk: int = 32 * MIB) -> tuple[float, torch.Tensor]:
    n = host.numel()
    dst = torch.empty(n, dtype=torch.uint8, device="cuda")
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        a.record()
        for o in range(0, n, chunk):
            dst[o : o + chunk].copy_(host[o : o + chunk], non_blocking=True)
        b.record()
    b.synchronize()
    return a.elapsed_time(b) / 1e3, dst


def staged(
    array: np.ndarray, threads: int, slot_mib: int, pool: ThreadPoolExecutor, ring: list[torch.Tensor]
) -> tuple[float, torch.Tensor]:
    n = array.nbytes
    slot = slot_mib * MIB
    dst = torch.empty(n, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    events: list[torch.cuda.Event | None] = [None] * len(ring)
    piece = slot // threads
    torch.cuda.synchronize()
    t = time.perf_counter()
    for k, o in enumerate(range(0, n, slot)):
        i = k % len(ring)
        if events[i] is not None:
            events[i].synchronize()
        size = min(slot, n - o)
        buf = ring[i].numpy()
        futs = [
            pool.submit(np.copyto, buf[p : min(p + piece, size)], array[o + p : o + min(p + piece, size)])
            for p in range(0, size, piece)
        ]
        for f in futs:
            f.result()
        with torch.cuda.stream(stream):
            dst[o : o + size].copy_(ring[i][:size], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record()
        events[i] = ev
    stream.synchronize()
    return time.perf_counter() - t, dst


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--size-gb", type=float, default=4.0)
    p.add_argument("--dir", type=Path, default=Path("/dev/shm"))
    p.add_argument("--label", default="shm")
    args = p.parse_args()
    n = int(args.size_gb * GB) // (2 * MIB) * (2 * MIB)
    path = args.dir / f"h2d-probe-{os.getpid()}"
    rows: list[tuple[str, float, float]] = []

    def add(name: str, seconds: float, nbytes: int = n) -> None:
        rows.append((name, seconds, nbytes / seconds / GB if seconds else 0.0))
        print(f"  [{args.label}] {name}: {seconds:.4f} s {nbytes / seconds / GB if seconds else 0:.2f} GB/s", flush=True)

    tail = write_file(path, n)
    stream = torch.cuda.Stream()
    try:
        m, a, dt = fresh_map(path, False)
        add("mmap", dt)
        add("register (fresh mapping)", register(a.ctypes.data, n))
        host = torch.from_numpy(a)
        copies(host, stream)
        dt, dst = copies(host, stream)
        add("copy registered, 32 MiB", dt)
        assert torch.equal(dst[-4096:].cpu(), torch.from_numpy(tail))
        del dst
        unregister(a.ctypes.data)
        del host, a
        m.close()

        m, a, dt = fresh_map(path, True)
        add("mmap MAP_POPULATE", dt)
        add("register (populated mapping)", register(a.ctypes.data, n))
        unregister(a.ctypes.data)
        del a
        m.close()

        for threads in (4, 8, 16):
            m, a, _ = fresh_map(path, False)
            part = n // threads
            t = time.perf_counter()
            with ThreadPoolExecutor(threads) as pool:
                base = a.ctypes.data
                list(pool.map(lambda i, base=base, part=part: register(base + i * part, part), range(threads)))
            add(f"register x{threads} threads (fresh mapping)", time.perf_counter() - t)
            for i in range(threads):
                unregister(a.ctypes.data + i * part)
            del a
            m.close()

        m, a, _ = fresh_map(path, False)
        half = n // 2
        register(a.ctypes.data, half)
        host = torch.from_numpy(a)
        copies(host[:half], stream)
        dt, _ = copies(host[:half], stream)
        add("copy registered half, alone", dt, half)
        th = threading.Thread(target=register, args=(a.ctypes.data + half, n - half))
        th.start()
        dt, _ = copies(host[:half], stream)
        th.join()
        add("copy registered half, while registering the other", dt, half)
        unregister(a.ctypes.data)
        unregister(a.ctypes.data + half)
        del host, a
        m.close()

        for threads, slot_mib in ((4, 32), (8, 32), (16, 32), (16, 64), (8, 64)):
            ring = [torch.empty(slot_mib * MIB, dtype=torch.uint8, pin_memory=True) for _ in range(4)]
            with ThreadPoolExecutor(threads) as pool:
                m, a, _ = fresh_map(path, False)
                dt, dst = staged(a, threads, slot_mib, pool, ring)
                add(f"staged {threads} threads, {slot_mib} MiB x4 (fresh mapping)", dt)
                assert torch.equal(dst[-4096:].cpu(), torch.from_numpy(tail))
                del dst
                dt, dst = staged(a, threads, slot_mib, pool, ring)
                add(f"staged {threads} threads, {slot_mib} MiB x4 (mapping faulted)", dt)
                del dst, a
                m.close()
            del ring
    finally:
        path.unlink(missing_ok=True)
    print()
    print(f"probe {args.label}: {n / GB:.2f} GB in {args.dir}")
    for name, s, r in rows:
        print(f"{args.label:>8}  {name:<55} {s:>8.4f} s {r:>7.2f} GB/s")


if __name__ == "__main__":
    main()
