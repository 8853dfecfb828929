"""A fresh engine process's first load, every loader side by side: what a user waits for.

    python benchmarks/cold_start.py [--size-gb 6.44] [--procs 3] [--reloads 2] [--disk-dir /tmp]
                                    [--thp-dir /mnt/thp] [--rows "PREFIX;..."] [--profile] [--json PATH]
                                    [--baseline CHECKOUT]

Every row's load is the first of a NEW process that has already imported torch, made its CUDA
context and imported the loader's module (``streamer_client``, ``instanttensor``,
``fastsafetensors``, ``runai_model_streamer``), as an engine has before it loads, and then waits
for a go signal. The clock runs from just before the load call to ``torch.cuda.synchronize()``;
the tensors are kept on cuda:0 until it stops. Each process then checks every tensor bit-exact
(a position-weighted checksum of its bytes against the one ``safetensors`` gives for the file)
and reloads ``--reloads`` times (each timed the same way, after dropping the previous load): the
reload column. Rows run in rounds (one process of every row per round, one round not counted
first: it compiles bytecode, fills the metadata cache and primes the daemons), so that the
machine's drift falls on every row alike. Medians over ``--procs`` processes.

The checkpoint: ``--size-gb`` of random bf16 (never zeros): a 1 GiB embedding, layers of four
32 MiB matrices and two f32 norms, 4 shards and an index, written to ``--disk-dir`` (read back
once: the page-cache rows), copied to ``/dev/shm`` (4 KiB pages) and, with ``--thp-dir`` (a tmpfs
mounted ``huge=always``), there too.

With 4 ranks (replicated: every rank loads every tensor, all on cuda:0) a row's time is the wall
from the first rank's start to the last rank's end. ``--profile`` adds one process per row of
ours whose first load runs under ``cProfile`` (time split by stage) after the rounds.
``--baseline`` (another checkout: ``git worktree add /tmp/base main``) adds, before each row of
ours, the same row whose processes import that checkout's ``streamer_client`` and
``streamer_service`` instead (the daemons are this checkout's): an A/B in one run, each round
running both, the twins swapping places every other round.
Prints the machine, then one table last. GB = 1e9 bytes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GB = 1e9
MIB = 2**20
HIDDEN = 4096
MATRIX = HIDDEN * HIDDEN * 2  # one 32 MiB bf16 weight matrix
EMBED_ROWS = 131072  # a 1 GiB bf16 embedding
SHARDS = 4
RUNAI_ENV = {"RUNAI_STREAMER_FS_STRATEGY": "sync_buffered"}  # Run:ai's page-cache reader
DEVICE = "cuda:0"  # the orchestrator's (--device)
MODULES = {"ours": "streamer_client", "instanttensor": "instanttensor", "fastsafetensors": "fastsafetensors",
           "runai": "runai_model_streamer"}  # fmt: skip


# =========================================================================== the worker (a fresh process)
# Imports nothing but the standard library at module level: the worker's process imports torch and
# the loader's module itself, before the go signal.


def load(kind: str, directory: str, device: str, rank: int, world: int, session: str) -> dict:
    """One load by ``kind``, every tensor kept on ``device``: each loader's public API as a user calls it."""
    import torch

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

        with safe_open(files, framework="pt", device=torch.device(device).index) as f:
            return dict(f.tensors())  # copy=True (its default): tensors that own their memory
    if kind == "fastsafetensors":
        from fastsafetensors import fastsafe_open

        with fastsafe_open(files, framework="pt", device=device, nogds=True) as f:
            return {name: f.get_tensor(name) for name in f.keys()}  # they keep their buffer alive
    import streamer_client  # embedded without STREAMER_SOCKET, the daemon with it

    return streamer_client.load_state_dict(directory, device=device, rank=rank, world_size=world, session=session)


_WEIGHTS: dict = {}


def checksum(tensor) -> tuple[int, int]:
    """(sum, position-weighted sum) of a tensor's bytes as 32-bit words (bytes where the size is
    not a multiple of 4), on its device: equal for equal bytes, and a zeroed, shifted or swapped
    range changes it."""
    import torch

    flat = tensor.contiguous().reshape(-1).view(torch.uint8)
    words = (flat.view(torch.int32) if flat.numel() % 4 == 0 else flat).to(torch.int64)
    n = words.numel()
    key = str(flat.device)
    if _WEIGHTS.get(key) is None or _WEIGHTS[key].numel() < n:
        _WEIGHTS[key] = torch.arange(max(n, 1 << 20), dtype=torch.int64, device=flat.device) % 65521 + 1
    return int(words.sum()), int((words * _WEIGHTS[key][:n]).sum())


