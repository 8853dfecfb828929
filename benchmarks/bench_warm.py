"""Warm restart: reloading a checkpoint from the daemon's resident copy vs loading it from storage.

    python benchmarks/bench_warm.py [--source local|seaweed] [--size-gb 2] [--ranks 2] [--reps 3] [--device cpu]
    python benchmarks/bench_warm.py --first-load [--baseline CHECKOUT] [--gap 5] [--budget 1GiB] ...

``--first-load``: a fresh daemon's first load against its second, with retention off (the second
load takes the first one's idle ring segments) and on (the second is served from the resident
copy), each on a fresh daemon, ``--gap`` seconds after it started (a sidecar's first load comes
after the engine's own start-up); with ``--baseline`` the same rows for the daemon of another
checkout (``git worktree add /tmp/base main``), in the same run, on the same page cache.

Each repetition starts a fresh daemon with a retention budget larger than the checkpoint, then
runs the same N rank processes twice:

- ``cold``: the first load of the checkpoint (a new session key): every byte from storage once
  for the node, through the ring, kept resident as it arrives;
- ``warm``: the same ranks load it again under another session key (what a restarted or
  re-launched engine does): served from the resident copy after one listing of the prefix.

Timing: the ranks import torch and the client, meet at a barrier, then each times its
``streamer_client.stream(...)`` loop (safe tensors, or ``--borrowed`` zero-copy views);
a load's wall time is the last rank's end minus the first rank's start (one clock: same host).
Bytes from storage, counted outside our code: for SeaweedFS its own counter of bytes sent
(``streamer-service bench``'s source, started here as a child process on loopback), for a local
directory what the daemon process read according to the kernel (``/proc/<pid>/io`` ``rchar``);
the daemon's own count is printed beside them. Each rank checks the byte count of what it
received and spot-checks tensors against ``safetensors``.

Selections are TP-like (every non-expert tensor, plus every N-th expert), as in the demo. The
local directory is in the page cache: the hardest case for a warm/cold ratio, since a cold load
from the page cache is already fast.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import torch  # noqa: E402
from gpu_bench import GB, write_checkpoint  # noqa: E402 - also puts the checkout on sys.path

from streamer_service.bench.sources import SOURCES, open_source  # noqa: E402
from streamer_service.daemon.server import ChildDaemon  # noqa: E402
from streamer_service.sample import rank_selection  # noqa: E402


def _rank_main(rank: int, world: int, uri: str, truth: str, keys: list[str], device: str, borrowed: bool,
               env: dict, barrier, results) -> None:  # fmt: skip
    try:
        os.environ.update(env)
        from safetensors import safe_open

        import streamer_client

        names = _names(Path(truth))
        select = rank_selection(list(names), rank, world)
        expected = sum(names[n] for n in select)
        for key in keys:
            barrier.wait()
            start = time.time()
            got, check = 0, {}
            for name, tensor in streamer_client.stream(uri, select=select, rank=rank, world_size=world,
                                                       session=key, device=device, borrowed=borrowed):  # fmt: skip
                got += tensor.numel() * tensor.element_size()
                if len(check) < 3 and tensor.numel():
                    check[name] = tensor.to("cpu", copy=True)
            if device != "cpu":
                torch.cuda.synchronize(device)
            end = time.time()
            if got != expected:
                raise RuntimeError(f"rank {rank} got {got} bytes, expected {expected}")
            index = _index(Path(truth))
            for name, tensor in check.items():
                with safe_open(str(Path(truth) / index[name]), framework="pt") as f:
                    want = f.get_tensor(name)  # random bytes: compare bytes (NaN != NaN)
                    if not torch.equal(want.reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)):
                        raise RuntimeError(f"rank {rank}: {name} differs from safetensors")
            results.put((rank, key, start, end, got, None))
    except BaseException as exc:  # report, don't hang the barrier's other parties
        barrier.abort()
        results.put((rank, None, 0.0, 0.0, 0, repr(exc)))


def _index(directory: Path) -> dict[str, str]:
    import json

    return json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]


def _names(directory: Path) -> dict[str, int]:
    """Tensor name -> nbytes, in checkpoint order."""
    from streamer_service.checkpoint.catalog import build_catalog
    from streamer_service.settings import Settings
    from streamer_service.storage import open_storage
    from streamer_service.uri import parse_uri

    return {t.name: t.nbytes for t in build_catalog(open_storage(parse_uri(str(directory)), Settings())).tensors}


def _rchar(pid: int) -> int:
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise RuntimeError("no rchar")


def one_rep(rep, source, truth: Path, world: int, device: str, borrowed: bool, retention: str, tmp: Path,
            budget: str = "1GiB", daemon_env: dict | None = None, gap: float = 0.0) -> dict:  # fmt: skip
    """A fresh daemon (``daemon_env`` on top); ``gap`` s later a cold then a warm load by the same
    ``world`` rank processes."""
    root = tmp / f"rep{rep}"
    root.mkdir()
    uri = source.uri
    env = {**source.env, "STREAMER_RETENTION_BUDGET": retention, "STREAMER_CACHE_DIR": str(root / "cache"), **(daemon_env or {})}
    daemon = ChildDaemon(root, budget, env=env)
    time.sleep(gap)
    try:
        keys = [f"cold-{rep}", f"warm-{rep}"]
        ctx = mp.get_context("spawn")
        barrier, results = ctx.Barrier(world), ctx.Queue()
        procs = [
            ctx.Process(
                target=_rank_main,
                args=(r, world, uri, str(truth), keys, device, borrowed, {**os.environ, **daemon.env()}, barrier, results),
            )  # fmt: skip
            for r in range(world)
        ]
        for p in procs:
            p.start()
        row: dict = {}

        def served() -> int:  # bytes the storage sent: its own count, or the daemon's reads (kernel)
            counted = source.bytes_served()
            return counted if counted is not None else _rchar(daemon.proc.pid)

        before_read, before_served = daemon.stats().bytes_read, served()
        got: dict[str, list] = {k: [] for k in keys}
        for _ in range(world * len(keys)):
            rank, key, start, end, nbytes, error = results.get(timeout=1800)
            if error:
                raise SystemExit(f"rank {rank} failed: {error}")
            got[key].append((start, end, nbytes))
            if len(got[key]) == world:
                stats = daemon.stats()
                now_served = served()
                row[key.split("-")[0]] = {
                    "seconds": max(e for _, e, _ in got[key]) - min(s for s, _, _ in got[key]),
                    "delivered": sum(n for _, _, n in got[key]),
                    "daemon_count": stats.bytes_read - before_read,
                    "storage_bytes": now_served - before_served,
                }
                before_read, before_served = stats.bytes_read, now_served
        for p in procs:
            p.join()
        row["resident_bytes"] = daemon.stats().resident.resident_bytes
        return row
    finally:
        daemon.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=2.0, help="checkpoint size (default 2)")
    parser.add_argument("--ranks", type=int, default=2, help="rank processes (default 2)")
    parser.add_argument("--reps", type=int, default=3, help="repetitions, each on a fresh daemon (default 3)")
    parser.add_argument(
        "--source",
        default="local",
        choices=[s for s in SOURCES if s != "moto"],
        help="local dir (page cache) or a SeaweedFS S3 server started here (default local)",
    )
    parser.add_argument("--dir", type=Path, help="checkpoint directory (default: written to a temp dir)")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda: rank r uses cuda:r")
    parser.add_argument("--borrowed", action="store_true", help="zero-copy CPU views instead of safe copies")
    parser.add_argument("--first-load", action="store_true", help="first vs second load of a fresh daemon, retention off and on")
    parser.add_argument("--baseline", type=Path, help="--first-load: also the daemon of this checkout (before/after)")
    parser.add_argument("--gap", type=float, default=5.0, help="--first-load: seconds from the daemon's start to the first load")
    parser.add_argument("--budget", default="1GiB", help="daemon --shm-budget (default 1GiB)")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="bench-warm-") as tmp_name:
        tmp = Path(tmp_name)
        truth = args.dir or tmp / "ckpt"
        if not (truth / "model.safetensors.index.json").exists():
            truth.mkdir(parents=True, exist_ok=True)
            write_checkpoint(truth, args.size_gb, "cpu")
        total = sum(_names(truth).values())
        retention = str(int(total * 1.25) + 2**30)
        device = args.device
        source = open_source(args.source, tmp / "source", truth)  # the local one warms the page cache
        try:
            print(f"{os.cpu_count()} CPUs; torch {torch.__version__}; checkpoint {total / GB:.2f} GB, {source.describe()}; "
                  f"{args.ranks} ranks, TP-like selections, {'borrowed views' if args.borrowed else 'safe copies'} on {device}; "
                  f"load average {os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip
            if args.first_load:
                return first_load_table(args, source, truth, total, retention, tmp)
            rows = []
            for rep in range(args.reps):
                row = one_rep(rep, source, truth, args.ranks, device, args.borrowed, retention, tmp, args.budget)
                rows.append(row)
                print(f"  rep {rep}: cold {row['cold']['seconds']:.2f} s, warm {row['warm']['seconds']:.2f} s, "
                      f"warm storage bytes {row['warm']['storage_bytes']}", flush=True)  # fmt: skip
        finally:
            source.close()

    def med(phase: str, field: str) -> float:
        return statistics.median(r[phase][field] for r in rows)

    print()
    print(f"{'load':<6} {'seconds':>8} {'min':>6} {'max':>6} {'GB/s':>6} {'storage GB':>10} {'daemon count GB':>15}")
    for phase in ("cold", "warm"):
        secs = [r[phase]["seconds"] for r in rows]
        print(f"{phase:<6} {med(phase, 'seconds'):>8.2f} {min(secs):>6.2f} {max(secs):>6.2f} "
              f"{med(phase, 'delivered') / med(phase, 'seconds') / GB:>6.2f} {med(phase, 'storage_bytes') / GB:>10.3f} "
              f"{med(phase, 'daemon_count') / GB:>15.3f}")  # fmt: skip
    ratios = [r["warm"]["seconds"] / r["cold"]["seconds"] for r in rows]
    print(f"warm / cold time: median {statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f}); "
          f"GB/s counts bytes delivered to all ranks; GB = 1e9 bytes")  # fmt: skip


def first_load_table(args, source, truth: Path, total: int, retention: str, tmp: Path) -> None:
    """Rows of (daemon code, retention): first and second load of a fresh daemon, medians of ``--reps``."""

    def code_of(checkout: Path) -> dict:  # PYTHONSAFEPATH: not the cwd's checkout first (``python -m``)
        return {"PYTHONPATH": f"{checkout}:{checkout / 'client'}", "PYTHONSAFEPATH": "1"}

    codes = [("this checkout", code_of(BENCH.parent))]
    if args.baseline is not None:
        codes.insert(0, (f"baseline {args.baseline.resolve().name}", code_of(args.baseline.resolve())))
    results: dict[tuple[str, str], list[dict]] = {}
    for rep in range(args.reps):  # interleaved: a drift of the machine touches every row alike
        for code, env in codes:
            for mode, budget in (("off", "0"), ("on", retention)):
                runs = sum(map(len, results.values()))
                row = one_rep(f"{runs}-{mode}", source, truth, args.ranks, args.device, args.borrowed,
                              budget, tmp, args.budget, env, args.gap)  # fmt: skip
                results.setdefault((code, mode), []).append(row)
                print(f"  rep {rep} {code}, retention {mode}: first {row['cold']['seconds']:.2f} s, "
                      f"second {row['warm']['seconds']:.2f} s", flush=True)  # fmt: skip
    print()
    print("| daemon | retention | first load s | GB/s | second load s | GB/s | first / second |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for (code, mode), rows in results.items():
        first = statistics.median(r["cold"]["seconds"] for r in rows)
        second = statistics.median(r["warm"]["seconds"] for r in rows)
        delivered = rows[0]["cold"]["delivered"]
        print(f"| {code} | {mode} | {first:.2f} | {delivered / first / GB:.2f} | {second:.2f} | "
              f"{delivered / second / GB:.2f} | {first / second:.2f} |")  # fmt: skip
    print(f"medians of {args.reps} fresh daemons per row; each first load {args.gap:g} s after its daemon started; "
          f"shm budget {args.budget}; GB/s counts bytes delivered to all ranks; GB = 1e9 bytes")  # fmt: skip


if __name__ == "__main__":
    main()
