"""Per-tensor records at a large checkpoint's scale: making 100,000 ``TensorInfo`` (what reading
the headers makes, one per tensor) and planning them into 256 MiB batches (a ``Placement`` and a
``FileRange`` per tensor), medians of 5, in one process. Another checkout's code by PYTHONPATH:

    python scripts/probes/plan_probe.py this
    PYTHONPATH=/tmp/base:/tmp/base/client python scripts/probes/plan_probe.py base
"""

from __future__ import annotations

import statistics
import sys
import time

from streamer_service.checkpoint.header import TensorInfo
from streamer_service.checkpoint.plan import build_plan

TENSORS = 100_000
SLOT = 256 << 20


def tensors() -> list[TensorInfo]:
    out, offset = [], 0
    for i in range(TENSORS):
        nbytes = 4096 * (1 + i % 64)
        out.append(
            TensorInfo(
                f"model.layers.{i // 16}.w{i % 16}", "BF16", (nbytes // 2,), f"model-{i // 5000:05d}.safetensors", offset, nbytes
            )
        )
        offset += nbytes
    return out


def main() -> None:
    made, planned = [], []
    for _ in range(5):
        started = time.perf_counter()
        catalog = tensors()
        made.append(time.perf_counter() - started)
        started = time.perf_counter()
        plan = build_plan(catalog, SLOT)
        planned.append(time.perf_counter() - started)
    label = sys.argv[1] if len(sys.argv) > 1 else "this"
    print(
        f"| {label} | {TENSORS} | {statistics.median(made) * 1e3:.0f} ms | {statistics.median(planned) * 1e3:.0f} ms ({len(plan.batches)} batches) |"
    )


if __name__ == "__main__":
    main()