def check(state: dict, truth: dict) -> int:
    """How many tensors differ from ``truth`` (``{name: [dtype, shape, sum, weighted]}``); a
    missing or extra name counts too."""
    bad = len(set(state) ^ set(truth))
    for name, tensor in state.items():
        want = truth.get(name)
        if want is None:
            continue
        got = [str(tensor.dtype), list(tensor.shape), *checksum(tensor)]
        bad += got != want
    return bad


def synchronize(device: str) -> None:
    import torch

    if device != "cpu":
        torch.cuda.synchronize(device)


def worker(args) -> None:
    import torch

    device = args.device
    if device != "cpu":  # (cpu: a dry run of the orchestration where there is no GPU)
        torch.cuda.set_device(device)
    torch.zeros(1, device=device)  # the CUDA context
    __import__(MODULES["ours" if args.kind.startswith("ours") else args.kind])
    truth = json.loads(Path(args.truth).read_text())
    if args.reserve:  # a diagnostic: the caching allocator holds the load's bytes before the clock
        nbytes = 0
        for dtype, shape, *_ in truth.values():
            n = getattr(torch, dtype.split(".")[-1]).itemsize
            for d in shape:
                n *= d
            nbytes += -(-n // 512) * 512
        del_me = torch.empty(nbytes, dtype=torch.uint8, device=device)
        del del_me
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return
    print(IMPORT_MARK, file=sys.stderr, flush=True)  # with -X importtime: what follows is the load's
    kind = "ours" if args.kind.startswith("ours") else args.kind
    loads = []
    for i in range(1 + args.reloads):
        session = f"{args.session}-{i}"
        if args.profile and i == 0:
            start, end, first, state, split = profiled(kind, args, session)
        else:
            start = time.time()  # one clock for every process of the machine (4-rank walls)
            state = load(kind, args.dir, device, args.rank, args.world, session)
            synchronize(device)
            end = time.time()
            first, split = None, None
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        loads.append({"start": start, "end": end, "bytes": nbytes, "bad": check(state, truth), "first": first, "split": split})
        del state
        if device != "cpu":
            torch.cuda.empty_cache()
    print("result " + json.dumps(loads), flush=True)


# Stages of our first load, each the cumulative time of the functions that do it (cProfile sees
# the loading thread; the copier's threads are waited for in copier.wait).
STAGES = {
    "import": ("<frozen importlib._bootstrap>:_find_and_load",),
    "catalog+plan": ("checkpoint.py:open_checkpoint", "versions.py:of", "engine.py:plan", "ring_load.py:ring_for"),
    "join/next (daemon)": ("_connection.py:call",),
    "copier wait": ("_native_copier.py:wait",),
    "H2D queue": ("_cuda.py:copy_pieces",),  # every device copy is queued there (copy_into too)
    "torch.empty": ("_cuda.py:empty", "_delivery.py:empty"),
    # Registrations on the loading thread (the staging ring, the engine's slots, PinnedCopier.register)
    # all reach host_register; a segment's is made on a worker thread and waited for in pinned.
    "registration": ("_pinning.py:host_register", "_segments.py:pinned"),
    "fence/drain": ("_cuda.py:wait_one", "_cuda.py:drain"),
    "unmap": ("_native_copier.py:unmap",),
    "synchronize": ("__init__.py:synchronize",),
}


def profiled(kind: str, args, session: str):
    """The first load under cProfile: (start, end, seconds to the first tensor, state, stage split)."""
    import cProfile
    import io
    import pstats

    import streamer_client

    profile = cProfile.Profile()
    start = time.time()
    profile.enable()
    state, first = {}, None
    for name, tensor in streamer_client.stream(
        args.dir, device=args.device, rank=args.rank, world_size=args.world, session=session
    ):
        if first is None:
            first = time.time() - start
        state[name] = tensor
    synchronize(args.device)
    profile.disable()
    end = time.time()
    stats = pstats.Stats(profile)
    split = {}
    for stage, suffixes in STAGES.items():
        seconds = 0.0
        for (file, _, func), (_, _, _, cumulative, _) in stats.stats.items():
            where = f"{file.rsplit('/', 1)[-1]}:{func}" if not file.startswith("<") else f"{file}:{func}"
            if where in suffixes:  # (cProfile counts a recursive function's outermost calls only)
                seconds += cumulative
        split[stage] = round(seconds, 4)
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(45)
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(25)
    if args.profile_out:
        Path(args.profile_out).write_text(text.getvalue())
    return start, end, first, state, split


# =========================================================================== the orchestrator


def write_checkpoint(directory: Path, size_gb: float, device: str, embed_rows: int = EMBED_ROWS) -> int:
    """Random bf16 (made on ``device``): an embedding of ``embed_rows`` x 4096, layers of 4 matrices
    and 2 f32 norms up to ``size_gb``, in 4 shards with an index; its bytes."""
    import torch
    from safetensors.torch import save_file

    rows = min(embed_rows, int(size_gb * GB / 6 / (HIDDEN * 2)))  # (smaller only in a small dry run)
    layers = max(1, round((size_gb * GB - rows * HIDDEN * 2) / (4 * MATRIX)))
    specs = [("model.embed_tokens.weight", (rows, HIDDEN), torch.bfloat16)]
    for i in range(layers):
        specs += [
            (f"model.layers.{i}.{p}.weight", (HIDDEN, HIDDEN), torch.bfloat16)
            for p in ("attn.qkv", "attn.o", "mlp.up", "mlp.down")
        ]
        specs += [(f"model.layers.{i}.{p}.weight", (HIDDEN,), torch.float32) for p in ("input_norm", "post_norm")]
    per_shard = -(-len(specs) // SHARDS)
    weight_map, total = {}, 0
    g = torch.Generator(device=device).manual_seed(24)
    for s in range(SHARDS):
        name = f"model-{s + 1:05d}-of-{SHARDS:05d}.safetensors"
        tensors = {}
        for tname, shape, dtype in specs[s * per_shard : (s + 1) * per_shard]:
            nbytes = dtype.itemsize
            for d in shape:
                nbytes *= d
            bits = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device, generator=g)
            tensors[tname] = bits.view(dtype).reshape(shape).cpu()
            weight_map[tname] = name
            total += nbytes
        save_file(tensors, str(directory / name))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return total


def ground_truth(directory: Path, device: str) -> dict:
    """``{name: [dtype, shape, sum, weighted]}`` from safetensors' own read of the files."""
    from safetensors import safe_open

    truth = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="pt", device=device) as f:
            for name in f.keys():
                t = f.get_tensor(name)
                truth[name] = [str(t.dtype), list(t.shape), *checksum(t)]
    _WEIGHTS.clear()
    return truth


