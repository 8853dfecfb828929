"""``streamer-service bench``: our daemon against what engines do today, on one checkpoint.

Contenders (each rank a real process; see docs/benchmarks.md):

- A: N rank processes, each with plain Run:ai ``SafetensorsStreamer`` on its own selection;
- B: N rank processes through the node daemon (``streamer_client.stream``);
- C: embedded mode, one process loading the union of the selections;
- D: naive: the cloud SDK downloads the checkpoint to local disk, then each rank loads its
  selection with ``safetensors`` (from a local source: no download).

Scenarios (:mod:`.scenarios`): replicated, TP-like, disjoint. Sources (:mod:`.sources`): a
local dir, moto, SeaweedFS, fake-gcs-server, Azurite; ``--latency-ms`` holds every request of an object-storage
source (:mod:`.latency`). Numbers (:mod:`.measure`) come from the kernel and the storage server,
never from our own counters. Modules: ``sources``, ``scenarios``, ``ranks`` (the rank processes),
``measure``, ``runner``, ``report``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import sys
import tempfile
from pathlib import Path

__all__ = ["add_arguments", "run"]

QUICK = {"sources": "local,seaweed", "size": "32MB", "ranks": "2", "reps": 1, "warmup": 0}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--source",
        default="local,seaweed",
        help="comma list of local, moto, seaweed, gcs, azure (default local,seaweed; azure: through benchmarks/azure_bench.py)",
    )
    parser.add_argument("--size", default="2GiB", help="checkpoint size, e.g. 2GiB, 500MB (default 2GiB)")
    parser.add_argument("--ranks", default="1,2,4", help="comma list of rank counts (default 1,2,4)")
    parser.add_argument("--scenarios", default="replicated,tp,disjoint", help="comma list (default: all three)")
    parser.add_argument("--modes", default="A,B,C,D", help="comma list of contenders A-D (default: all)")
    parser.add_argument("--reps", type=int, default=3, help="timed repetitions (default 3)")
    parser.add_argument("--warmup", type=int, default=1, help="warm-up repetitions, every byte checked (default 1)")
    parser.add_argument("--full-check", action="store_true", help="check every byte in timed repetitions too")
    parser.add_argument(
        "--borrowed",
        action="store_true",
        help="ranks take zero-copy views (A: owned=False, B and C: borrowed=True); D still copies",
    )
    parser.add_argument(
        "--runai-concurrency",
        type=int,
        default=0,
        help="RUNAI_STREAMER_CONCURRENCY for A, B and C (default 0: Run:ai's own, 8 from object storage)",
    )
    parser.add_argument(
        "--latency-ms",
        type=float,
        default=0.0,
        help="hold every storage request this long before the server sees it (a latency proxy on "
        "loopback; object-storage sources only; default 0: none)",
    )
    parser.add_argument("--retention-budget", default="0", help="the bench daemon's STREAMER_RETENTION_BUDGET (default 0: off)")
    parser.add_argument("--runai-chunk", help="RUNAI_STREAMER_CHUNK_BYTESIZE for A, B and C (default: Run:ai's)")
    parser.add_argument("--shm-budget", default="1GiB", help="the bench daemon's shared-memory budget (default 1GiB)")
    parser.add_argument("--work-dir", type=Path, help="keep the checkpoint and server data here (default: a temp dir)")
    parser.add_argument("--json", nargs="?", const="-", metavar="PATH", help="write JSON to PATH (or stdout: '-')")
    parser.add_argument(
        "--quick", action="store_true", help="smoke test: local + seaweed, 32 MB, N=2, one repetition, every byte checked"
    )
    parser.add_argument(
        "--check-targets",
        action="store_true",
        help="a time B÷A over its target fails the run too (exit 1); without it the exit status says only whether "
        "the run was correct",
    )


def _config(args: argparse.Namespace, work: Path):
    from streamer_client._settings import byte_size

    from ..readers.runai import BUFFERED_FS_STRATEGY
    from .ranks import Mode
    from .runner import BenchConfig
    from .scenarios import Scenario

    if args.quick:
        args.source, args.size, args.ranks = QUICK["sources"], QUICK["size"], QUICK["ranks"]
        args.reps, args.warmup, args.full_check = QUICK["reps"], QUICK["warmup"], True

    def split(text: str) -> list[str]:
        return [part.strip() for part in text.split(",") if part.strip()]

    runai_env = {"RUNAI_STREAMER_FS_STRATEGY": BUFFERED_FS_STRATEGY}  # what our engine uses; A gets the same
    if args.runai_concurrency:
        runai_env["RUNAI_STREAMER_CONCURRENCY"] = str(args.runai_concurrency)
    if args.runai_chunk:
        runai_env["RUNAI_STREAMER_CHUNK_BYTESIZE"] = str(byte_size()(args.runai_chunk))
    ranks = tuple(int(n) for n in split(args.ranks))
    if not ranks or min(ranks) < 1 or args.reps < 1 or args.warmup < 0 or args.latency_ms < 0:
        raise ValueError("--ranks needs counts >= 1, --reps >= 1, --warmup >= 0, --latency-ms >= 0")
    return BenchConfig(
        sources=tuple(split(args.source)),
        size_bytes=byte_size()(args.size),
        ranks=ranks,
        scenarios=tuple(Scenario(s) for s in split(args.scenarios)),
        modes=tuple(Mode(m.upper()) for m in split(args.modes)),
        reps=args.reps,
        warmup=args.warmup,
        full_check=args.full_check,
        borrowed=args.borrowed,
        runai_env=runai_env,
        shm_budget=args.shm_budget,
        work_dir=work,
        latency_s=args.latency_ms / 1000,
        retention_budget=args.retention_budget,
    )


def run(args: argparse.Namespace) -> int:
    from .ranks import Mode
    from .report import TIME_TARGETS, Progress, format_tables, ratios, summarize, verdict
    from .runner import Bench, loadavg, machine_info
    from .sources import SOURCES

    # A bench stopped with SIGTERM still stops its servers and daemon and removes its shared memory.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with tempfile.TemporaryDirectory(prefix="streamer-bench-") as tmp:
        work = args.work_dir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        try:
            config = _config(args, work)
        except ValueError as exc:
            print(f"streamer-service bench: {exc}", file=sys.stderr)
            return 2
        unknown = [s for s in config.sources if s not in SOURCES]
        if unknown:
            print(f"streamer-service bench: unknown source {unknown[0]!r}; choose from {', '.join(SOURCES)}", file=sys.stderr)
            return 2
        if {"gcs", "azure"} & set(config.sources) and Mode.NAIVE in config.modes:
            print(
                "streamer-service bench: contender D downloads with boto3: not from the 'gcs' or 'azure' source", file=sys.stderr
            )
            return 2
        if config.latency_s and "local" in config.sources:
            print(
                "streamer-service bench: --latency-ms needs object-storage sources (moto, seaweed), not 'local'", file=sys.stderr
            )
            return 2
        bench = Bench(config, None)
        progress = Progress(bench.plan_total())
        bench.progress = progress
        load_before = loadavg()
        results = bench.run()
        load_after = loadavg()

    rows = summarize(results)
    ratio_rows = ratios(rows)
    machine = machine_info()
    judged = verdict(
        results,
        ratio_rows,
        cpus=machine.get("cpus"),
        checkpoint_bytes=bench.catalog.total_bytes,
        check_targets=args.check_targets,
    )
    tables = format_tables(rows, ratio_rows, judged.time_word)
    report = {
        "machine": machine,
        "loadavg_before": load_before,
        "loadavg_after": load_after,
        "config": {
            "sources": {name: bench.sources.get(name) for name in config.sources},
            "checkpoint_bytes": bench.catalog.total_bytes,
            "tensors": len(bench.catalog.tensors),
            "ranks": list(config.ranks),
            "scenarios": [s.value for s in config.scenarios],
            "modes": [m.value for m in config.modes],
            "reps": config.reps,
            "warmup": config.warmup,
            "runai_env": config.runai_env,
            "shm_budget": config.shm_budget,
            "retention_budget": config.retention_budget,
            "latency_ms": config.latency_s * 1000,
            "borrowed": config.borrowed,
            "check_targets": args.check_targets,
        },
        "started": bench.started,
        "ok": judged.ok,
        "correct": judged.correct,
        "verified": judged.verified,
        "missed_byte_ratios": judged.missed_byte_ratios,
        "time_targets": {"set_for": TIME_TARGETS.set_for, "hold": judged.targets_hold, "shown_as": judged.time_word},
        "missed_time_targets": judged.missed_time_targets,
        "summary": [dataclasses.asdict(r) for r in rows],
        "ratios": [dataclasses.asdict(r) for r in ratio_rows],
        "runs": [r.as_dict() for r in results],
    }
    cpus = machine.get("cpus")
    header = (
        f"{cpus} CPUs; checkpoint {bench.catalog.total_bytes / 1e9:.2f} GB ({len(bench.catalog.tensors)} tensors); "
        f"Run:ai env for A, B, C: {config.runai_env}; buffer budget (B's daemon, C) {config.shm_budget}; "
        + (f"retention budget (B's daemon) {config.retention_budget}; " if config.retention_budget not in ("", "0") else "")
        + (f"every storage request held {config.latency_s * 1000:g} ms (latency proxy); " if config.latency_s else "")
        + f"ranks take {'zero-copy views' if config.borrowed else 'owned tensors'}; "
        f"medians of {config.reps} after {config.warmup} warm-up; load average {load_before[0]:.2f} -> {load_after[0]:.2f}"
    )
    out = sys.stdout
    if args.json:
        if args.json == "-":
            json.dump(report, sys.stdout, indent=1)
            sys.stdout.write("\n")
            out = sys.stderr
        else:
            Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    print(f"\n{header}\n\n{tables}\n", file=out)
    for line in judged.lines():
        print(line, file=out)
    return 0 if judged.ok else 1
