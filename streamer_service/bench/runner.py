"""Runs the benchmark: one checkpoint, one storage server per source, contenders interleaved.

For each source, scenario and rank count, repetitions run A B C D, A B C D, ... so drift in a
shared machine hits every contender alike. Warm-up repetitions (not in the medians) check every
byte; timed repetitions check samples (see :mod:`.ranks`). One daemon serves every B run of a
source, as a node daemon would; each B run is its own session (a new launch id).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import shutil
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..checkpoint.open import open_checkpoint
from ..daemon.server import ChildDaemon
from ..sample import build_sample
from ..settings import Settings
from ..uri import parse_uri
from .measure import Sampler, read_io
from .ranks import Mode, RankJob, RankResult, rank_main, take_samples
from .scenarios import Scenario, selections
from .sources import Source, open_source

__all__ = ["BenchConfig", "RunResult", "Bench"]

_RUN_TIMEOUT_S = 1800


@dataclass(frozen=True)
class BenchConfig:
    sources: tuple[str, ...]
    size_bytes: int
    ranks: tuple[int, ...]
    scenarios: tuple[Scenario, ...]
    modes: tuple[Mode, ...]
    reps: int
    warmup: int
    full_check: bool  # every byte in timed repetitions too (warm-ups always)
    borrowed: bool  # ranks take zero-copy views (A: owned=False; B, C: borrowed=True) instead of owned tensors
    runai_env: dict[str, str]  # the same Run:ai settings for A, B's daemon and C
    shm_budget: str
    work_dir: Path
    latency_s: float = 0.0  # every storage request held this long (sources.with_latency)
    retention_budget: str = "0"  # B's daemon


@dataclass
class RunResult:
    source: str
    scenario: str
    ranks: int
    mode: str
    rep: int  # < 0: warm-up
    wall_s: float = 0.0
    storage_bytes: int | None = None
    requests: int | None = None  # through the latency proxy: requests it held
    delivered_bytes: int = 0
    unique_bytes: int = 0
    peak_shm_bytes: int | None = None
    peak_rss_ranks_bytes: int = 0
    peak_rss_daemon_bytes: int | None = None
    max_rank_hwm_bytes: int = 0
    verified: bool = False
    check: str = "sample"
    errors: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


class Bench:
    def __init__(self, config: BenchConfig, progress) -> None:
        self.config = config
        self.progress = progress
        self.work = config.work_dir
        self.checkpoint = self.work / f"checkpoint-{config.size_bytes}"
        self.results: list[RunResult] = []
        self.sources: dict[str, str] = {}
        # What this bench started, for the record (tests check that none of it outlives the bench).
        self.started: dict[str, list] = {"server_pids": [], "daemon_pids": [], "daemon_shm_dirs": []}
        self._ctx = mp.get_context("forkserver")
        # Ranks fork from a server that has torch imported: start-up is not what is measured, and
        # paying it 100 times would make the bench slow for no information.
        self._ctx.set_forkserver_preload(["torch", "numpy", "safetensors.torch", __package__ + ".ranks"])
        self._run_counter = 0

    # ------------------------------------------------------------------ setup

    def prepare(self) -> None:
        marker = self.checkpoint / ".complete"
        if not marker.exists():
            shutil.rmtree(self.checkpoint, ignore_errors=True)
            self.progress.note(f"writing a {self.config.size_bytes / 1e9:.2f} GB sample checkpoint to {self.checkpoint}")
            build_sample(self.checkpoint, max(1, round(self.config.size_bytes / 1e6)))
            marker.write_text("ok\n")
        settings = Settings(cache_dir=self.work / "cache")
        self.catalog = open_checkpoint(str(self.checkpoint), settings).catalog
        self.samples = self.work / f"samples-{self.config.size_bytes}.pickle"
        if not self.samples.exists():
            take_samples(self.checkpoint, self.samples)

    def plan_total(self) -> int:
        c = self.config
        groups = len(c.sources) * len(c.scenarios) * len(c.ranks)
        return groups * (c.warmup + c.reps) * len(c.modes)

    def run(self) -> list[RunResult]:
        self.prepare()
        for name in self.config.sources:
            self._run_source(name)
        return self.results

    def _run_source(self, name: str) -> None:
        self.progress.note(f"starting source {name}")
        source = open_source(name, self.work, self.checkpoint, self.config.latency_s)
        daemon = None
        try:
            self.sources[name] = source.describe()
            if source.proc is not None:
                self.started["server_pids"].append(source.proc.pid)
            if Mode.DAEMON in self.config.modes:
                root = self.work / f"daemon-{name}"
                root.mkdir(exist_ok=True)
                daemon = ChildDaemon(
                    root,
                    self.config.shm_budget,
                    env={
                        **self._common_env(source),
                        "STREAMER_LOG_LEVEL": "INFO",  # its own log file
                        "STREAMER_RETENTION_BUDGET": self.config.retention_budget,
                    },
                )
                self.started["daemon_pids"].append(daemon.proc.pid)
                self.started["daemon_shm_dirs"].append(str(daemon.shm_dir))
                daemon.wait_preloaded()  # its reads count as storage bytes of a local source from now on
            for scenario in self.config.scenarios:
                for world in self.config.ranks:
                    sel = selections(scenario, self.catalog.tensors, world)
                    for rep in range(-self.config.warmup, self.config.reps):
                        for mode in self.config.modes:
                            self.progress.step(f"{name} {scenario.value} N={world} {mode.value} "
                                               f"{'warm-up' if rep < 0 else f'rep {rep + 1}/{self.config.reps}'}")  # fmt: skip
                            result = self._run_once(source, daemon, scenario, sel, mode, rep)
                            self.results.append(result)
                            self.progress.done(result)
        finally:
            if daemon is not None:
                daemon.close()
            source.close()

    def _common_env(self, source: Source) -> dict[str, str]:
        # C gets the daemon's budget: both keep at most that many bytes of buffers.
        return {"STREAMER_CACHE_DIR": str(self.work / "cache"), "STREAMER_LOG_LEVEL": "WARNING",
                "STREAMER_SHM_BUDGET": self.config.shm_budget, **self.config.runai_env, **source.env}  # fmt: skip

    # ------------------------------------------------------------------ one run

    def _run_once(self, source: Source, daemon: ChildDaemon | None, scenario: Scenario,
                  sel: list[list[str]], mode: Mode, rep: int) -> RunResult:  # fmt: skip
        self._run_counter += 1
        full = rep < 0 or self.config.full_check
        by_name = {t.name: t for t in self.catalog.tensors}
        wanted = set().union(*sel)
        union = [t.name for t in self.catalog.tensors if t.name in wanted]
        result = RunResult(source.name, scenario.value, len(sel), mode.value, rep, check="full" if full else "sample",
                           unique_bytes=sum(by_name[n].nbytes for n in union))  # fmt: skip
        env = self._common_env(source)
        launch = f"bench-{os.getpid()}-{self._run_counter}"
        download_dir = None
        if mode is Mode.DAEMON:
            env.update(daemon.env())
        per_rank = [union] if mode is Mode.EMBEDDED else sel
        uri = parse_uri(source.uri)
        jobs = []
        for rank, names in enumerate(per_rank):
            extra: dict = {}
            if mode is Mode.RUNAI:
                files = dict.fromkeys(by_name[n].file for n in names)
                extra["runai_paths"] = tuple(uri.child(f) for f in files)
            if mode is Mode.NAIVE and not uri.is_local:
                download_dir = str(self.work / f"download-{launch}")
                extra.update(download_dir=download_dir, endpoint=source.endpoint,
                             downloads=tuple(uri.key_for(p.name) for p in sorted(self.checkpoint.iterdir())
                                             if p.is_file() and not p.name.startswith(".")))  # fmt: skip
            jobs.append(RankJob(mode, source.uri, rank, len(per_rank), tuple(names), str(self.checkpoint), full,
                                str(self.samples), env, launch, self.config.borrowed, **extra))  # fmt: skip
        try:
            self._execute(jobs, result, source, daemon)
        finally:
            if download_dir is not None:
                shutil.rmtree(download_dir, ignore_errors=True)
        return result

    def _execute(self, jobs: list[RankJob], result: RunResult, source: Source, daemon: ChildDaemon | None) -> None:
        ctx = self._ctx
        ready = ctx.Barrier(len(jobs) + 1)
        go, downloaded = ctx.Event(), ctx.Event()
        results = ctx.Queue()
        procs = [ctx.Process(target=rank_main, args=(job, ready, go, downloaded, results), daemon=True) for job in jobs]
        for p in procs:
            p.start()
        groups = {"ranks": lambda: [p.pid for p in procs if p.is_alive()]}
        if daemon is not None and jobs[0].mode is Mode.DAEMON:
            groups["daemon"] = lambda: [daemon.proc.pid]
        shm_dir = daemon.shm_dir if daemon is not None and jobs[0].mode is Mode.DAEMON else None
        rank_results: list[RankResult] = []
        try:
            with Sampler(groups, shm_dir) as sampler:
                try:
                    ready.wait(timeout=300)
                except threading.BrokenBarrierError:
                    pass  # a rank failed to start: its error comes through the queue
                served_before = source.bytes_served()
                requests_before = source.proxy.counts.requests if source.proxy is not None else None
                daemon_io = read_io(daemon.proc.pid)["rchar"] if "daemon" in groups else 0
                started = time.monotonic()
                go.set()
                deadline = started + _RUN_TIMEOUT_S
                while len(rank_results) < len(jobs):
                    try:
                        rank_results.append(results.get(timeout=1.0))
                    except queue.Empty:
                        if time.monotonic() > deadline or not any(p.is_alive() for p in procs):
                            if results.empty():
                                break
                served_after = source.bytes_served()
                if requests_before is not None:
                    result.requests = source.proxy.counts.requests - requests_before
                daemon_io = read_io(daemon.proc.pid)["rchar"] - daemon_io if "daemon" in groups else 0
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
                    p.join()
        missing = len(jobs) - len(rank_results)
        result.errors = [f"rank {r.rank}: {r.error}" for r in rank_results if r.error]
        result.errors += [f"{missing} rank(s) exited without a result"] if missing else []
        mismatched = [f"rank {r.rank}: {len(r.mismatches)} tensors differ or are missing, e.g. {r.mismatches[:3]}"
                      for r in rank_results if r.mismatches]  # fmt: skip
        result.errors += mismatched
        result.verified = not result.errors and all(r.tensors == len(j.select) for r, j in
                                                    zip(sorted(rank_results, key=lambda r: r.rank), jobs))  # fmt: skip
        if rank_results and not result.errors:
            result.wall_s = max(r.finished for r in rank_results) - started
        result.delivered_bytes = sum(r.nbytes for r in rank_results)
        result.peak_rss_ranks_bytes = sampler.peak_rss["ranks"]
        result.max_rank_hwm_bytes = max((r.peak_rss for r in rank_results), default=0)
        if "daemon" in groups:
            result.peak_rss_daemon_bytes = sampler.peak_rss["daemon"]
            result.peak_shm_bytes = sampler.peak_shm
        if served_before is not None:
            result.storage_bytes = served_after - served_before
        elif source.counted_by_readers and jobs[0].mode is not Mode.NAIVE:  # D maps files: not in rchar
            result.storage_bytes = sum(r.rchar for r in rank_results) + daemon_io


def machine_info() -> dict:
    import platform

    import torch

    info = {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count(),
            "torch": torch.__version__}  # fmt: skip
    try:
        from importlib.metadata import version

        info["runai_model_streamer"] = version("runai-model-streamer")
        info["safetensors"] = version("safetensors")
    except Exception:  # noqa: BLE001 - informational
        pass
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
        mem = Path("/proc/meminfo").read_text().split("\n", 1)[0].split()
        info["memory_gib"] = round(int(mem[1]) / 2**20, 1)
    except OSError:
        pass
    info["argv"] = " ".join(sys.argv)
    return info


def loadavg() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
