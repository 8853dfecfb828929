"""What a fresh engine process imports for its first load, beyond torch and numpy.

    python benchmarks/import_time.py [--runs 7] [--device cpu|cuda:0] [--paths in-process,daemon] [--top 20]
                                     [--baseline CHECKOUT]

Each run is a new process, ``python -X importtime``, that imports torch and numpy (and, for a
CUDA device, makes its CUDA context) as an engine has before it loads, then imports
``streamer_client`` and loads a 12 MB sample checkpoint with ``load_state_dict(dir, device=...)``:
in-process (no daemon) and through a daemon this script starts (``--paths``). Every module
imported from then on is the load's: ours (``streamer_client``, ``streamer_service``) and the
rest (the standard library, or a heavy dependency that should not be there).

Bytecode is cached in a private directory (``PYTHONPYCACHEPREFIX``, as an installed package has
its ``.pyc`` files) and one run per path warms it up, not counted. Printed: per path, our modules
by median self time; then one row per path with our total, the other modules' total, both, and
``import torch`` of the same runs as the anchor (ours ÷ torch); with ``--baseline``, the same
for another checkout's code in the same run (all ÷ baseline's; the daemon is this checkout's). Exit status 1 when this
checkout's load imported a heavy module. Figures in docs/benchmarks.md.

Two more columns say what the self times hold and miss: the time our modules spent building their
dataclasses (``dataclasses`` generates each class's methods from source and compiles them: a
cost of the module's own code, inside its self time), and our modules that ``-X importtime``
does not time because ``importlib.import_module`` imported them (the entry point of the
in-process backend, a storage backend), by count.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

OURS = ("streamer_client", "streamer_service")
# What a rank's first load must not import: reported here, refused by tests/test_imports.py.
HEAVY = (
    "pydantic",
    "pydantic_settings",
    "pydantic_core",
    "fastapi",
    "starlette",
    "uvicorn",
    "boto3",
    "botocore",
    "google.cloud",
    "azure",
    "httpx",  # the client speaks HTTP with http.client
    "httpcore",
)
MARK = "_import_time_mark"  # an empty module imported just before streamer_client: the line after which imports count

# Run in a measured process before our imports: ``built`` gets (module.qualname, seconds) for
# every dataclass built from then on (tests/test_imports.py runs it too).
DATACLASS_HOOK = """
import dataclasses, time
build, built = dataclasses._process_class, []  # the one function every @dataclass goes through
def timed(cls, *args, **kwargs):
    started = time.perf_counter()
    try:
        return build(cls, *args, **kwargs)
    finally:
        built.append((cls.__module__ + "." + cls.__qualname__, time.perf_counter() - started))
