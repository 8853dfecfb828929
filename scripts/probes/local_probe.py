"""Where an embedded load from a local directory on tmpfs loses against InstantTensor.

    python scripts/probes/local_probe.py --dir DIR [--reps 3]

``DIR``: a safetensors checkpoint (``gpu_bench.py --issue`` writes one) on tmpfs or in the page
cache. Every row moves every tensor of it to cuda:0 (or reads it into host memory) and prints
seconds and GB/s (GB = 1e9 bytes, median of ``--reps``):

- ``instanttensor``: InstantTensor 0.2.2 ``safe_open(files, device=0).tensors()`` (reference);
- ``embedded cuda``: ``streamer_client.load_state_dict(DIR, device="cuda:0")``; one more load under
  ``cProfile`` prints where the loading thread spends its time;
- ``embedded cpu borrowed``: the same reads into the engine's reused ring slots, no GPU, no copy
  (Run:ai's read rate, what bounds the cuda row), at Run:ai's default concurrency and at 32;
- ``preadv T threads``: T Python threads ``os.preadv`` the files in 16 MiB pieces into a ring of 4
  pinned 256 MiB buffers, each copied to the GPU once filled (what Run:ai's sync_buffered reader
  does, without Run:ai);
- ``mmap+register``: each file mapped, ``cudaHostRegister`` ed and copied in 32 MiB pieces, the next
  file registered on a thread while the current one's copies run (mapping local files directly).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import mmap
import os
import pstats
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[2]
for path in (REPO / "client", REPO):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

GB = 1e9
MIB = 2**20
RO = 0x01 | 0x08  # cudaHostRegisterPortable | cudaHostRegisterReadOnly


def _files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.safetensors"))


def _timed(fn, reps: int) -> tuple[float, int]:
    walls, nbytes = [], 0
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        nbytes = fn()
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - start)
    return statistics.median(walls), nbytes


def instanttensor(directory: Path) -> int:
    from instanttensor import safe_open

    out = {}
    with safe_open([str(p) for p in _files(directory)], framework="pt", device=0) as f:
        for name, tensor in f.tensors():
            out[name] = tensor.clone()
    return sum(t.numel() * t.element_size() for t in out.values())


def embedded(directory: Path, device: str = "cuda:0", borrowed: bool = False) -> int:
    import streamer_client

    if borrowed:
        return sum(t.numel() * t.element_size() for _, t in streamer_client.stream(str(directory), borrowed=True))
    state = streamer_client.load_state_dict(str(directory), device=device)
    return sum(t.numel() * t.element_size() for t in state.values())


def preadv_threads(directory: Path, threads: int, piece: int = 16 * MIB, slot: int = 256 * MIB) -> int:
    ring = [torch.empty(slot, dtype=torch.uint8, pin_memory=True) for _ in range(4)]
    events = [None] * len(ring)
    stream = torch.cuda.Stream()
    out = []
    total = 0
    with ThreadPoolExecutor(threads) as pool:
        fds = [os.open(p, os.O_RDONLY) for p in _files(directory)]
        try:
            pieces = [(fd, o, min(slot, os.fstat(fd).st_size - o)) for fd in fds for o in range(0, os.fstat(fd).st_size, slot)]
            for i, (fd, offset, nbytes) in enumerate(pieces):
                k = i % len(ring)
                if events[k] is not None:
                    events[k].synchronize()
                view = memoryview(ring[k].numpy())
                jobs = [pool.submit(os.preadv, fd, [view[o : o + min(piece, nbytes - o)]], offset + o)
                        for o in range(0, nbytes, piece)]  # fmt: skip
                for job in jobs:
                    job.result()
                dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
                with torch.cuda.stream(stream):
                    dst.copy_(ring[k][:nbytes], non_blocking=True)
                    events[k] = torch.cuda.Event()
                    events[k].record(stream)
                out.append(dst)
                total += nbytes
        finally:
            for fd in fds:
                os.close(fd)
    stream.synchronize()
    return total


def mmap_register(directory: Path) -> int:
    rt = torch.cuda.cudart()
    stream = torch.cuda.Stream()
    maps = []

    def open_and_register(path: Path):
        fd = os.open(path, os.O_RDONLY)
        size = os.fstat(fd).st_size
        m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        os.close(fd)
        array = np.frombuffer(m, dtype=np.uint8)
        assert int(rt.cudaHostRegister(array.ctypes.data, size, RO)) == 0
        return m, array

    out, total = [], 0
    with ThreadPoolExecutor(1) as pool:
        files = _files(directory)
        pending = pool.submit(open_and_register, files[0])
        for i in range(len(files)):
            m, array = pending.result()
            if i + 1 < len(files):
                pending = pool.submit(open_and_register, files[i + 1])
            host = torch.from_numpy(array)
            with torch.cuda.stream(stream):
                for o in range(0, array.nbytes, 32 * MIB):
                    n = min(32 * MIB, array.nbytes - o)
                    dst = torch.empty(n, dtype=torch.uint8, device="cuda")
                    dst.copy_(host[o : o + n], non_blocking=True)
                    out.append(dst)
            total += array.nbytes
            maps.append((m, array))
    stream.synchronize()
    for m, array in maps:
        rt.cudaHostUnregister(array.ctypes.data)
    return total


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    torch.zeros(1, device="cuda")
    rows = []

    def row(name: str, fn, reps: int = args.reps) -> None:
        try:
            fn()  # warm-up
            wall, nbytes = _timed(fn, reps)
        except Exception as exc:  # noqa: BLE001 - one failed row must not lose the others
            print(f"  {name}: failed: {exc!r}", flush=True)
            return
        rows.append((name, wall, nbytes / wall / GB))
        print(f"  {name}: {wall:.3f} s, {nbytes / wall / GB:.2f} GB/s", flush=True)

    row("instanttensor", lambda: instanttensor(args.dir))
    row("embedded cuda", lambda: embedded(args.dir))
    profile = cProfile.Profile()
    profile.runcall(embedded, args.dir)
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(14)
    print("embedded cuda under cProfile, by own time:\n" + "\n".join(text.getvalue().splitlines()[-22:]), flush=True)
    row("embedded cpu borrowed (Run:ai default concurrency)", lambda: embedded(args.dir, borrowed=True))
    os.environ["RUNAI_STREAMER_CONCURRENCY"] = "32"
    row("embedded cpu borrowed (Run:ai concurrency 32)", lambda: embedded(args.dir, borrowed=True))
    row("embedded cuda (Run:ai concurrency 32)", lambda: embedded(args.dir))
    del os.environ["RUNAI_STREAMER_CONCURRENCY"]
    for threads in (8, 16):
        row(f"preadv {threads} threads -> 4 x 256 MiB pinned -> cuda", lambda t=threads: preadv_threads(args.dir, t))
    row("mmap+register each file, next registered while copying", lambda: mmap_register(args.dir))
    print()
    print(f"{'row':<62}{'s':>8}{'GB/s':>8}")
    for name, wall, rate in rows:
        print(f"{name:<62}{wall:>8.3f}{rate:>8.2f}")


if __name__ == "__main__":
    main()
