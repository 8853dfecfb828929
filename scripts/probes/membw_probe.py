"""How many bytes a host's memory moves while copies run side by side: the floor under a load
that copies every byte twice on the CPU (a daemon into its segments, a rank into its staging
ring) and once more by DMA.

    python scripts/probes/membw_probe.py [--gib 2] [--seconds 2]

Each row runs its parties at once, each in its own process, and prints each party's rate (GB =
1e9 bytes moved from source to destination; a CPU copy reads and writes every byte, so its
memory traffic is twice that) and the sum of their memory traffic:

- ``copy``: the native copier's pool (``streamer_client.copier``, its default threads) copying
  ``--gib`` GiB between two private buffers, faulted in before the clock, again and again for
  ``--seconds`` (every party of a row for the same span);
- ``shm``: the same, from a file on /dev/shm written before the clock and mapped anew each time
  (4 KiB pages faulted in by the copying threads, as a fresh rank's staging copy does; the
  mapping and the copy timed, not the unmapping); ``shm-populated``: its page tables
  filled first by ``MADV_POPULATE_READ`` on the calling thread (counted);
- ``dma``: host-to-device copies of 32 MiB from one page-locked buffer of ``--gib`` GiB (torch),
  where a GPU is present.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[2] / "client")]

GB = 1e9
GIB = 2**30
PIECE = 256 * 2**20


def _pieces(dst: int, src: int, nbytes: int) -> tuple[list[int], list[int], list[int]]:
    offsets = range(0, nbytes, PIECE)
    return [dst + o for o in offsets], [src + o for o in offsets], [min(PIECE, nbytes - o) for o in offsets]


def _copy(nbytes: int, seconds: float, barrier, shm: bool, populate: bool = False) -> float:
    from streamer_client import copier, host_memory
    from streamer_client.segments import populate_pages

    dst = host_memory.anonymous(nbytes)
    host_memory.fault_in([dst])
    src_path = Path(f"/dev/shm/membw-{os.getpid()}")
    src = host_memory.anonymous(nbytes)
    host_memory.fault_in([src])
    if shm:  # written, as a daemon's segment is before a rank maps it
        with open(src_path, "wb") as f:
            for at in range(0, nbytes, PIECE):
                f.write(memoryview(src[at : at + PIECE]))
    copier.copy([dst.ctypes.data + 2**20], [dst.ctypes.data], [2**20])  # the pool made before the clock
    barrier.wait()
    moved, busy, start = 0, 0.0, time.perf_counter()
    try:
        while time.perf_counter() - start < seconds:
            if shm:  # mapped anew each time: its pages are faulted in by the copying threads
                fd = os.open(src_path, os.O_RDONLY)
                began = time.perf_counter()
                address = copier.map_file(fd, nbytes)
                os.close(fd)
                if populate:
                    populate_pages(address, nbytes, writable=False)
                copier.copy(*_pieces(dst.ctypes.data, address, nbytes))
                busy += time.perf_counter() - began
                copier.unmap(address, nbytes)  # not timed: a rank keeps its mappings
            else:
                began = time.perf_counter()
                copier.copy(*_pieces(dst.ctypes.data, src.ctypes.data, nbytes))
                busy += time.perf_counter() - began
            moved += nbytes
    finally:
        src_path.unlink(missing_ok=True)
    return moved / busy / GB


def _dma(nbytes: int, seconds: float, barrier) -> float:
    import torch

    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    step = 32 * 2**20
    device[:step].copy_(host[:step], non_blocking=True)
    torch.cuda.synchronize()
    barrier.wait()
    moved, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for at in range(0, nbytes, step):
            device[at : at + step].copy_(host[at : at + step], non_blocking=True)
        torch.cuda.synchronize()
        moved += nbytes
    return moved / (time.perf_counter() - start) / GB


def _party(kind: str, nbytes: int, seconds: float, barrier, out) -> None:
    if kind == "dma":
        rate = _dma(nbytes, seconds, barrier)
    else:
        rate = _copy(nbytes, seconds, barrier, shm=kind.startswith("shm"), populate=kind == "shm-populated")
    out.put((kind, rate))


def run(parties: list[str], nbytes: int, seconds: float) -> list[tuple[str, float]]:
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(len(parties)), ctx.Queue()
    procs = [ctx.Process(target=_party, args=(kind, nbytes, seconds, barrier, out)) for kind in parties]
    for p in procs:
        p.start()
    results = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--seconds", type=float, default=2.0)
    args = parser.parse_args()
    nbytes = int(args.gib * GIB) // PIECE * PIECE
    gpu = False
    try:
        import torch

        gpu = torch.cuda.is_available()
    except ImportError:
        pass
    rows = [["copy"], ["copy", "copy"], ["copy", "copy", "copy"], ["shm"], ["shm-populated"], ["shm", "copy"]]
    if gpu:
        rows += [["dma"], ["dma", "copy"], ["dma", "shm"], ["dma", "copy", "copy"], ["dma", "shm", "copy"]]
    print(f"{os.cpu_count()} CPUs; {nbytes / GIB:.2f} GiB per party; {args.seconds:g} s per row")
    print(f"{'parties (at once, one process each)':<36} {'each party GB/s':<32} {'memory traffic GB/s':>20}")
    for parties in rows:
        results = run(parties, nbytes, args.seconds)
        traffic = sum(rate * (1 if kind == "dma" else 2) for kind, rate in results)
        each = ", ".join(f"{kind} {rate:.1f}" for kind, rate in results)
        print(f"{' + '.join(parties):<36} {each:<32} {traffic:>20.1f}", flush=True)


if __name__ == "__main__":
    main()