@dataclass
class Row:
    name: str  # the label printed
    kind: str  # the loader (MODULES)
    source: str  # "disk" (page cache), "4k" (/dev/shm) or "thp" (the huge=always tmpfs)
    daemon: str | None = None  # which daemon's env the ranks get ("...-thp": its shm on the huge=always tmpfs)
    pin: str | None = None  # the ranks' STREAMER_PIN_SEGMENTS (None: the default, auto)
    world: int = 1
    independent: bool = False  # ``world`` processes, each its own load (world_size 1)
    reserve: bool = False  # diagnostic: the load's device memory allocated and freed before the clock
    checkout: Path | None = None  # the ranks import this checkout's packages (--baseline)
    failed: str = ""  # why its processes failed (it is left out from then on)
    target: str = ""
    loads: list = field(default_factory=list)  # per counted round: [per process: [first, reloads...]]


def rows_for(thp: bool) -> list[Row]:
    rows = [
        Row("InstantTensor 0.2.2, tmpfs (4 KiB)", "instanttensor", "4k"),
        Row("ours, embedded, tmpfs (4 KiB)", "ours", "4k", target=">= 1.0 x IT 4k"),
        Row("  the same, its device memory reserved before the clock (diagnostic)", "ours", "4k", reserve=True),
        Row("InstantTensor 0.2.2, huge=always tmpfs", "instanttensor", "thp"),
        Row("ours, embedded, huge=always tmpfs", "ours", "thp", target=">= 1.0 x IT thp"),
        Row("fastsafetensors 0.5.0 (nogds), tmpfs (4 KiB)", "fastsafetensors", "4k"),
        Row("ours, embedded, page cache", "ours", "disk", target=">= 25 GB/s"),
        Row("plain Run:ai sync_buffered -> .to(cuda), page cache", "runai", "disk"),
        Row("daemon warm restart: retained, new session, fresh rank, /dev/shm (4 KiB)", "ours", "disk", daemon="retain-4k",
            target=">= 0.9 x IT 4k"),
        Row("the same, daemon's shm on huge=always tmpfs", "ours", "disk", daemon="retain-thp"),
        Row("  the same, staged (STREAMER_PIN_SEGMENTS=never) (diagnostic)", "ours", "disk", daemon="retain-thp",
            pin="never"),
        Row("daemon, 1 rank, cold on a warm daemon, page cache", "ours", "disk", daemon="plain", target=">= 25 GB/s"),
        Row("  the same, its 4 KiB segments page-locked (STREAMER_PIN_SEGMENTS=always) (diagnostic)", "ours", "disk",
            daemon="plain", pin="always"),
        Row("  the same, daemon's shm on huge=always tmpfs: its segments page-locked (diagnostic)", "ours", "disk",
            daemon="plain-thp"),
        Row("  the same, staged instead (STREAMER_PIN_SEGMENTS=never) (diagnostic)", "ours", "disk", daemon="plain-thp",
            pin="never"),
        Row("daemon, 4 fresh ranks replicated, page cache (wall)", "ours", "disk", daemon="plain", world=4,
            target="<= 0.25 x Run:ai x4"),
        Row("  the same, 4 ranks, their 4 KiB segments page-locked (STREAMER_PIN_SEGMENTS=always) (diagnostic)", "ours",
            "disk", daemon="plain", world=4, pin="always"),
        Row("  the same, 4 ranks, daemon's shm on huge=always tmpfs: segments page-locked (diagnostic)", "ours", "disk",
            daemon="plain-thp", world=4),
        Row("plain Run:ai, 4 independent fresh ranks, page cache (wall)", "runai", "disk", world=4, independent=True),
    ]  # fmt: skip
    return [r for r in rows if thp or (r.source != "thp" and not on_thp(r))]


