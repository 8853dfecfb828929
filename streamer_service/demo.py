"""``streamer-service demo``: the main job on a sample checkpoint, verified, with a summary.

Builds a small MoE-shaped sharded checkpoint with ``safetensors`` in a temp dir
(or uses ``--uri``), runs N rank processes with a tensor-parallel-like selection
(every rank needs the shared tensors, each rank its own experts), checks every
tensor each rank received against ground truth, and prints a table. Exits
non-zero on any mismatch. The wall time is broken down into its phases (sample, metadata and
plan, daemon start, the ranks' start-up, join, stream and verification, stop), which add up to it.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from .sample import build_sample, rank_selection

__all__ = ["add_arguments", "run"]

_REPORT_BYTES = 8 * 1024**2  # a rank tells the parent's progress bar every this many bytes


@dataclass(frozen=True)
class RankResult:
    """One rank's outcome and its clock readings (``time.monotonic``: one clock for every process
    on the machine, so the parent subtracts them from its own)."""

    rank: int
    tensors: int
    nbytes: int
    mismatches: tuple[str, ...]
    error: str | None
    started_at: float  # the interpreter up, torch and the client imported
    joined_at: float  # every rank had joined (daemon) / the plan was ready (embedded)
    streamed_at: float  # the last tensor received
    done_at: float  # verified (or failed)

    @property
    def join_seconds(self) -> float:
        return self.joined_at - self.started_at

    @property
    def seconds(self) -> float:
        """Streaming, after the join."""
        return self.streamed_at - self.joined_at

    @property
    def verify_seconds(self) -> float:
        return self.done_at - self.streamed_at


@dataclass(frozen=True)
class _Launch:
    """What every rank process of the demo is told (as arguments: nobody's environment is written)."""

    socket: str | None  # the demo's daemon; None: STREAMER_SOCKET as configured (embedded: unset)
    launch_id: str
    cache_dir: str  # in-process mode's metadata cache


def _rank_main(uri: str, truth_dir: str | None, rank: int, world_size: int, select: list[str], launch: _Launch, queue) -> None:
    clock = [time.monotonic()] * 3  # started, joined, streamed: each moved on as it is reached
    try:
        import streamer_client

        # Import the engine before the clock starts: the rank's load time, not interpreter start-up
        # (the summary reports that apart).
        from .embedded import stream  # noqa: F401

        clock[:] = [time.monotonic()] * 3
        received = {}
        nbytes = 0
        # stream() returns once the session is joined (and the selection checked); reading starts then.
        # The cache dir is an in-process load's: a daemon has its own.
        tensors = streamer_client.stream(
            uri, select=select, rank=rank, world_size=world_size, socket=launch.socket, launch_id=launch.launch_id,
            cache_dir=launch.cache_dir if launch.socket is None else None,
        )  # fmt: skip
        clock[1:] = [time.monotonic()] * 2
        unreported = 0
        for name, tensor in tensors:
            received[name] = tensor
            size = tensor.numel() * tensor.element_size()
            nbytes += size
            unreported += size
            if unreported >= _REPORT_BYTES:
                queue.put(unreported)  # the parent's progress bar
                unreported = 0
        queue.put(unreported)
        clock[2] = time.monotonic()
        mismatches = _verify(uri, truth_dir, received, select, launch.cache_dir)
        queue.put(RankResult(rank, len(received), nbytes, tuple(mismatches), None, *clock, time.monotonic()))
    except Exception as exc:  # noqa: BLE001 - reported in the table, and the demo exits non-zero
        queue.put(RankResult(rank, 0, 0, (), f"{type(exc).__name__}: {exc}", *clock, time.monotonic()))


def _verify(uri: str, truth_dir: str | None, received: dict, select: list[str], cache_dir: str) -> list[str]:
    """Names whose bytes, dtype or shape differ from ground truth, plus any missing or extra."""
    import torch

    bad = sorted(set(select) ^ set(received))
    if truth_dir is not None:
        from safetensors import safe_open

        index = json.loads((Path(truth_dir) / "model.safetensors.index.json").read_text())["weight_map"]
        handles = {}
        for name, tensor in received.items():
            shard = index[name]
            if shard not in handles:
                handles[shard] = safe_open(str(Path(truth_dir) / shard), "pt")
            expected = handles[shard].get_tensor(name)
            if not (expected.dtype == tensor.dtype and expected.shape == tensor.shape and torch.equal(expected, tensor)):
                bad.append(name)
    else:
        bad.extend(_verify_against_storage(uri, received, cache_dir))
    return bad


def _verify_against_storage(uri: str, received: dict, cache_dir: str) -> list[str]:
    """Remote checkpoints: compare with the bytes the cloud SDK reads (an independent path)."""
    import torch

    from .checkpoint.open import open_checkpoint
    from .settings import get_settings
    from .storage import open_storage

    settings = get_settings().replace(cache_dir=Path(cache_dir))
    checkpoint = open_checkpoint(uri, settings)
    bad = []
    with open_storage(checkpoint.uri, settings) as storage:
        for name, tensor in received.items():
            info = checkpoint.catalog[name]
            raw = storage.read_range(info.file, info.offset, info.nbytes)
            got = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
            if raw != got:
                bad.append(name)
    return bad


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--uri", help="stream this checkpoint instead of a generated sample")
    parser.add_argument("--ranks", type=int, default=4, help="rank processes (default 4)")
    parser.add_argument("--size-mb", type=int, default=256, help="size of the generated sample (default 256)")
    parser.add_argument("--shm-budget", default="256MiB", help="the demo daemon's shared-memory budget")
    parser.add_argument("--embedded", action="store_true", help="no daemon: each rank reads its own selection")


def run(args: argparse.Namespace) -> int:
    from .checkpoint.open import open_checkpoint
    from .daemon.server import ChildDaemon
    from .settings import get_settings

    if args.ranks < 1:
        print("demo: --ranks must be at least 1")
        return 2
    clock = _Phases()
    with tempfile.TemporaryDirectory(prefix="streamer-demo-") as tmp:
        truth_dir = None
        if args.uri:
            uri = args.uri
        else:
            truth_dir = str(Path(tmp) / "checkpoint")
            print(f"demo: writing a ~{args.size_mb} MB sample checkpoint to {truth_dir}", flush=True)
            build_sample(Path(truth_dir), args.size_mb)
            uri = truth_dir
            clock.lap("sample checkpoint", "written with safetensors")
        settings = get_settings()
        if "cache_dir" not in settings.given:  # STREAMER_CACHE_DIR unset: a cache of its own
            settings = settings.replace(cache_dir=Path(tmp) / "cache")
        catalog = open_checkpoint(uri, settings).catalog
        names = [t.name for t in catalog.tensors]
        selections = [rank_selection(names, r, args.ranks) for r in range(args.ranks)]
        union = set().union(*map(set, selections))
        unique_bytes = sum(catalog[n].nbytes for n in union)
        requested = sum(catalog[n].nbytes for sel in selections for n in sel)
        clock.lap("metadata + plan", "the demo reads the headers to choose the ranks' selections")

        cache_env = {"STREAMER_CACHE_DIR": str(settings.cache_dir)}
        # Ranks find segments where the daemon says, unless STREAMER_SHM_DIR says otherwise: where
        # it is set, the demo's daemon uses that dir too.
        shm_dir = settings.if_given("shm_dir")
        daemon = None if args.embedded else ChildDaemon(Path(tmp), args.shm_budget, env=cache_env, shm_dir=shm_dir)
        if daemon:
            clock.lap("daemon start", "a `serve` process, until its socket answers")
        try:
            socket = str(daemon.socket) if daemon else None
            launch = _Launch(socket, f"demo-{os.getpid()}", str(settings.cache_dir))
            results = _run_ranks(uri, truth_dir, selections, launch, _progress(args, requested))
            clock.ranks(results, "safetensors" if truth_dir else "the cloud SDK re-reading each tensor", daemon is not None)
            stats = daemon.stats() if daemon else None
            storage_bytes = stats.bytes_read if stats else requested
            peak_shm = stats.shm_peak if stats else None
        finally:
            if daemon:
                daemon.close()
    clock.lap("stop, clean-up", "the daemon stopped, the temp dir removed" if daemon else "the temp dir removed")

    mode = "daemon (one read per node, shared memory)" if not args.embedded else "embedded (each rank reads its own selection)"
    print()
    print(f"checkpoint      {uri if args.uri else 'generated sample'}: {len(names)} tensors, {catalog.total_bytes / 1e6:.1f} MB")
    print(f"mode            {mode}, {args.ranks} ranks, TP-like selection (shared tensors + own experts)")
    print(f"unique bytes    {unique_bytes / 1e6:10.1f} MB  (union of the ranks' selections)")
    print(f"storage reads   {storage_bytes / 1e6:10.1f} MB  ({storage_bytes / unique_bytes:.3f}x unique)")
    print(f"delivered       {sum(r.nbytes for r in results) / 1e6:10.1f} MB  ({requested / unique_bytes:.2f}x unique)")
    if peak_shm is not None:
        print(f"peak shm        {peak_shm / 2**20:10.1f} MiB (budget {args.shm_budget})")
    print(f"wall time       {clock.total:10.2f} s  =")
    for name, seconds, note in clock.rows:
        print(f"  {name:<18} {seconds:7.2f} s  ({note})")
    print()
    print(f"{'rank':>4}  {'tensors':>7}  {'MB':>9}  {'join s':>6}  {'stream s':>8}  {'GB/s':>6}  {'verify s':>8}  verified")
    ok = True
    for r in results:
        if r.error:
            ok = False
            print(f"{r.rank:>4}  {'-':>7}  {'-':>9}  {'-':>6}  {'-':>8}  {'-':>6}  {'-':>8}  ERROR {r.error}")
            continue
        good = not r.mismatches and r.tensors == len(selections[r.rank])
        ok &= good
        rate = r.nbytes / r.seconds / 1e9 if r.seconds else 0.0
        verdict = "byte-exact" if good else f"MISMATCH {', '.join(r.mismatches[:5])}"
        print(
            f"{r.rank:>4}  {r.tensors:>7}  {r.nbytes / 1e6:>9.1f}  {r.join_seconds:>6.2f}  {r.seconds:>8.2f}  {rate:>6.2f}"
            f"  {r.verify_seconds:>8.2f}  {verdict}"
        )
    print()
    print("demo: OK, every tensor matches safetensors" if ok else "demo: FAILED")
    return 0 if ok else 1


class _Phases:
    """The demo's wall time as consecutive phases, each ending where the next begins: they add up."""

    def __init__(self) -> None:
        self.started = self._last = time.monotonic()
        self.rows: list[tuple[str, float, str]] = []

    def lap(self, name: str, note: str, at: float | None = None) -> None:
        at = time.monotonic() if at is None else at
        self.rows.append((name, at - self._last, note))
        self._last = at

    def ranks(self, results: list[RankResult], verified_by: str, daemon: bool) -> None:
        """The ranks' part, along the rank that finished last (its own phases; the others' are in
        the table): start-up, join, stream, verification, then until every process had exited."""
        last = max(results, key=lambda r: r.done_at)
        who = f"rank {last.rank}, the last to finish"
        self.lap("rank start-up", f"{len(results)} interpreters spawned, torch and the client imported; {who}", last.started_at)
        self.lap(
            "join",
            "the daemon opens the checkpoint, every rank joins" if daemon else "the rank plans its own load",
            last.joined_at,
        )
        self.lap("stream", f"{who}; each rank's own below", last.streamed_at)
        self.lap("verify", f"against {verified_by}", last.done_at)
        self.lap("rank exit", "until every rank process had exited")

    @property
    def total(self) -> float:
        return self._last - self.started


def _progress(args: argparse.Namespace, total: int):
    """A bar of the bytes all ranks received and their aggregate GB/s (quiet unless on a terminal)."""
    from streamer_client._progress import bar

    from .logs import progress_mode

    return bar(total=total, desc=f"{args.ranks} ranks", mode=progress_mode(args.progress))


def _run_ranks(uri: str, truth_dir: str | None, selections: list[list[str]], launch: _Launch, progress) -> list[RankResult]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    world = len(selections)
    procs = [ctx.Process(target=_rank_main, args=(uri, truth_dir, r, world, selections[r], launch, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = []
    with progress:
        while len(results) < world:
            message = queue.get(timeout=1800)
            if isinstance(message, RankResult):
                results.append(message)
            else:
                progress.update(message)
    for p in procs:
        p.join()
    return sorted(results, key=lambda r: r.rank)
