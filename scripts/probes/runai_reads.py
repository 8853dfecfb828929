"""Run:ai's native reader reading one checkpoint from SeaweedFS LOADS times in one process: whether
a process's first load is slower than its next, and the minor page faults each load costs the
process (Run:ai's S3 client receives into buffers it allocates for each reader). The checkpoint
(SIZE_MB of the sample) is read in 64 MiB ranges into one buffer whose pages are populated first,
as a daemon's segments are. Needs `weed` on PATH (benchmarks/device/ingest.sh says where from).

    python3 scripts/probes/runai_reads.py WORK [SIZE_MB] [LOADS]
    GLIBC_TUNABLES=glibc.malloc.hugetlb=1 python3 scripts/probes/runai_reads.py WORK   # malloc's chunks on THP
    REUSE=1 python3 scripts/probes/runai_reads.py WORK     # one reader (Run:ai streamer) for every load
"""

from __future__ import annotations

import mmap
import os
import sys
import time
from pathlib import Path

import numpy as np

from streamer_service.bench.sources import open_source
from streamer_service.readers.base import FileReads, ReadRange
from streamer_service.readers.runai import NativeReader
from streamer_service.sample import build_sample

PIECE = 64 * 2**20


def minor_faults() -> int:
    return int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[7])


def rss() -> int:
    return next(
        int(line.split()[1]) * 1024 for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("VmRSS:")
    )


def main() -> None:
    work = Path(sys.argv[1])
    size_mb = int(sys.argv[2]) if len(sys.argv) > 2 else 1024
    loads = int(sys.argv[3]) if len(sys.argv) > 3 else 4
    work.mkdir(parents=True, exist_ok=True)
    checkpoint = work / "checkpoint"
    if not checkpoint.exists():
        build_sample(checkpoint, size_mb=size_mb)
    source = open_source("seaweed", work, checkpoint)
    try:
        os.environ.update(source.env)
        files = sorted(p for p in checkpoint.iterdir() if p.suffix == ".safetensors")
        total = sum(p.stat().st_size for p in files)
        buffer = mmap.mmap(-1, total)
        pages = np.frombuffer(buffer, dtype=np.uint8)
        pages[:: mmap.PAGESIZE] = 1
        base, at, reads = pages.ctypes.data, 0, []
        for path in files:
            size, ranges = path.stat().st_size, []
            for offset in range(0, size, PIECE):
                nbytes = min(PIECE, size - offset)
                ranges.append(ReadRange(offset, nbytes, base + at))
                at += nbytes
            reads.append(FileReads(f"{source.uri}/{path.name}", tuple(ranges)))
        print(
            f"{total / 1e9:.2f} GB in {sum(len(r.ranges) for r in reads)} ranges; GLIBC_TUNABLES={os.environ.get('GLIBC_TUNABLES', '')!r}"
        )
        reuse = os.environ.get("REUSE") == "1"
        kept = None
        for load in range(loads):
            faults, started = minor_faults(), time.perf_counter()
            reader = kept or NativeReader()
            if kept is None:
                reader.start()
            if reuse:
                kept = reader
            reader.submit(reads, buffer)
            first = None
            for answer in iter(reader.answer, None):
                if answer.error is not None:
                    raise answer.error
                first = first or time.perf_counter()
            done = time.perf_counter()
            if not reuse or load == loads - 1:
                reader.close()
            print(f"load {load}: first answer after {first - started:.3f} s, all after {done - started:.3f} s "
                  f"({total / (done - started) / 1e9:.2f} GB/s), closed in {time.perf_counter() - done:.3f} s, "
                  f"{minor_faults() - faults} minor faults, RSS {rss() / 1e9:.2f} GB", flush=True)  # fmt: skip
    finally:
        source.close()


if __name__ == "__main__":
    main()
