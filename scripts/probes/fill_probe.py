"""How long the daemon takes to make one large segment (an oversized tensor's), and a ring slot's:
``shm.Segment`` made by the thread that asks for it, zero-filled by ``posix_fallocate`` and then
mapped (one thread), or faulted in by 2, 4 (``shm.FILL_THREADS`` on 4 CPUs or more) or 8 threads side
by side (a share each).
Each way ROUNDS times per size, alternating, in the shm dir given (default /dev/shm); a table of
the medians.

    python3 scripts/probes/fill_probe.py [SHM_DIR] [ROUNDS]
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from streamer_service.daemon import shm
from streamer_service.daemon.pages import detect_pages

MIB = 2**20
SIZES = (256 * MIB, 1024 * MIB, 2048 * MIB)
ONE_THREAD = 1 << 62  # a share no segment reaches: posix_fallocate, then mapped


def made_in(directory: Path, nbytes: int, share: int, threads: int) -> float:
    if threads != shm.FILL_THREADS:
        shm.FILL_THREADS, shm._FILLERS = threads, None  # a pool of as many threads
    shm.FILL_SHARE = share
    started = time.perf_counter()
    segment = shm.Segment("probe", directory / "probe", nbytes, pages=detect_pages(directory))
    took = time.perf_counter() - started
    segment.close()
    return took


def main() -> None:
    where = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("/dev/shm")
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    share = shm.FILL_SHARE
    ways = {"posix_fallocate, then mapped (one thread)": (ONE_THREAD, 1)}
    ways.update({f"filled by up to {n} threads": (min(share, SIZES[1] // n), n) for n in (2, 4, 8) if n <= (os.cpu_count() or 1)})
    times: dict[tuple[str, int], list[float]] = {}
    with tempfile.TemporaryDirectory(dir=where) as d:
        for _ in range(rounds):
            for nbytes in SIZES:
                for way, (share, threads) in ways.items():
                    times.setdefault((way, nbytes), []).append(made_in(Path(d), nbytes, share, threads))
    print(f"{os.cpu_count()} CPUs, {where} ({detect_pages(where).size // 1024} KiB pages), medians of {rounds}")
    print(f"| way | {' | '.join(f'{n // MIB} MiB' for n in SIZES)} |")
    print(f"| --- | {' | '.join('---:' for _ in SIZES)} |")
    for way in ways:
        cells = [times[(way, n)] for n in SIZES]
        print(
            f"| {way} | {' | '.join(f'{statistics.median(c):.3f} s ({n / MIB / 1024 / statistics.median(c):.1f} GiB/s)' for c, n in zip(cells, SIZES))} |"
        )


if __name__ == "__main__":
    main()