def on_thp(row: Row) -> bool:
    """Whether the row's daemon keeps its shared memory on the huge=always tmpfs."""
    return (row.daemon or "").endswith("-thp")


BASELINE = " [baseline]"  # a --baseline twin's name: its row's, and this


def with_checkout(row: Row, checkout: Path) -> Row:
    """``row`` with its ranks on another checkout's code (``--baseline``), named so; no target."""
    return dataclasses.replace(row, name=row.name + BASELINE, checkout=checkout.resolve(), target="", loads=[])


def round_order(rows: list[Row], rnd: int) -> list[Row]:
    """The rows of round ``rnd``: a ``--baseline`` twin runs before its row in odd rounds and after
    it in even ones, so that neither is always the one that follows the other rows (a daemon that
    idled meanwhile has trimmed its segments, docs/deploy.md)."""
    if rnd % 2:
        return rows
    order = list(rows)
    for i in range(len(order) - 1):
        if order[i].checkout is not None and order[i].name == order[i + 1].name + BASELINE:
            order[i], order[i + 1] = order[i + 1], order[i]
    return order


def spawn(row: Row, directory: Path, truth: Path, env: dict, rank: int, session: str, reloads: int,
          profile_out: Path | None = None, importtime: bool = False) -> subprocess.Popen:  # fmt: skip
    world = 1 if row.independent else row.world
    cmd = [sys.executable, *(["-X", "importtime"] if importtime else []), __file__, "--worker", row.kind, "--dir", str(directory), "--truth", str(truth),
           "--rank", str(0 if row.independent else rank), "--world", str(world), "--session", session,
           "--reloads", str(reloads), "--device", DEVICE]  # fmt: skip
    if profile_out is not None:
        cmd += ["--profile", "--profile-out", str(profile_out)]
    if row.reserve:
        cmd.append("--reserve")
    if row.checkout is not None:  # its packages first on the path, before this checkout's
        env = dict(env, PYTHONPATH=os.pathsep.join([str(row.checkout / "client"), str(row.checkout), env["PYTHONPATH"]]))
    return start_worker(cmd, env)


