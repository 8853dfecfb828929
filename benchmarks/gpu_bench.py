"""Host -> GPU rates: the pinned-H2D ceiling, our shm -> CUDA copies, and end-to-end loads.

    python benchmarks/gpu_bench.py [--size-gb 4] [--reps 10] [--e2e-reps 3] [--ranks 2]

Rows (GB = 1e9 bytes; each row's rate is the median of its repetitions):

- ``ceiling``: one plain ``torch`` copy of the whole buffer from pinned host memory
  (``torch.empty(..., pin_memory=True)``) to the GPU, timed with CUDA events. What no
  host-to-device path can beat.
- ``shm->cuda pinned``: :class:`streamer_client._cuda.PinnedCopier` copying a ``/dev/shm``
  file mapped with ``mmap`` (source already in shared memory, as in daemon mode) into owned
  32 MiB bf16 tensors, the mapping registered once beforehand (its cost is printed apart);
  CUDA events on the copy stream around all copies of one pass, through the fence. The goal is
  >= 0.8 of the ceiling.
- ``shm->cuda pageable``: the same with registration off (what a copy costs unpinned).
- ``e2e``: ``streamer_client.load_state_dict(dir, device="cuda:0")`` of a random bf16
  checkpoint of the same size in a local directory whose files are in the page cache; wall
  time of the whole call plus ``torch.cuda.synchronize()`` (Run:ai start, catalog, reads,
  copies). ``budget=`` variants show the ring size's effect; ``-> cpu`` is the same load
  without a GPU, for reference (what the reads alone allow).
- with ``--ranks 2`` and two GPUs: the shm and e2e rows again with two processes, one per GPU,
  started together at a barrier each repetition; per-rank medians.
- with ``--retention SIZE``: a daemon that keeps the checkpoint resident (STREAMER_RETENTION_BUDGET);
  its first load (``cold``) reads storage, the following ones (``warm``) are served from the
  resident copy in shared memory: what a restarted engine sees.

Data is random (never zeros). Prints the machine, then the table last.

``--issue``: every loader side by side, each load the first of a fresh process (InstantTensor,
fastsafetensors, plain Run:ai, ours embedded and through a daemon): ``benchmarks/cold_start.py``,
which takes the arguments that follow ``--issue``.
"""

from __future__ import annotations

import argparse
import json
import mmap
import multiprocessing as mp
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
for path in (REPO / "client", REPO):  # run from a checkout
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from cold_start import write_checkpoint  # noqa: E402  (one checkpoint layout for both scripts)

import streamer_client  # noqa: E402
from streamer_client._cuda import PinnedCopier, address_of  # noqa: E402
from streamer_service.bench.sources import warm_page_cache  # noqa: E402
from streamer_service.daemon.server import ChildDaemon  # noqa: E402

GB = 1e9
MIB = 2**20
HIDDEN = 4096
MATRIX = HIDDEN * HIDDEN * 2  # one 32 MiB bf16 weight matrix
EMBED_ROWS = 40960  # 320 MiB bf16 embedding: larger than a 256 MiB ring slot


# --------------------------------------------------------------------------- data


def _random_gpu_bytes(nbytes: int, device: str, seed: int) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device, generator=g)


def make_shm_file(path: Path, source: torch.Tensor) -> None:
    """A file in shared memory holding ``source`` 's (CPU) bytes."""
    nbytes = source.numel()
    with open(path, "w+b") as f:
        f.truncate(nbytes)
        memory = mmap.mmap(f.fileno(), nbytes, flags=mmap.MAP_SHARED)
        view = np.frombuffer(memory, dtype=np.uint8)
        view[:] = source.numpy()
        del view
        memory.close()


def map_shm_file(path: Path) -> tuple[mmap.mmap, np.ndarray]:
    with open(path, "r+b") as f:
        memory = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED)
    return memory, np.frombuffer(memory, dtype=np.uint8)


# --------------------------------------------------------------------------- measurements


