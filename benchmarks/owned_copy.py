"""What a rank's owned CPU tensors cost: copies out of memory already in place into new memory.

    python benchmarks/owned_copy.py [--tensors 8] [--mib 32] [--rounds 12] [--reps 3]

Each round copies ``--tensors`` tensors of ``--mib`` MiB from a warm source with
``streamer_client.delivery.copy_to_cpu`` (the path of a daemon rank's CPU tensors), into new
memory each round (the tensors of the round before are dropped first). Two ways, alternating:
the destinations advised for transparent huge pages before the copy (what ``copy_to_cpu`` does),
and not advised (the same copy, the advice skipped). Prints GB/s per repetition and the median,
and the host's THP setting. Needs the native copier.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import numpy as np

from streamer_client import copier, delivery


def _round(items, rounds: int) -> float:
    started = time.perf_counter()
    for _ in range(rounds):
        outs = delivery.copy_to_cpu(items, lambda i: RuntimeError(f"item {i}"))
        del outs
    return rounds * sum(view.nbytes for view, _, _ in items) / (time.perf_counter() - started) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tensors", type=int, default=8)
    parser.add_argument("--mib", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    if not copier.available():
        raise SystemExit("owned_copy: the native copier is not built")
    nbytes = args.mib * 1024 * 1024
    source = np.ones(nbytes * args.tensors, dtype=np.uint8)
    items = [(source[i * nbytes : (i + 1) * nbytes], "BF16", (nbytes // 2,)) for i in range(args.tensors)]
    advise = copier.advise_huge
    rates: dict[str, list[float]] = {"4 KiB pages (not advised)": [], "advised for huge pages": []}
    for _ in range(args.reps):
        for way in rates:
            copier.advise_huge = advise if way.startswith("advised") else (lambda address, size: False)
            try:
                rates[way].append(_round(items, args.rounds))
            finally:
                copier.advise_huge = advise
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    print(
        f"THP: {thp.read_text().strip() if thp.exists() else 'absent'}; copier threads: {copier.threads_for(1, len(os.sched_getaffinity(0)))}"
    )
    print(f"{args.tensors} x {args.mib} MiB per round, {args.rounds} rounds, new memory each round\n")
    print("| destination | GB/s per repetition | median |")
    print("| --- | --- | ---: |")
    for way, values in rates.items():
        print(f"| {way} | {', '.join(f'{v:.2f}' for v in values)} | {statistics.median(values):.2f} |")


if __name__ == "__main__":
    main()