def start_worker(cmd: list[str], env: dict) -> subprocess.Popen:
    """A worker process that says ``ready`` on stdout, waits for ``go`` on stdin, and ends with a
    ``result <json>`` line; its stderr to a file (``-X importtime`` writes thousands of lines
    before the worker is ready). :func:`released_together` runs a group of them."""
    stderr = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, text=True)
    proc.stderr_file = stderr
    return proc


def _stderr(proc: subprocess.Popen) -> str:
    proc.stderr_file.seek(0)
    return proc.stderr_file.read()


def released_together(procs: list[subprocess.Popen], name: str, timeout: float) -> list[tuple[object, str]]:
    """Wait until every worker of ``procs`` (:func:`start_worker`) is ready, release them with one
    ``go`` each, and return each one's last result with its stderr, in order; ``SystemExit``
    naming ``name`` where one did not start or failed. None of them is left running."""
    try:
        for p in procs:
            if p.stdout.readline().strip() != "ready":
                p.wait(timeout=60)
                raise SystemExit(f"{name}: a worker did not start:\n{_stderr(p)[-3000:]}")
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        out = []
        for p in procs:
            stdout, _ = p.communicate(timeout=timeout)
            stderr = _stderr(p)
            result = [line for line in stdout.splitlines() if line.startswith("result ")]
            if p.returncode != 0 or not result:
                raise SystemExit(f"{name}: a worker failed ({p.returncode}):\n{stderr[-3000:]}")
            out.append((json.loads(result[-1][len("result ") :]), stderr))
        return out
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            p.stderr_file.close()


def run_row(row: Row, directory: Path, truth: Path, env: dict, session: str, reloads: int,
            profile_out: Path | None = None, importtime: bool = False) -> list[list[dict]]:  # fmt: skip
    """One go of a row: ``world`` fresh processes, started together once every one is ready.
    With ``importtime``, each process's loads carry ``import_s``: what its first load imported."""
    procs = [spawn(row, directory, truth, env, r, session, reloads, profile_out, importtime) for r in range(row.world)]
    out = []
    for result, stderr in released_together(procs, row.name, timeout=300):
        if importtime:
            result[0]["import_s"] = imported_seconds(stderr)
        out.append(result)
    return out


IMPORT_MARK = "cold-start: go"
_IMPORT_LINE = re.compile(r"import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)")


def imported_seconds(stderr: str) -> float:
    """Seconds of the imports after the go signal (``-X importtime``: the top-level entries)."""
    _, _, after = stderr.partition(IMPORT_MARK)
    lines = [m for m in map(_IMPORT_LINE.match, after.splitlines()) if m]
    top = min((len(m[3]) for m in lines), default=0)
    return sum(int(m[2]) for m in lines if len(m[3]) == top) / 1e6


def wall(procs: list[list[dict]], i: int) -> tuple[float, int]:
    """Load ``i`` of one go: (seconds from the first start to the last end, bytes per rank)."""
    return max(p[i]["end"] for p in procs) - min(p[i]["start"] for p in procs), procs[0][i]["bytes"]


def machine(dirs: dict[str, Path]) -> str:
    import torch

    if DEVICE == "cpu":
        return f"no GPU (dry run); {os.cpu_count()} CPUs; page size {os.sysconf('SC_PAGE_SIZE')} B"
    props = torch.cuda.get_device_properties(0)
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=30).stdout.split()[0]  # fmt: skip
    except (OSError, IndexError, subprocess.SubprocessError):
        driver = "?"
    mounts = {}
    try:
        table = [line.split() for line in Path("/proc/mounts").read_text().splitlines()]
    except OSError:
        table = []
    for label, path in dirs.items():
        best = max((m for m in table if len(m) > 3 and str(path).startswith(m[1])), key=lambda m: len(m[1]), default=None)
        mounts[label] = (
            f"{path} ({best[2]}, {'huge=' + next((o[5:] for o in best[3].split(',') if o.startswith('huge=')), 'never')})"
            if best
            else str(path)
        )
    try:
        shmem_thp = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled").read_text().strip()
    except OSError:
        shmem_thp = "?"
    return (f"{torch.cuda.device_count()} x {props.name} ({props.total_memory / 2**30:.0f} GiB), driver {driver}; "
            f"{os.cpu_count()} CPUs ({len(os.sched_getaffinity(0))} usable); page size {os.sysconf('SC_PAGE_SIZE')} B; "
            f"shmem THP: {shmem_thp}; torch {torch.__version__} (CUDA {torch.version.cuda}); Python {platform.python_version()}; "
            f"kernel {platform.release()}; dirs: " + "; ".join(f"{k} {v}" for k, v in mounts.items()))  # fmt: skip