def ceiling(nbytes: int, device: str, reps: int) -> list[float]:
    """Plain torch: one pinned -> device copy of the whole buffer, CUDA events, GB/s per rep."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    src.copy_(_random_gpu_bytes(nbytes, device, 1).cpu())
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    stream = torch.cuda.Stream(device=device)
    rates = []
    for rep in range(reps + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
        end.synchronize()
        if rep:  # the first is a warm-up
            rates.append(nbytes / (start.elapsed_time(end) / 1e3) / GB)
    if not torch.equal(dst[:: 1 << 20].cpu(), src[:: 1 << 20]):
        raise SystemExit("ceiling copy is wrong")
    del src, dst
    return rates


def _layout(nbytes: int) -> list[tuple[int, int]]:
    """(offset, nbytes) of 32 MiB tensors covering the buffer (the last may be shorter)."""
    return [(o, min(MATRIX, nbytes - o)) for o in range(0, nbytes, MATRIX)]


def shm_to_cuda(array: np.ndarray, device: str, reps: int, pin: bool, barrier=None) -> tuple[list[float], float, dict]:
    """Our copier from a mapped shm file: GB/s per rep, registration seconds, copier stats."""
    nbytes = array.nbytes
    layout = _layout(nbytes)
    host = torch.from_numpy(array)
    with PinnedCopier(device, pin=pin) as copier:
        start = time.perf_counter()
        pinned = copier.register(*address_of(array))
        register_s = time.perf_counter() - start
        if pin and not pinned:
            raise SystemExit(f"registration failed: {copier.stats.fallback}")
        rates, check = [], None
        for rep in range(reps + 1):
            if barrier is not None:
                barrier.wait()
            torch.cuda.synchronize(device)
            start_ev, end_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start_ev.record(copier.stream)
            outs = [copier.copy(host[o : o + n], torch.uint8, (n,)) for o, n in layout]
            copier.fence()
            end_ev.record(copier.stream)
            end_ev.synchronize()
            if rep:
                rates.append(nbytes / (start_ev.elapsed_time(end_ev) / 1e3) / GB)
            check = outs
            del outs
        # Correctness of the last pass: every tensor equal to its source bytes (sampled per tensor).
        for (o, n), out in zip(layout, check):
            step = max(1, n // 4096)
            if not torch.equal(out[::step].cpu(), host[o : o + n : step]):
                raise SystemExit(f"shm->cuda copy wrong at offset {o}")
        stats = copier.stats
        info = {"pinned_bytes": stats.pinned_bytes, "pageable_bytes": stats.pageable_bytes, "copies": stats.copies}
        del check
    return rates, register_s, info


def e2e(
    directory: Path,
    device: str,
    reps: int,
    expected: int,
    cache_dir: Path,
    budget: str | None,
    barrier=None,
    *,
    rank: int = 0,
    world_size: int = 1,
    keep_first: bool = False,
) -> list[float]:
    """Wall time of load_state_dict(dir, device=...) incl. synchronize; GB/s per rep (after a warm-up,
    which ``keep_first`` reports too, as the first element).

    With ``STREAMER_SOCKET`` set (daemon rows) the ranks of one repetition share one session.
    """
    rates = []
    kwargs = {"device": device, "cache_dir": cache_dir, "rank": rank, "world_size": world_size}
    if budget:
        kwargs["budget"] = budget
    for rep in range(reps + 1):
        if barrier is not None:
            barrier.wait()
        start = time.perf_counter()
        state = streamer_client.load_state_dict(directory, session=f"bench-{os.getppid()}-{rep}", **kwargs)
        if device != "cpu":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - start
        got = sum(t.numel() * t.element_size() for t in state.values())
        if got != expected:
            raise SystemExit(f"e2e delivered {got} bytes, expected {expected}")
        if rep == 0 and device != "cpu":
            _spot_check(directory, state)
        del state
        if rep or keep_first:
            rates.append(expected / elapsed / GB)
    return rates


def _spot_check(directory: Path, state: dict[str, torch.Tensor]) -> None:
    """A few tensors against safetensors (the tests check every one)."""
    from safetensors import safe_open

    for path in sorted(directory.glob("*.safetensors"))[:2]:
        with safe_open(str(path), framework="pt") as f:
            for name in list(f.keys())[:3]:
                expected = f.get_tensor(name)
                got = state[name]
                if not torch.equal(got.reshape(-1).view(torch.uint8).cpu(), expected.reshape(-1).view(torch.uint8)):
                    raise SystemExit(f"e2e tensor {name} differs from safetensors")


# --------------------------------------------------------------------------- two ranks


def _rank_main(
    rank: int, kind: str, arg: str, reps: int, expected: int, cache_dir: str, barrier, results, env=None, world=2
) -> None:
    try:
        os.environ.update(env or {})
        device = f"cuda:{rank % torch.cuda.device_count()}"
        torch.cuda.set_device(device)
        if kind in ("daemon", "daemon-retained"):
            rates = e2e(Path(arg), device, reps, expected, Path(cache_dir), None, barrier=barrier, rank=rank,
                        world_size=world, keep_first=kind == "daemon-retained")  # fmt: skip
        elif kind == "shm":
            memory, array = map_shm_file(Path(arg))
            rates, register_s, _ = shm_to_cuda(array, device, reps, pin=True, barrier=barrier)
            del array
            memory.close()
        else:
            rates = e2e(Path(arg), device, reps, expected, Path(cache_dir) / f"rank{rank}", None, barrier=barrier)
        results.put((rank, rates, None))
    except BaseException as exc:  # report, don't hang the barrier's other party
        barrier.abort()
        results.put((rank, [], repr(exc)))


def two_ranks(kind: str, arg: str, reps: int, expected: int, cache_dir: Path, env=None, world: int = 2) -> list[list[float]]:
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(world), ctx.Queue()
    procs = [
        ctx.Process(target=_rank_main, args=(r, kind, arg, reps, expected, str(cache_dir), barrier, results, env, world))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    got = dict()
    for _ in procs:
        rank, rates, error = results.get(timeout=600)
        if error:
            raise SystemExit(f"rank {rank} ({kind}) failed: {error}")
        got[rank] = rates
    for p in procs:
        p.join()
    return [got[r] for r in range(world)]


# --------------------------------------------------------------------------- main


def machine() -> str:
    props = torch.cuda.get_device_properties(0)
    try:
        driver = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True, timeout=30
        ).stdout.split()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        driver = "?"
    return (
        f"{torch.cuda.device_count()} x {props.name} ({props.total_memory / 2**30:.0f} GiB), driver {driver}; "
        f"torch {torch.__version__} (CUDA {torch.version.cuda}); {os.cpu_count()} CPUs; "
        f"Python {platform.python_version()}; kernel {platform.release()}"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=4.0, help="buffer and checkpoint size (default 4)")
    parser.add_argument("--reps", type=int, default=10, help="repetitions of the copy rows (default 10)")
    parser.add_argument("--e2e-reps", type=int, default=3, help="repetitions of the end-to-end rows (default 3)")
    parser.add_argument("--ranks", type=int, default=1, choices=(1, 2), help="2: also two processes on two GPUs")
    parser.add_argument("--e2e-budgets", default="default,1GiB", help="comma-separated budgets for e2e rows")
    parser.add_argument("--shm-dir", type=Path, default=Path("/dev/shm"))
    parser.add_argument("--dir", type=Path, help="checkpoint directory (default: a temp dir)")
    parser.add_argument("--json", type=Path, help="also write every measurement here")
    parser.add_argument("--daemon-budget", default="4GiB", help="shm budget of the daemon rows' daemon")
    parser.add_argument("--retention", help="also cold vs warm rows with a daemon keeping this much resident, e.g. 16GiB")
    parser.add_argument("--issue", action="store_true",
                        help="every loader side by side, each load a fresh process's first: benchmarks/cold_start.py, "
                             "which takes the arguments that follow")  # fmt: skip
    argv = sys.argv[1:] if argv is None else argv
    if "--issue" in argv:
        import cold_start

        cold_start.main([a for a in argv if a != "--issue"])
        return
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("gpu_bench needs CUDA")
    device = "cuda:0"
    nbytes = int(args.size_gb * GB) // MIB * MIB
    print(machine(), flush=True)

    rows: list[tuple[str, list[float], str]] = []

    def add(name: str, rates: list[float], note: str = "") -> None:
        rows.append((name, rates, note))
        print(f"  {name}: median {statistics.median(rates):.2f} GB/s ({len(rates)} reps) {note}", flush=True)

    add("ceiling: torch pinned H2D", ceiling(nbytes, device, args.reps), "one copy")

    shm_path = args.shm_dir / f"streamer-gpu-bench-{os.getpid()}"
    with tempfile.TemporaryDirectory(prefix="gpu-bench-") as tmp:
        try:
            make_shm_file(shm_path, _random_gpu_bytes(nbytes, device, 2).cpu())
            memory, array = map_shm_file(shm_path)
            rates, register_s, info = shm_to_cuda(array, device, args.reps, pin=True)
            add(
                "shm->cuda pinned (PinnedCopier)",
                rates,
                f"32 MiB tensors; register once {register_s:.2f} s = {register_s / (nbytes / 2**30):.3f} s/GiB",
            )
            rates, _, info = shm_to_cuda(array, device, max(2, args.reps // 4), pin=False)
            add("shm->cuda pageable (pin=False)", rates, "reference")
            del array
            memory.close()
            if args.ranks == 2 and torch.cuda.device_count() >= 2:
                per_rank = two_ranks("shm", str(shm_path), args.reps, nbytes, Path(tmp))
                for r, rates in enumerate(per_rank):
                    add(f"shm->cuda pinned, 2 ranks at once: rank {r} -> cuda:{r}", rates, "same shm file")
        finally:
            shm_path.unlink(missing_ok=True)

        directory = args.dir or Path(tmp) / "ckpt"
        directory.mkdir(parents=True, exist_ok=True)
        total = write_checkpoint(directory, args.size_gb, device, embed_rows=EMBED_ROWS)
        warm_page_cache(directory)
        torch.cuda.empty_cache()
        cache_dir = Path(tmp) / "cache"
        for budget in [b.strip() for b in args.e2e_budgets.split(",") if b.strip()]:
            b = None if budget == "default" else budget
            label = "default budget 4GiB/256MiB slots" if b is None else f"budget {b}"
            add(
                f"e2e load_state_dict(dir, cuda:0), {label}",
                e2e(directory, device, args.e2e_reps, total, cache_dir, b),
                "page cache warm",
            )
        add(
            "e2e load_state_dict(dir, cpu) (reference)",
            e2e(directory, "cpu", args.e2e_reps, total, cache_dir, None),
            "no GPU: the read rate",
        )
        if args.ranks == 2 and torch.cuda.device_count() >= 2:
            per_rank = two_ranks("e2e", str(directory), args.e2e_reps, total, Path(tmp))
            for r, rates in enumerate(per_rank):
                add(f"e2e, 2 ranks at once: rank {r} -> cuda:{r}", rates, "each reads every byte")
        daemon = ChildDaemon(Path(tmp), args.daemon_budget, env={"STREAMER_CACHE_DIR": str(Path(tmp) / "daemon-cache")})
        try:
            for world in sorted({1, args.ranks}):
                before = daemon.stats().bytes_read
                per_rank = two_ranks(
                    "daemon", str(directory), args.e2e_reps, total, Path(tmp) / "rank-cache", daemon.env(), world
                )
                read = (daemon.stats().bytes_read - before) / (args.e2e_reps + 1)
                for r, rates in enumerate(per_rank):
                    add(
                        f"daemon e2e, {world} rank(s): rank {r} -> cuda:{r % torch.cuda.device_count()}",
                        rates,
                        f"node read {read / total:.3f}x the checkpoint per load",
                    )
        finally:
            daemon.close()
        for world in sorted({1, args.ranks}) if args.retention else ():
            root = Path(tmp) / f"retained-{world}"  # a fresh daemon: its first load is cold
            root.mkdir()
            env = {"STREAMER_CACHE_DIR": str(root / "cache"), "STREAMER_RETENTION_BUDGET": args.retention}
            daemon = ChildDaemon(root, args.daemon_budget, env=env)
            try:
                per_rank = two_ranks(
                    "daemon-retained", str(directory), args.e2e_reps, total, root / "rank-cache", daemon.env(), world
                )
                stats = daemon.stats()
            finally:
                daemon.close()
            for r, rates in enumerate(per_rank):
                gpu = f"cuda:{r % torch.cuda.device_count()}"
                add(f"daemon cold, retention on, {world} rank(s): rank {r} -> {gpu}", rates[:1], "first load: reads storage")
                add(
                    f"daemon warm from resident copy, {world} rank(s): rank {r} -> {gpu}",
                    rates[1:],
                    f"warm/cold time {rates[0] / statistics.median(rates[1:]):.3f}",
                )
            print(f"  retention, {world} rank(s): {stats.resident.resident_bytes_served / GB:.2f} GB served from memory, "
                  f"{stats.bytes_read / GB:.2f} GB read from storage", flush=True)  # fmt: skip

    ceiling_rate = statistics.median(rows[0][1])
    print()
    print(f"size {nbytes / GB:.2f} GB (shm buffer) / {total / GB:.2f} GB (checkpoint); GB = 1e9 bytes; medians")
    width = max(len(r[0]) for r in rows)
    print(f"{'path':<{width}}  {'GB/s':>6}  {'min':>6}  {'max':>6}  {'/ceiling':>8}")
    for name, rates, _ in rows:
        m = statistics.median(rates)
        print(f"{name:<{width}}  {m:>6.2f}  {min(rates):>6.2f}  {max(rates):>6.2f}  {m / ceiling_rate:>8.2f}")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "machine": machine(),
                    "bytes": nbytes,
                    "checkpoint_bytes": total,
                    "rows": [{"path": n, "gbps": r, "note": note} for n, r, note in rows],
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
