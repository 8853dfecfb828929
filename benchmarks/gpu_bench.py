"""Host -> GPU rates: the pinned-H2D ceiling, our shm -> CUDA copies, and end-to-end loads.

    python benchmarks/gpu_bench.py [--size-gb 4] [--reps 10] [--e2e-reps 3] [--ranks 2]

Rows (GB = 1e9 bytes; each row's rate is the median of its repetitions):

- ``ceiling``: one plain ``torch`` copy of the whole buffer from pinned host memory
  (``torch.empty(..., pin_memory=True)``) to the GPU, timed with CUDA events. What no
  host-to-device path can beat.
- ``shm->cuda pinned``: :class:`streamer_client.cuda.PinnedCopier` copying a ``/dev/shm``
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
"""

from __future__ import annotations

import argparse
import json
import mmap
import multiprocessing as mp
import os
import platform
import shutil
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

import streamer_client  # noqa: E402
from streamer_client.cuda import PinnedCopier, address_of  # noqa: E402
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


def write_checkpoint(directory: Path, size_gb: float, device: str, embed_rows: int = EMBED_ROWS) -> int:
    """An embedding larger than a slot, then layers of 4 bf16 matrices + 2 f32 norms, in 4 shards."""
    from safetensors.torch import save_file

    layers = max(1, round((size_gb * GB - embed_rows * HIDDEN * 2) / (4 * MATRIX)))
    specs: list[tuple[str, tuple[int, ...], torch.dtype]] = [("model.embed_tokens.weight", (embed_rows, HIDDEN), torch.bfloat16)]
    for i in range(layers):
        for part in ("attn.qkv", "attn.o", "mlp.up", "mlp.down"):
            specs.append((f"model.layers.{i}.{part}.weight", (HIDDEN, HIDDEN), torch.bfloat16))
        for part in ("input_norm", "post_norm"):
            specs.append((f"model.layers.{i}.{part}.weight", (HIDDEN,), torch.float32))
    shards = 4
    per_shard = -(-len(specs) // shards)
    weight_map, total, seed = {}, 0, 100
    for s in range(shards):
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        tensors = {}
        for tname, shape, dtype in specs[s * per_shard : (s + 1) * per_shard]:
            nbytes = int(np.prod(shape)) * dtype.itemsize
            seed += 1
            tensors[tname] = _random_gpu_bytes(nbytes, device, seed).view(dtype).reshape(shape).cpu()
            total += nbytes
            weight_map[tname] = name
        save_file(tensors, str(directory / name))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return total


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
    directory: Path, device: str, reps: int, expected: int, cache_dir: Path, budget: str | None, barrier=None,
    *, rank: int = 0, world_size: int = 1, keep_first: bool = False,
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


def _rank_main(rank: int, kind: str, arg: str, reps: int, expected: int, cache_dir: str, barrier, results, env=None, world=2) -> None:
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


# --------------------------------------------------------------------------- issue 16: every loader side by side

ISSUE_EMBED_ROWS = 131072  # a 1 GiB bf16 embedding, as in issue 16's checkpoint
RUNAI_ENV = {"RUNAI_STREAMER_FS_STRATEGY": "sync_buffered"}  # its page-cache reader (DESIGN.md 6)


def _load(kind: str, directory: str, device: str, rank: int, world: int, session: str) -> dict[str, torch.Tensor]:
    """One load by ``kind``, tensors kept on ``device`` (each loader's public API, as a user calls it)."""
    files = sorted(str(p) for p in Path(directory).glob("*.safetensors"))
    if kind == "runai":
        from runai_model_streamer import SafetensorsStreamer

        out = {}
        with SafetensorsStreamer() as streamer:
            streamer.stream_files(files)
            for name, tensor in streamer.get_tensors():
                out[name] = tensor.to(device)
        return out
    if kind == "instanttensor":
        from instanttensor import safe_open

        out = {}
        with safe_open(files, framework="pt", device=torch.device(device).index) as f:
            for name, tensor in f.tensors():
                out[name] = tensor.clone()  # its tensors are views of a buffer it reuses
        return out
    # ours: embedded without STREAMER_SOCKET, daemon mode with it (the ranks of a rep share a session)
    return streamer_client.load_state_dict(directory, device=device, rank=rank, world_size=world, session=session)


def _issue_rank(rank: int, kind: str, directory: str, reps: int, world: int, env: dict, barrier, results) -> None:
    try:
        os.environ.update(env)
        import faulthandler

        faulthandler.dump_traceback_later(float(os.environ.get("ISSUE_HANG_S", "600")), exit=True)  # a hang shows where
        device = "cuda:0"  # every rank on the one GPU, as the issue measures
        torch.cuda.set_device(device)
        torch.zeros(1, device=device)  # CUDA context before the go signal
        spans = []
        for rep in range(reps):
            barrier.wait()
            start = time.time()  # one clock for every process of the machine: wall = last end - first start
            state = _load(kind, directory, device, rank, world, f"issue-{os.getppid()}-{rep}")
            torch.cuda.synchronize(device)
            end = time.time()
            nbytes = sum(t.numel() * t.element_size() for t in state.values())
            if rep == 0:
                _spot_check(Path(directory), state)
            del state
            torch.cuda.empty_cache()
            spans.append((start, end, nbytes))
        results.put((rank, spans, None))
    except BaseException as exc:  # report, don't hang the barrier's other parties
        barrier.abort()
        results.put((rank, [], repr(exc)))


def issue_row(kind: str, directory: Path, reps: int, world: int = 1, env: dict | None = None) -> list[tuple[float, int]]:
    """``reps`` loads by ``world`` rank processes started together: (wall seconds, bytes per rank) each."""
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(world), ctx.Queue()
    procs = [ctx.Process(target=_issue_rank, args=(r, kind, str(directory), reps, world, env or {}, barrier, results))
             for r in range(world)]  # fmt: skip
    for p in procs:
        p.start()
    spans = {}
    for _ in procs:
        try:
            rank, got, error = results.get(timeout=float(os.environ.get("ISSUE_HANG_S", "600")) + 60)
        except Exception:
            raise SystemExit(f"{kind}: no result from a rank (exit codes {[p.exitcode for p in procs]})") from None
        if error:
            raise SystemExit(f"{kind} rank {rank} failed: {error}")
        spans[rank] = got
    for p in procs:
        p.join()
    if world > 1:  # each rank's own span per repetition: do the ranks overlap or queue behind each other?
        for i in range(reps):
            first = min(spans[r][i][0] for r in spans)
            print(f"    {kind} rep {i}: " + "  ".join(f"rank {r} {spans[r][i][0] - first:.2f}->{spans[r][i][1] - first:.2f} s"
                                                 for r in sorted(spans)), flush=True)  # fmt: skip
    return [
        (max(spans[r][i][1] for r in spans) - min(spans[r][i][0] for r in spans), spans[0][i][2])
        for i in range(reps)
    ]


def issue_rows(disk_dir: Path, shm_root: Path, args, label: str) -> dict[str, list[tuple[float, int]]]:
    """Every row that depends on the shm dir's pages (``label``); the page-cache rows on ``"4k"`` only."""
    rows: dict[str, list[tuple[float, int]]] = {}
    reps = args.e2e_reps + 1  # the first of each is a warm-up, dropped below (except cold rows)

    # e.g. "daemon" or "runai x4,daemon 4": only the rows whose name starts with one of these
    only = tuple(p for p in os.environ.get("ISSUE_ROWS", "").split(",") if p)

    def row(name: str, kind: str, directory: Path, world: int = 1, env: dict | None = None, n: int = reps) -> None:
        if only and not name.startswith(only):
            return
        rows[name] = issue_row(kind, directory, n, world, env)
        walls = [w for w, _ in rows[name][1:]] or [rows[name][0][0]]
        print(f"  [{label}] {name}: median {statistics.median(walls):.3f} s", flush=True)

    # A name of its own per run: a copy at a path loaded before (a probe's /dev/shm/ckpt) is another
    # version of those files, which the metadata cache rightly refuses (ObjectChangedError).
    tmpfs_dir = shm_root / f"ckpt-{label}-{os.getpid()}"
    if not tmpfs_dir.exists():
        shutil.copytree(disk_dir, tmpfs_dir)
    if label == "4k":
        row("runai, page cache", "runai", disk_dir, env=RUNAI_ENV)
        row("instanttensor, page cache", "instanttensor", disk_dir, n=2)
        row("embedded, page cache", "embedded", disk_dir)
        row("runai x4 independent, page cache", "runai", disk_dir, world=4, env=RUNAI_ENV)
    row("runai, tmpfs dir", "runai", tmpfs_dir, env=RUNAI_ENV)
    row("instanttensor, tmpfs dir", "instanttensor", tmpfs_dir)
    row("embedded, tmpfs dir", "embedded", tmpfs_dir)
    row("embedded with Run:ai's reader, tmpfs dir", "embedded", tmpfs_dir, env={"STREAMER_LOCAL_READER": "runai"})
    for i in range(args.pairs):  # alternating processes, so that the machine's drift falls on both alike
        for kind in ("instanttensor", "embedded")[:: 1 if i % 2 == 0 else -1]:  # who goes first alternates too
            row(f"pair {i}: {kind}, tmpfs dir", kind, tmpfs_dir)
    root = Path(tempfile.mkdtemp(prefix="issue-daemon-", dir=shm_root))
    daemon = ChildDaemon(root, args.daemon_budget, env={"STREAMER_CACHE_DIR": str(root / "cache")})
    try:
        row("daemon 1 rank, page cache", "daemon", disk_dir, env=daemon.env())
        row("daemon 4 ranks, page cache", "daemon", disk_dir, world=4, env=daemon.env())
    except BaseException:
        print(daemon.log.read_text()[-4000:], flush=True)
        raise
    finally:
        daemon.close()
    retention = {"STREAMER_CACHE_DIR": str(root / "cache2"), "STREAMER_RETENTION_BUDGET": args.retention or "16GiB"}
    daemon = ChildDaemon(root, args.daemon_budget, env=retention)
    try:
        page = daemon.client.call("/readyz")["shm_page_size"]
        print(f"  [{label}] daemon shm pages: {page} bytes", flush=True)
        row("daemon retained: cold, then warm reloads", "daemon", disk_dir, env=daemon.env(), n=reps + 1)
    finally:
        daemon.close()
    return rows


def _loads_rate(loads: list[tuple[float, int]], which: str = "warm") -> float:
    """GB/s of one row's loads (wall seconds, bytes): the first (``cold``) or the median of the others (``warm``)."""
    if which == "cold":
        wall, nbytes = loads[0]
    else:
        wall, nbytes = statistics.median(w for w, _ in loads[1:]), loads[0][1]
    return nbytes / wall / GB


def _rate(rows: dict, name: str, which: str = "warm") -> float | None:
    """GB/s of row ``name`` (:func:`_loads_rate`), ``None`` where it was not measured."""
    got = rows.get(name)
    return _loads_rate(got, which) if got else None


def issue_table(columns: dict[str, dict[str, list[tuple[float, int]]]]) -> None:
    """The issue's figures, one column per shm kind, with ratios against Run:ai and InstantTensor."""

    def cells(values: list[float | None]) -> str:  # one column per page size; blank where not measured
        return "".join(f"{v:>9.2f}" if v else f"{'':>9}" for v in values)

    k4 = columns.get("4k", {})
    lines = [("runai, page cache", "plain Run:ai sync_buffered -> .to(cuda), 1 rank"),
             ("runai, tmpfs dir", "plain Run:ai, files on tmpfs"),
             ("instanttensor, page cache", "InstantTensor 0.2.2, page cache (its direct I/O)"),
             ("instanttensor, tmpfs dir", "InstantTensor 0.2.2, files on tmpfs"),
             ("embedded, page cache", "embedded load_state_dict(dir, cuda:0), page cache"),
             ("embedded, tmpfs dir", "embedded load_state_dict(dir, cuda:0), files on tmpfs"),
             ("embedded with Run:ai's reader, tmpfs dir", "  the same, STREAMER_LOCAL_READER=runai"),
             ("daemon 1 rank, page cache", "daemon, 1 rank, cold (page cache)")]  # fmt: skip
    names = list(columns)
    print()
    print("GB/s per rank (GB = 1e9 bytes; medians; 'tmpfs' and shm dirs are /dev/shm (4k) or a huge=always tmpfs (thp))")
    print(f"{'path':<58}" + "".join(f"{n:>9}" for n in names) + "   x runai  x IT(tmpfs)")
    runai = _rate(k4, "runai, page cache")
    for key, label in lines + [("daemon retained: cold, then warm reloads", "daemon, warm reload from the resident copy")]:
        values = [_rate(columns[n], key) if key in columns[n] else _rate(k4, key) for n in names]
        best = max((v for v in values if v), default=None)
        it = max((_rate(columns[n], "instanttensor, tmpfs dir") or 0) for n in names) or None
        ratios = f"   {best / runai:>7.2f}  {best / it:>10.2f}" if best and runai and it else ""
        print(f"{label:<58}" + cells(values) + ratios)
    cold = [_rate(columns[n], "daemon retained: cold, then warm reloads", "cold") for n in names]
    print(f"{'daemon retained, first (cold) load':<58}" + cells(cold))
    # Every row's first load is its process's first (and, for the daemon rows, a fresh daemon's).
    for key, label in [("instanttensor, tmpfs dir", "  first load of a process: InstantTensor, tmpfs"),
                       ("embedded, tmpfs dir", "  first load of a process: embedded, tmpfs"),
                       ("embedded, page cache", "  first load of a process: embedded, page cache"),
                       ("daemon 1 rank, page cache", "  first load on a fresh daemon, 1 rank")]:  # fmt: skip
        values = [_rate(columns[n], key, "cold") if key in columns[n] else _rate(k4, key, "cold") for n in names]
        print(f"{label:<58}" + cells(values))
    ind = k4.get("runai x4 independent, page cache")
    if ind:
        runai4 = statistics.median(w for w, _ in ind[1:])
        for n in names:
            d4 = columns[n].get("daemon 4 ranks, page cache")
            if d4:
                wall = statistics.median(w for w, _ in d4[1:])
                print(f"4 ranks on cuda:0, each all tensors: daemon wall / 4 independent Run:ai wall [{n}]: "
                      f"{wall:.2f} s / {runai4:.2f} s = {wall / runai4:.2f}")  # fmt: skip


def pairs_table(columns: dict[str, dict[str, list[tuple[float, int]]]]) -> None:
    """``--pairs``: InstantTensor and the embedded engine from the same tmpfs dir, in alternating
    processes; each round's reloads and first loads, embedded / InstantTensor, and the medians."""
    for column, rows in columns.items():
        rounds = sorted({int(k.split(":")[0].split()[1]) for k in rows if k.startswith("pair ")})
        if not rounds:
            continue
        print()
        print(f"InstantTensor vs embedded, files on tmpfs [{column}], alternating processes (GB/s; ratio embedded / IT)")
        print(f"{'round':<8}{'IT':>9}{'embedded':>10}{'ratio':>8}   {'first: IT':>10}{'embedded':>10}{'ratio':>8}")
        warm, cold = [], []
        for i in rounds:
            it, ours = (rows[f"pair {i}: {kind}, tmpfs dir"] for kind in ("instanttensor", "embedded"))
            w = [_loads_rate(loads) for loads in (it, ours)]
            c = [_loads_rate(loads, "cold") for loads in (it, ours)]
            warm.append(w[1] / w[0])
            cold.append(c[1] / c[0])
            print(f"{i:<8}{w[0]:>9.2f}{w[1]:>10.2f}{warm[-1]:>8.2f}   {c[0]:>10.2f}{c[1]:>10.2f}{cold[-1]:>8.2f}")
        print(f"{'median':<8}{'':>19}{statistics.median(warm):>8.2f}   {'':>20}{statistics.median(cold):>8.2f}")


def issue_main(args) -> None:
    """``--issue``: the checkpoint of issue 16; /dev/shm rows, then (``--huge-pages``) the same rows in a
    private mount namespace whose /dev/shm is a tmpfs mounted huge=always; one table."""
    print(machine(), flush=True)
    columns: dict[str, dict] = {}
    if args.issue_child:  # inside the namespace: shm-dependent rows only, as JSON
        rows = issue_rows(args.dir, Path("/dev/shm"), args, args.issue_child)
        args.json.write_text(json.dumps(rows))
        return
    with tempfile.TemporaryDirectory(prefix="gpu-bench-issue-", dir=args.disk_dir) as tmp:
        directory = args.dir or Path(tmp) / "ckpt"
        directory.mkdir(parents=True, exist_ok=True)
        total = write_checkpoint(directory, args.size_gb, "cuda:0", embed_rows=ISSUE_EMBED_ROWS)
        warm_page_cache(directory)
        print(f"checkpoint {total / GB:.2f} GB in {directory}", flush=True)
        ceiling_rates = ceiling(total // MIB * MIB // 4, "cuda:0", args.reps)
        print(f"  pinned H2D ceiling: {statistics.median(ceiling_rates):.2f} GB/s", flush=True)
        shm_root = Path(tempfile.mkdtemp(prefix="gpu-bench-issue-", dir="/dev/shm"))
        try:
            columns["4k"] = issue_rows(directory, shm_root, args, "4k")
        finally:
            shutil.rmtree(shm_root, ignore_errors=True)
        if args.huge_pages:
            out = Path(tmp) / "thp.json"
            size = f"{int(args.size_gb * 3 + 24)}G"
            child = [sys.executable, __file__, "--issue", "--issue-child", "thp", "--dir", str(directory), "--json", str(out),
                     "--size-gb", str(args.size_gb), "--e2e-reps", str(args.e2e_reps), "--daemon-budget", args.daemon_budget,
                     "--pairs", str(args.pairs)]  # fmt: skip
            if args.retention:
                child += ["--retention", args.retention]
            mount = f"mount -t tmpfs -o huge=always,size={size} tmpfs /dev/shm"
            subprocess.run(["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", f'{mount} && exec "$@"', "sh", *child],
                           check=True)  # fmt: skip
            columns["thp"] = {k: [tuple(x) for x in v] for k, v in json.loads(out.read_text()).items()}
        print()
        print(f"pinned H2D ceiling {statistics.median(ceiling_rates):.2f} GB/s; checkpoint {total / GB:.2f} GB")
        issue_table(columns)
        pairs_table(columns)
        if args.json:
            args.json.write_text(json.dumps({"machine": machine(), "checkpoint_bytes": total, "columns": columns}, indent=1))


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
    parser.add_argument("--issue", action="store_true", help="issue 16's rows: every loader side by side")
    parser.add_argument("--huge-pages", action="store_true", help="with --issue: also on a huge=always tmpfs (root)")
    parser.add_argument("--disk-dir", type=Path, help="with --issue: where the page-cache checkpoint goes (default TMPDIR)")
    parser.add_argument("--pairs", type=int, default=0,
                        help="with --issue: also this many rounds of InstantTensor and embedded from tmpfs (each a fresh process; the order alternates)")  # fmt: skip
    parser.add_argument("--issue-child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("gpu_bench needs CUDA")
    if args.issue:
        issue_main(args)
        return
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
            add("shm->cuda pinned (PinnedCopier)", rates,
                f"32 MiB tensors; register once {register_s:.2f} s = {register_s / (nbytes / 2**30):.3f} s/GiB")
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
        total = write_checkpoint(directory, args.size_gb, device)
        warm_page_cache(directory)
        torch.cuda.empty_cache()
        cache_dir = Path(tmp) / "cache"
        for budget in [b.strip() for b in args.e2e_budgets.split(",") if b.strip()]:
            b = None if budget == "default" else budget
            label = "default budget 4GiB/256MiB slots" if b is None else f"budget {b}"
            add(f"e2e load_state_dict(dir, cuda:0), {label}",
                e2e(directory, device, args.e2e_reps, total, cache_dir, b), "page cache warm")
        add("e2e load_state_dict(dir, cpu) (reference)", e2e(directory, "cpu", args.e2e_reps, total, cache_dir, None),
            "no GPU: the read rate")
        if args.ranks == 2 and torch.cuda.device_count() >= 2:
            per_rank = two_ranks("e2e", str(directory), args.e2e_reps, total, Path(tmp))
            for r, rates in enumerate(per_rank):
                add(f"e2e, 2 ranks at once: rank {r} -> cuda:{r}", rates, "each reads every byte")
        daemon = ChildDaemon(Path(tmp), args.daemon_budget, env={"STREAMER_CACHE_DIR": str(Path(tmp) / "daemon-cache")})
        try:
            for world in sorted({1, args.ranks}):
                before = daemon.stats().bytes_read
                per_rank = two_ranks("daemon", str(directory), args.e2e_reps, total, Path(tmp) / "rank-cache", daemon.env(), world)
                read = (daemon.stats().bytes_read - before) / (args.e2e_reps + 1)
                for r, rates in enumerate(per_rank):
                    add(f"daemon e2e, {world} rank(s): rank {r} -> cuda:{r % torch.cuda.device_count()}", rates,
                        f"node read {read / total:.3f}x the checkpoint per load")
        finally:
            daemon.close()
        for world in sorted({1, args.ranks}) if args.retention else ():
            root = Path(tmp) / f"retained-{world}"  # a fresh daemon: its first load is cold
            root.mkdir()
            env = {"STREAMER_CACHE_DIR": str(root / "cache"), "STREAMER_RETENTION_BUDGET": args.retention}
            daemon = ChildDaemon(root, args.daemon_budget, env=env)
            try:
                per_rank = two_ranks("daemon-retained", str(directory), args.e2e_reps, total, root / "rank-cache", daemon.env(), world)
                stats = daemon.stats()
            finally:
                daemon.close()
            for r, rates in enumerate(per_rank):
                gpu = f"cuda:{r % torch.cuda.device_count()}"
                add(f"daemon cold, retention on, {world} rank(s): rank {r} -> {gpu}", rates[:1], "first load: reads storage")
                add(f"daemon warm from resident copy, {world} rank(s): rank {r} -> {gpu}", rates[1:],
                    f"warm/cold time {rates[0] / statistics.median(rates[1:]):.3f}")
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
        args.json.write_text(json.dumps({"machine": machine(), "bytes": nbytes, "checkpoint_bytes": total,
                                         "rows": [{"path": n, "gbps": r, "note": note} for n, r, note in rows]}, indent=2))


if __name__ == "__main__":
    main()