def median_rate(values: list[tuple[float, int]]) -> tuple[float, float]:
    """(median seconds, GB/s at that median)."""
    seconds = statistics.median(s for s, _ in values)
    return seconds, values[0][1] / seconds / GB


def table(rows: list[Row]) -> list[dict]:
    """One line per row: first loads (median s, GB/s, x IT of the same pages), reloads, target."""
    firsts = {r.name: median_rate([wall(go, 0) for go in r.loads]) for r in rows if r.loads}
    reloads = {r.name: median_rate([wall(go, i) for go in r.loads for i in range(1, len(go[0]))]) for r in rows
               if r.loads and len(r.loads[0][0]) > 1}  # fmt: skip
    it = {
        src: firsts.get(f"InstantTensor 0.2.2, {where}") for src, where in (("4k", "tmpfs (4 KiB)"), ("thp", "huge=always tmpfs"))
    }
    runai4 = firsts.get("plain Run:ai, 4 independent fresh ranks, page cache (wall)")
    out = []
    print()
    print(f"{'path (every load the first of a fresh process; medians)':<78} {'first s':>8} {'GB/s':>7} {'x IT':>6} "
          f"{'reload GB/s':>12} {'bad':>4}  target")  # fmt: skip
    for r in rows:
        if r.name not in firsts:
            continue
        seconds, rate = firsts[r.name]
        anchor = it.get("thp" if r.source == "thp" or on_thp(r) else "4k")
        ratio = (anchor[0] / seconds) if anchor else None
        again = reloads.get(r.name, (None, None))[1]
        bad = sum(load["bad"] for go in r.loads for proc in go for load in proc)
        met = ""
        if r.target.startswith(">= 25"):
            met = "met" if rate >= 25 else "MISSED"
        elif r.target.startswith(">= 1.0") and ratio:
            met = "met" if ratio >= 1.0 else "MISSED"
        elif r.target.startswith(">= 0.9") and ratio:
            met = "met" if ratio >= 0.9 else "MISSED"
        elif r.target.startswith("<= 0.25") and runai4:
            ratio4 = seconds / runai4[0]
            met = f"{seconds:.2f} s / {runai4[0]:.2f} s = {ratio4:.2f}: " + ("met" if ratio4 <= 0.25 else "MISSED")
        rate_text = f"{rate * r.world:>7.2f}" if r.world > 1 else f"{rate:>7.2f}"
        print(f"{r.name:<78} {seconds:>8.3f} {rate_text} {ratio or 0:>6.2f} {again or 0:>12.2f} {bad:>4}  {r.target} {met}")
        out.append({"path": r.name, "first_s": seconds, "first_gbps": rate * r.world, "x_it": ratio, "reload_gbps": again,
                    "bad_tensors": bad, "target": r.target, "met": met, "ranks": r.world})  # fmt: skip
    return out


