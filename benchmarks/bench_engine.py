"""Embedded engine vs plain Run:ai SafetensorsStreamer on the same local checkpoint.

    .venv/bin/python benchmarks/bench_engine.py [--size-gb 1.0] [--reps 3] [--dir DIR]

Writes a random bf16 checkpoint (HF-style shards + index) into a temp dir (or
``--dir``), warms the page cache by reading every shard once, then runs each
contender ``--reps`` times, interleaved (A B C D A B C D ...) so drift in the
machine hits all of them alike, and prints medians. Every run consumes every
tensor; GB/s is checkpoint tensor bytes / wall time of the whole load
(including Run:ai start-up and header reads, which each side does its own way).

Contenders:

- ``runai``: ``SafetensorsStreamer`` with its defaults (owned tensors, its
  default filesystem strategy, which uses O_DIRECT and bypasses the page cache);
- ``runai buffered``: the same with ``RUNAI_STREAMER_FS_STRATEGY`` set to the
  buffered strategy the engine uses, so the reader is like for like;
- ``engine``: ``EmbeddedEngine`` in the default safe mode (one copy per tensor);
- ``engine borrowed``: ``EmbeddedEngine`` with zero-copy borrowed views.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from streamer_service.bench.sources import warm_page_cache  # noqa: E402
from streamer_service.checkpoint.catalog import build_catalog  # noqa: E402
from streamer_service.embedded.engine import EmbeddedEngine, EngineConfig  # noqa: E402
from streamer_service.readers.runai import BUFFERED_FS_STRATEGY  # noqa: E402
from streamer_service.settings import Settings  # noqa: E402
from streamer_service.storage import open_storage  # noqa: E402
from streamer_service.uri import parse_uri  # noqa: E402

HIDDEN = 4096
MATRIX_BYTES = HIDDEN * HIDDEN * 2  # one bf16 weight matrix: 32 MiB
MATRICES_PER_LAYER = 4
N_SHARDS = 4

Contender = Callable[[Path], int]  # loads the checkpoint in a directory; returns the tensor bytes it saw


# --------------------------------------------------------------------------- checkpoint


def _random_bf16(*shape: int) -> torch.Tensor:
    # Random bits viewed as bf16: fast to make, and the loaders move bytes, not numbers.
    return torch.empty(*shape, dtype=torch.int16).random_().view(torch.bfloat16)


def write_checkpoint(directory: Path, size_gb: float) -> int:
    """Layers of four 4096x4096 bf16 matrices plus two norms, in shards; return the tensor bytes."""
    layers = max(1, round(size_gb * 1e9 / (MATRICES_PER_LAYER * MATRIX_BYTES)))
    names = [
        f"model.layers.{i}.{part}"
        for i in range(layers)
        for part in (
            "attn.qkv.weight",
            "attn.o.weight",
            "mlp.up.weight",
            "mlp.down.weight",
            "input_norm.weight",
            "post_norm.weight",
        )
    ]
    per_shard = -(-len(names) // N_SHARDS)
    weight_map: dict[str, str] = {}
    total = 0
    for s in range(N_SHARDS):
        shard = f"model-{s + 1:05d}-of-{N_SHARDS:05d}.safetensors"
        chunk = names[s * per_shard : (s + 1) * per_shard]
        tensors = {n: _random_bf16(*_shape(n)) for n in chunk}
        save_file(tensors, str(directory / shard))
        total += sum(t.numel() * 2 for t in tensors.values())
        weight_map.update({n: shard for n in chunk})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return total


def _shape(name: str) -> tuple[int, ...]:
    return (HIDDEN,) if name.endswith("norm.weight") else (HIDDEN, HIDDEN)


# --------------------------------------------------------------------------- contenders


@contextmanager
def _env(name: str, value: str):
    # Benchmark-only: Run:ai's public API offers no other way to choose its filesystem strategy.
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


def run_runai(directory: Path) -> int:
    from runai_model_streamer import SafetensorsStreamer

    paths = [str(p) for p in sorted(directory.glob("*.safetensors"))]
    nbytes = 0
    with SafetensorsStreamer() as streamer:
        streamer.stream_files(paths)
        for _, tensor in streamer.get_tensors():
            nbytes += tensor.numel() * tensor.element_size()
    return nbytes


def run_runai_buffered(directory: Path) -> int:
    with _env("RUNAI_STREAMER_FS_STRATEGY", BUFFERED_FS_STRATEGY):
        return run_runai(directory)


def make_engine_run(config: EngineConfig, borrowed: bool) -> Contender:
    def run(directory: Path) -> int:
        uri = parse_uri(directory)
        catalog = build_catalog(open_storage(uri, Settings()))
        engine = EmbeddedEngine(uri, catalog, config)
        nbytes = 0
        for _, tensor in engine.stream(engine.plan(), borrowed=borrowed):
            nbytes += tensor.numel() * tensor.element_size()
        return nbytes

    return run


# --------------------------------------------------------------------------- main


def measure(contenders: dict[str, Contender], directory: Path, expected: int, reps: int) -> dict[str, list[float]]:
    rates: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(reps):
        for name, run in contenders.items():
            start = time.perf_counter()
            nbytes = run(directory)
            elapsed = time.perf_counter() - start
            if nbytes != expected:
                raise SystemExit(f"{name} delivered {nbytes} bytes, expected {expected}")
            rates[name].append(nbytes / elapsed / 1e9)
    return rates


def print_table(rates: dict[str, list[float]], baseline: str, total: int, config: EngineConfig) -> None:
    base = statistics.median(rates[baseline])
    print(
        f"checkpoint: {total / 1e9:.2f} GB bf16, page cache warm; engine budget {config.budget / 2**20:.0f} MiB, "
        f"slot {config.slot_size / 2**20:.0f} MiB; medians of {len(rates[baseline])}"
    )
    print(f"{'contender':<18} {'GB/s':>7} {'min':>7} {'max':>7} {'vs runai':>9}")
    for name, values in rates.items():
        median = statistics.median(values)
        print(f"{name:<18} {median:>7.2f} {min(values):>7.2f} {max(values):>7.2f} {median / base:>8.2f}x")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=1.0)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dir", type=Path, help="write the checkpoint here instead of a temp dir")
    parser.add_argument("--budget-mib", type=int, help="engine buffer budget (default: settings)")
    parser.add_argument("--slot-mib", type=int, help="engine slot size (default: settings)")
    args = parser.parse_args(argv)

    config = EngineConfig.from_settings(Settings())
    if args.budget_mib or args.slot_mib:
        budget = args.budget_mib * 2**20 if args.budget_mib else config.budget
        slot = args.slot_mib * 2**20 if args.slot_mib else config.slot_size
        config = EngineConfig(budget=budget, slot_size=min(slot, budget))

    with tempfile.TemporaryDirectory(prefix="bench-engine-") as tmp:
        directory = args.dir or Path(tmp)
        directory.mkdir(parents=True, exist_ok=True)
        total = write_checkpoint(directory, args.size_gb)
        warm_page_cache(directory)
        contenders = {
            "runai": run_runai,
            "runai buffered": run_runai_buffered,
            "engine": make_engine_run(config, borrowed=False),
            "engine borrowed": make_engine_run(config, borrowed=True),
        }
        rates = measure(contenders, directory, total, args.reps)
    print_table(rates, "runai", total, config)


if __name__ == "__main__":
    main()