dataclasses._process_class = timed
"""
RUN = """
import json, sys, torch, numpy
device = sys.argv[2]
if device.startswith("cuda"):
    torch.zeros(1, device=device)  # the CUDA context, and torch's lazy CUDA imports, before the mark
{hook}
import {mark}
import streamer_client
state = streamer_client.load_state_dict(sys.argv[1], device=device)
assert state
ours = [m for m in sys.modules if m.split(".")[0] in {ours}]
print(json.dumps({{"modules": ours, "dataclasses": [1000 * s for m, s in built if m.split(".")[0] in {ours}]}}))
"""
LINE = re.compile(r"import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)")


def one_run(checkpoint: Path, device: str, env: dict[str, str]) -> tuple[dict[str, tuple[float, float]], float, dict]:
    """``{module: (self ms, cumulative ms)}`` of what the load imported, ``import torch`` (ms), and
    ``{"modules": our modules loaded, "dataclasses": ms building each of our dataclasses}``."""
    code = RUN.format(hook=DATACLASS_HOOK, mark=MARK, ours=OURS)
    # Run beside the checkpoint: ``-c`` puts the working directory first on the path, where a
    # checkout's packages would shadow the ones asked for.
    result = subprocess.run([sys.executable, "-X", "importtime", "-c", code, str(checkpoint), device], env=env,
                            cwd=checkpoint.parent, capture_output=True, text=True, timeout=300)  # fmt: skip
    if result.returncode != 0:
        raise SystemExit(f"the load failed:\n{result.stderr[-3000:]}")
    rows = [(int(m[1]) / 1000, int(m[2]) / 1000, m[4]) for m in map(LINE.match, result.stderr.splitlines()) if m]
    torch_ms = next(cumulative for _, cumulative, name in rows if name == "torch")
    after = rows[next(i for i, row in enumerate(rows) if row[2] == MARK) + 1 :]
    extra = json.loads(result.stdout.strip().splitlines()[-1])
    return {name: (self_ms, cumulative) for self_ms, cumulative, name in after}, torch_ms, extra


def measure(checkpoint: Path, device: str, env: dict[str, str], runs: int) -> tuple[list[dict], list[float], list[dict]]:
    one_run(checkpoint, device, env)  # compiles and caches our bytecode: not counted
    results = [one_run(checkpoint, device, env) for _ in range(runs)]
    return [r[0] for r in results], [r[1] for r in results], [r[2] for r in results]


def is_ours(name: str) -> bool:
    return name.split(".")[0] in OURS


def is_heavy(name: str) -> bool:
    return any(name == h or name.startswith(h + ".") for h in HEAVY)


def report(path: str, runs: list[dict], torch_ms: list[float], extras: list[dict], top: int) -> dict:
    names = sorted({name for run in runs for name in run})
    median = {name: (statistics.median(run.get(name, (0, 0))[0] for run in runs),
                     statistics.median(run.get(name, (0, 0))[1] for run in runs)) for name in names}  # fmt: skip
    ours = sorted((n for n in names if is_ours(n)), key=lambda n: -median[n][0])
    print(f"\n{path}: our modules, median of {len(runs)} runs (ms)")
    print(f"| {'module':<40} | {'self':>7} | {'cumulative':>10} |")
    print(f"| {'-' * 40} | {'-' * 6}: | {'-' * 9}: |")
    for name in ours[:top]:
        print(f"| {name:<40} | {median[name][0]:7.2f} | {median[name][1]:10.2f} |")
    if len(ours) > top:
        rest = sum(median[n][0] for n in ours[top:])
        print(f"| {f'{len(ours) - top} more':<40} | {rest:7.2f} | {'':>10} |")
    total_ours = statistics.median(sum(s for n, (s, _) in run.items() if is_ours(n)) for run in runs)
    total_other = statistics.median(sum(s for n, (s, _) in run.items() if not is_ours(n)) for run in runs)
    heavy = sorted({n.split(".")[0] for run in runs for n in run if is_heavy(n)})
    others = sorted((n for n in names if not is_ours(n)), key=lambda n: -median[n][0])[:5]
    untimed = sorted({m for extra in extras for m in extra["modules"]} - set(names))
    if untimed:
        print(f"not timed by -X importtime (imported by importlib.import_module): {', '.join(untimed)}")
    return {
        "path": path, "ours": total_ours, "modules": len(ours), "other": total_other, "others": others,
        "torch": statistics.median(torch_ms), "heavy": heavy, "untimed": len(untimed),
        "dataclasses": statistics.median(sum(extra["dataclasses"]) for extra in extras),
        "classes": statistics.median(len(extra["dataclasses"]) for extra in extras),
    }  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--paths", default="in-process,daemon")
    parser.add_argument("--top", type=int, default=20, help="rows of our modules per path")
    parser.add_argument(
        "--baseline", type=Path, help="another checkout (git worktree add /tmp/base main): the same rows, same run"
    )
    args = parser.parse_args()
    paths = args.paths.split(",")
    if not set(paths) <= {"in-process", "daemon"}:
        raise SystemExit(f"--paths: in-process and/or daemon, not {args.paths!r}")

    from streamer_service.daemon.server import ChildDaemon
    from streamer_service.sample import build_sample

    with tempfile.TemporaryDirectory(prefix="import-time-") as tmp:
        work = Path(tmp)
        checkpoint = work / "checkpoint"
        build_sample(checkpoint, size_mb=12)
        (work / "mark").mkdir()
        (work / "mark" / f"{MARK}.py").write_text("")
        env = {k: v for k, v in os.environ.items() if k not in ("STREAMER_SOCKET", "PYTHONDONTWRITEBYTECODE")}
        env.update(PYTHONPYCACHEPREFIX=str(work / "pyc"), STREAMER_CACHE_DIR=str(work / "cache"), STREAMER_PROGRESS="off")
        # Absolute: each run's working directory is the checkpoint's.
        base = args.baseline.resolve() if args.baseline else None
        checkouts = [("", [])] + ([(" (baseline)", [str(base), str(base / "client")])] if base else [])
        summaries = {}
        for label, code in checkouts:
            # The baseline's packages come first on the path, before this venv's installed ones.
            code_env = {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(work / "mark"), *code, env.get("PYTHONPATH")]))}
            for path in paths:
                if path == "in-process":
                    measured = measure(checkpoint, args.device, code_env, args.runs)
                else:
                    root = work / f"daemon{len(summaries)}"
                    root.mkdir()
                    # This checkout's daemon serves the baseline's ranks too: only the rank's imports are measured.
                    daemon = ChildDaemon(root, "256MiB", env={"STREAMER_CACHE_DIR": env["STREAMER_CACHE_DIR"]})
                    try:
                        measured = measure(checkpoint, args.device, {**code_env, **daemon.env()}, args.runs)
                    finally:
                        daemon.close()
                summaries[path + label] = report(path + label, *measured, args.top)

    print(
        f"\nImports of a first load on {args.device}, beyond torch and numpy (median ms; python {sys.version.split()[0]}, {os.cpu_count()} CPUs)"
    )
    print(
        "| path | ours (self) | of it, our dataclasses | our modules (+ not timed) | other modules (self) | largest others "
        "| all | `import torch` | ours ÷ torch | all ÷ baseline's | heavy imported |"
    )
    print("| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | --- |")
    for name, s in summaries.items():
        base = summaries.get(f"{name} (baseline)")
        ratio = f"{(s['ours'] + s['other']) / (base['ours'] + base['other']):.2f}" if base else "-"
        print(f"| {name} | {s['ours']:.1f} | {s['dataclasses']:.1f} ({s['classes']:.0f}) | {s['modules']} (+ {s['untimed']}) | "
              f"{s['other']:.1f} | {', '.join(s['others']) or '-'} | {s['ours'] + s['other']:.1f} | {s['torch']:.0f} | "
              f"{s['ours'] / s['torch']:.3f} | {ratio} | {', '.join(s['heavy']) or 'none'} |")  # fmt: skip
    return 1 if any(summaries[path]["heavy"] for path in paths) else 0


if __name__ == "__main__":
    sys.exit(main())