def report(rows: list[Row], dirs: dict[str, Path], total: int, args) -> list[dict]:
    print()
    print(machine(dirs))
    print(f"checkpoint {total / GB:.2f} GB (GB = 1e9 B); {args.procs} fresh processes per row, {args.reloads} reloads each; "
          f"x IT: InstantTensor's first-load time on the same pages / this row's", flush=True)  # fmt: skip
    summary = table(rows)
    for row in rows:
        if row.failed:
            print(f"FAILED {row.name}: {row.failed.splitlines()[0]}")
    sys.stdout.flush()
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=6.44)
    parser.add_argument("--procs", type=int, default=3, help="counted processes per row (default 3)")
    parser.add_argument("--reloads", type=int, default=2, help="reloads per process, the second column (default 2)")
    parser.add_argument("--disk-dir", type=Path, default=Path(tempfile.gettempdir()), help="where the page-cache copy goes")
    parser.add_argument("--thp-dir", type=Path, help="a tmpfs mounted huge=always: the huge-page rows")
    parser.add_argument("--rows", default="", help="only rows whose name starts with one of these (separated by ;)")
    parser.add_argument("--profile", action="store_true", help="also one profiled process per row of ours")
    parser.add_argument("--out", type=Path, help="a directory for the profiles, the JSON and the daemons' logs")
    parser.add_argument("--json", type=Path, help="every measurement as JSON")
    parser.add_argument("--device", default="cuda:0", help="cpu: a dry run of the orchestration (rows of ours and Run:ai)")
    parser.add_argument("--baseline", type=Path, help="another checkout: each row of ours also runs on its code, same rounds")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    for name in ("--dir", "--truth", "--session", "--profile-out"):
        parser.add_argument(name, help=argparse.SUPPRESS)
    parser.add_argument("--reserve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        args.kind = args.worker
        worker(args)
        return
    orchestrate(args)


def orchestrate(args) -> None:
    import torch

    global DEVICE
    DEVICE = args.device
    if DEVICE != "cpu" and not torch.cuda.is_available():
        raise SystemExit("cold_start needs CUDA")
    for path in (REPO / "client", REPO):  # run from a checkout: the ChildDaemon below
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))
    from streamer_service.daemon.server import ChildDaemon

    work = Path(tempfile.mkdtemp(prefix="cold-start-", dir=args.disk_dir))
    shm = Path(tempfile.mkdtemp(prefix="cold-start-", dir="/dev/shm"))
    thp = Path(tempfile.mkdtemp(prefix="cold-start-", dir=args.thp_dir)) if args.thp_dir else None
    daemons: dict[str, ChildDaemon] = {}
    try:
        dirs = {"disk": work / "ckpt", "4k": shm / "ckpt"} | ({"thp": thp / "ckpt"} if thp else {})
        print(machine(dirs), flush=True)
        dirs["disk"].mkdir()
        started = time.monotonic()
        total = write_checkpoint(dirs["disk"], args.size_gb, DEVICE)
        for label in ("4k", "thp"):
            if label in dirs:
                shutil.copytree(dirs["disk"], dirs[label])
        truth_path = work / "truth.json"
        truth_path.write_text(json.dumps(ground_truth(dirs["disk"], DEVICE)))
        for path in sorted(dirs["disk"].iterdir()):  # the page-cache rows' files, read once
            with open(path, "rb") as f:
                while f.read(64 * MIB):
                    pass
        if DEVICE != "cpu":
            torch.cuda.empty_cache()
        print(f"checkpoint {total / GB:.2f} GB, {len(json.loads(truth_path.read_text()))} tensors, {SHARDS} shards "
              f"(written, copied and checked in {time.monotonic() - started:.0f} s)", flush=True)  # fmt: skip

        only = tuple(p for p in args.rows.split(";") if p)
        rows = [r for r in rows_for(thp is not None) if not only or r.name.startswith(only)]
        if args.baseline:
            rows = [twin for r in rows for twin in ([with_checkout(r, args.baseline), r] if r.kind == "ours" else [r])]
        base_env = dict(os.environ)
        base_env["PYTHONPATH"] = os.pathsep.join([str(REPO / "client"), str(REPO), base_env.get("PYTHONPATH", "")])
        base_env["STREAMER_CACHE_DIR"] = str(work / "rank-cache")
        for key in ("STREAMER_SOCKET", "STREAMER_SHM_DIR", "RUNAI_STREAMER_FS_STRATEGY"):
            base_env.pop(key, None)
        wanted = {r.daemon for r in rows if r.daemon}
        for name in sorted(wanted):
            root = work / f"daemon-{name}"
            root.mkdir()
            env = {"STREAMER_CACHE_DIR": str(root / "cache")}
            shm_dir = None
            if name.startswith("retain"):
                env["STREAMER_RETENTION_BUDGET"] = f"{int(args.size_gb * 2 + 4)}GiB"
            if name.endswith("-thp"):
                shm_dir = Path(tempfile.mkdtemp(prefix="daemon-", dir=thp))
            daemons[name] = ChildDaemon(root, f"{int(args.size_gb + 4)}GiB", env=env, shm_dir=shm_dir)
            page = daemons[name].client.call("/readyz").get("shm_page_size")
            print(f"daemon {name}: shm {daemons[name].shm_dir}, pages {page} B", flush=True)

        def env_for(row: Row) -> dict:
            env = dict(base_env)
            if row.kind == "runai":
                env.update(RUNAI_ENV)
            if row.daemon:
                env.update(daemons[row.daemon].env())
            if row.pin:
                env["STREAMER_PIN_SEGMENTS"] = row.pin
            return env

        # Round 0 is not counted: bytecode, the metadata caches, each daemon's first load (a retaining
        # daemon keeps the checkpoint from then on: its counted rows are warm restarts).
        for rnd in range(args.procs + 1):
            for row in round_order(rows, rnd):
                if row.failed:
                    continue
                try:
                    go = run_row(row, dirs[row.source], truth_path, env_for(row), f"cold-{os.getpid()}-{rnd}",
                                 args.reloads if rnd else 0)  # fmt: skip
                except SystemExit as exc:  # a loader that does not run here: the other rows go on
                    row.failed = str(exc)
                    print(f"  FAILED {row.name}: {exc}", flush=True)
                    continue
                if rnd:
                    row.loads.append(go)
                    seconds, nbytes = wall(go, 0)
                    bad = sum(load["bad"] for proc in go for load in proc)
                    print(f"  round {rnd} {row.name}: first {seconds:.3f} s ({nbytes * row.world / seconds / GB:.2f} GB/s), "
                          f"reloads {' '.join(f'{wall(go, i)[0]:.3f}' for i in range(1, len(go[0])))} s, "
                          f"{bad} tensors not bit-exact", flush=True)  # fmt: skip
                else:
                    print(f"  warm-up {row.name}: first {wall(go, 0)[0]:.3f} s", flush=True)

        report(rows, dirs, total, args)  # the table before the profiles too: a call cut short keeps it
        profiles = {}
        if args.profile:
            for row in rows:
                if row.kind != "ours" or row.world > 1 or row.reserve or row.failed:
                    continue
                out = (args.out or work) / f"profile-{len(profiles)}.txt"
                session = f"cold-{os.getpid()}-profile"
                try:
                    timed = run_row(row, dirs[row.source], truth_path, env_for(row), session + "-i", 0, importtime=True)[0][0]
                    load0 = run_row(row, dirs[row.source], truth_path, env_for(row), session + "-p", 0, profile_out=out)[0][0]
                except SystemExit as exc:
                    print(f"  FAILED profiling {row.name}: {exc}", flush=True)
                    continue
                profiles[row.name] = {"seconds": timed["end"] - timed["start"], "import_s": timed["import_s"],
                                      "profiled_s": load0["end"] - load0["start"], "first_tensor_s": load0["first"],
                                      **load0["split"]}  # fmt: skip
            print()
            print("Our first loads: 'load' and 'imports' from a process under -X importtime; the rest from another under "
                  "cProfile (cumulative seconds on the loading thread, slowed by the profiler; 'import' is its view)")  # fmt: skip
            stages = list(STAGES)
            print(f"{'path':<52} {'load':>6} {'imports':>7} {'prof.':>6} {'1st':>6} " + " ".join(f"{s[:12]:>12}" for s in stages))
            for name, p in profiles.items():
                print(f"{name[:52]:<52} {p['seconds']:>6.3f} {p['import_s']:>7.3f} {p['profiled_s']:>6.3f} "
                      f"{p['first_tensor_s'] or 0:>6.3f} " + " ".join(f"{p[s]:>12.3f}" for s in stages))  # fmt: skip

        summary = report(rows, dirs, total, args)
        if args.json:
            args.json.write_text(json.dumps({"machine": machine(dirs), "checkpoint_bytes": total, "rows": summary,
                                             "profiles": profiles, "raw": {r.name: r.loads for r in rows}}, indent=1))  # fmt: skip
    finally:
        for name, daemon in daemons.items():
            daemon.close()
            if args.out and daemon.log.exists():  # each load's line: where its time went
                shutil.copy(daemon.log, args.out / f"daemon-{name}.log")
        shutil.rmtree(shm, ignore_errors=True)
        if thp:
            shutil.rmtree(thp, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
