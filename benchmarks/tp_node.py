"""A tensor-parallel node's load: N fresh rank processes, each keeping its TP shard of every tensor.

    python benchmarks/tp_node.py [--device cuda:0] [--ranks 8] [--size-gb 6.4] [--rounds 3]
                                 [--rows cold,warm,full,vllm,runai] [--kv-heads K] [--disk-dir /tmp]
                                 [--no-check] [--json PATH]

What an engine's weight loader does on every rank of one node: it narrows each tensor to the
rank's shard by the Megatron/vLLM rule (:func:`tp_slices`, one function for every row) and copies
the shard to the rank's device (``--device``: ``cuda:0`` puts every rank on the one GPU; ``cpu``
runs the same processes without one). Every row ends with the same tensors in every rank.

The checkpoint: a Llama-shaped model of ``--size-gb`` random bf16 (never zeros), hidden size,
intermediate size and vocabulary from the size, as many layers as fit; grouped-query attention
with fewer KV heads than ranks by default (``--kv-heads``: ranks / 2), so that each KV head is
replicated over a group of ranks as vLLM replicates it; HF names and layout (q/k/v, gate/up/down
separate), sharded safetensors with an index and a ``config.json``, written to ``--disk-dir`` and
read back once: every row reads it from the page cache.

Rows (``--rows``), each ``--ranks`` fresh processes that have imported torch, made their CUDA
context, imported the loader's module and computed their slices, started together and released
by one go signal:

- ``cold``: ours through a daemon, with ``slices``: a warm daemon (it has loaded before) that
  retains nothing, so it reads the checkpoint from the page cache again;
- ``warm``: ours through a daemon that retains checkpoints (``STREAMER_RETENTION_BUDGET``): a
  warm restart, every byte from its resident copy (the round not counted fills it);
- ``full``: ours through the ``cold`` row's daemon without slices: every rank receives full
  tensors on the CPU, narrows them and copies its shard to the device (what the engine adapters
  do today);
- ``vllm``: vLLM's own safetensors path, without vLLM: its iterator (``safe_open(file,
  framework="pt")``, ``get_tensor`` of every name, files in order) and its weight loaders'
  ``narrow`` and ``param.copy_`` into a new tensor on the device;
- ``runai``: plain Run:ai per rank: ``SafetensorsStreamer`` reads every file
  (``RUNAI_STREAMER_FS_STRATEGY=sync_buffered``), each rank narrows and copies its shard.

The clock runs from the go signal to the last rank's end (``torch.cuda.synchronize()``); rows run
in rounds, one go of every row per round, the order turning by one each round, after one round not
counted (bytecode, metadata caches, the daemons' first loads); medians over ``--rounds``. After its
clock stops, every rank checks every tensor it keeps bit-exact against ``safetensors``' read of the
file narrowed by torch (``--no-check``: not checked). With ``--device cuda...`` the run also
measures the page-locked host-to-GPU rate (a 1 GiB page-locked buffer copied 5 times): the
warm-restart target's yardstick.

Per rank: bytes received (ours: the bytes of the tensors ``stream`` yielded; ``vllm``: the bytes of
the narrowed mmap views it copied; ``runai``: its ``rchar``, the bytes its reads returned), bytes
copied to the device (the tensors it keeps), peak RSS (``VmHWM``). Node: the wall, and the bytes
copied in host memory (:data:`HOST_COPIES` says what is counted, per row). Prints the machine, the
command, one table and the targets; ``--json`` writes every measurement. Exit status 1 when a
tensor was not bit-exact, a rank of ours received other than its slices' bytes, or a row failed.
GB = 1e9 bytes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(Path(__file__).resolve().parent) not in sys.path:  # imported by file (the tests), not run from here
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from cold_start import released_together, start_worker  # noqa: E402  (one way to run fresh workers for both scripts)

GB = 1e9
GIB = 2**30
MIB = 2**20
HEAD_DIM = 128
RUNAI_ENV = {"RUNAI_STREAMER_FS_STRATEGY": "sync_buffered"}  # Run:ai's page-cache reader, as cold_start.py runs it
PINNED_BYTES = GIB  # the page-locked host-to-GPU rate: one buffer of this size ...
PINNED_REPS = 5  # ... copied this many times (the median)

# The targets (docs/benchmarks.md, "Tensor-parallel node"), stated for TP = 8 on one GPU.
RECEIVED_OVER_KEPT = 1.05  # bytes each rank of ours receives ÷ the bytes it keeps
HOST_OVER_MODEL = 2.0  # the node's host-memory bytes copied ÷ the model's bytes
WARM_OVER_PINNED = 1.3  # warm restart ÷ (model bytes ÷ the page-locked host-to-GPU rate)
COLD_OVER_VLLM = 1.0  # cold from the page cache ÷ vLLM's own path


# =========================================================================== the TP rule


def tp_slices(config: dict, shapes: dict[str, list[int]], rank: int, tp: int) -> dict[str, tuple[int, int, int]]:
    """The part of every tensor that rank ``rank`` of ``tp`` keeps, as ``(dim, start, stop)``
    (``torch.narrow`` coordinates), by the Megatron/vLLM rule for a Llama checkpoint in HF names:
    column-parallel ``q_proj``, ``k_proj``, ``v_proj``, ``gate_proj``, ``up_proj`` and the
    vocabulary-parallel ``embed_tokens`` and ``lm_head`` along dim 0; row-parallel ``o_proj`` and
    ``down_proj`` along dim 1; every other tensor (the norms) whole. KV heads: with at least as
    many heads as ranks each rank keeps its ``kv / tp`` heads; with fewer, rank ``r`` keeps head
    ``r * kv // tp`` whole, replicated over ``tp / kv`` ranks (vLLM's QKVParallelLinear)."""
    kv = config["num_key_value_heads"]
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    out = {}
    for name, shape in shapes.items():
        kind = name.split(".")[-2]
        if kind in ("k_proj", "v_proj"):
            if kv >= tp:
                rows = kv // tp * head_dim
                out[name] = (0, rank * rows, (rank + 1) * rows)
            else:
                head = rank * kv // tp
                out[name] = (0, head * head_dim, (head + 1) * head_dim)
        elif kind in ("q_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head"):
            rows = shape[0] // tp
            out[name] = (0, rank * rows, (rank + 1) * rows)
        elif kind in ("o_proj", "down_proj"):
            cols = shape[1] // tp
            out[name] = (1, rank * cols, (rank + 1) * cols)
        else:
            out[name] = (0, 0, shape[0])
    return out


def slice_bytes(shape: list[int], piece: tuple[int, int, int], itemsize: int = 2) -> int:
    dim, start, stop = piece
    return math.prod(shape[:dim]) * (stop - start) * math.prod(shape[dim + 1 :]) * itemsize


# =========================================================================== the worker (a fresh process)
# Imports nothing but the standard library at module level: the worker imports torch and its
# loader's module itself, before the go signal.


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


def _narrow(t, piece: tuple[int, int, int]):
    dim, start, stop = piece
    return t.narrow(dim, start, stop - start)


def _place(part, device: str, tally: dict):
    """A weight loader's copy: a new tensor on ``device`` (the parameter) holding ``part``."""
    import torch

    param = torch.empty(part.shape, dtype=part.dtype, device=device)
    param.copy_(part)
    tally["placed"] += _nbytes(part)
    if not part.is_contiguous():
        tally["strided"] += _nbytes(part)
    return param


def _rchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    return 0


def _hwm() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def count_copies(tally: dict) -> None:
    """Count what streamer_client's native copier copies in this process, at its three entry
    points (``copy`` and ``copy_here``: owned copies and gathered slices, into ``copied``;
    ``submit``: the staging ring's fills before a GPU copy, into ``staged``). The staging ring's
    zero-fill at its first use is left out: it writes zeros, it copies no checkpoint byte. The
    functions run as they are; only their sizes are added up."""
    import numpy as np

    from streamer_client import _delivery as delivery
    from streamer_client import _native_copier as copier

    if not copier.available():
        raise SystemExit("the native copier is not built (client/streamer_client/_copier.abi3.so): its copies cannot be counted")
    filling = threading.local()

    def counted(function, key: str):
        def run(dsts, srcs, sizes):
            if not getattr(filling, "zeros", False):
                tally[key] += int(np.sum(sizes))
            return function(dsts, srcs, sizes)

        return run

    copier.copy = counted(copier.copy, "copied")
    copier.copy_here = counted(copier.copy_here, "copied")
    copier.submit = counted(copier.submit, "staged")
    fault_in = delivery.fault_in

    def zero_fill(buffers):
        filling.zeros = True
        try:
            return fault_in(buffers)
        finally:
            filling.zeros = False

    delivery.fault_in = zero_fill


def load(kind: str, args, plan: dict, files: list[Path], tally: dict) -> dict:
    """One rank's load by ``kind``: ``{name: its shard on the device}``."""
    device, out = args.device, {}
    if kind in ("cold", "warm", "full"):
        import streamer_client

        if kind != "full":
            for name, tensor in streamer_client.stream(
                args.dir,
                slices=plan,
                rank=args.rank,
                world_size=args.world,
                device=device,
                session=args.session,
                require_daemon=True,
            ):
                tally["received"] += _nbytes(tensor)
                out[name] = tensor
            return out
        tensors = streamer_client.stream(
            args.dir, rank=args.rank, world_size=args.world, session=args.session, require_daemon=True
        )
        for name, tensor in tensors:
            tally["received"] += _nbytes(tensor)
            out[name] = _place(_narrow(tensor, plan[name]), device, tally)
            del tensor
        return out
    if kind == "vllm":
        from safetensors import safe_open

        for path in files:  # vLLM's safetensors_weights_iterator, then each weight_loader's narrow and copy_
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    part = _narrow(f.get_tensor(name), plan[name])
                    tally["received"] += _nbytes(part)
                    out[name] = _place(part, device, tally)
        return out
    from runai_model_streamer import SafetensorsStreamer

    with SafetensorsStreamer() as streamer:
        streamer.stream_files([str(p) for p in files])
        for name, tensor in streamer.get_tensors():
            out[name] = _place(_narrow(tensor, plan[name]), device, tally)
    return out


def check(state: dict, plan: dict, files: list[Path]) -> int:
    """How many of the rank's tensors differ from ``safetensors``' read of the file narrowed by
    torch (dtype, shape and every byte); a missing or extra name counts too."""
    import torch
    from safetensors import safe_open

    bad, seen = 0, set()
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118
                seen.add(name)
                got, want = state.get(name), _narrow(f.get_tensor(name), plan[name])
                if got is None or got.dtype != want.dtype or got.shape != want.shape:
                    bad += 1
                    continue
                same = torch.equal(
                    got.cpu().contiguous().view(-1).view(torch.uint8), want.contiguous().view(-1).view(torch.uint8)
                )
                bad += not same
    return bad + len(set(state) - seen)


def worker(args) -> None:
    import torch

    kind, device = args.worker, args.device
    if device != "cpu":
        torch.cuda.set_device(device)
    torch.zeros(1, device=device)  # the CUDA context
    directory = Path(args.dir)
    config = json.loads((directory / "config.json").read_text())
    shapes = json.loads(Path(args.shapes).read_text())
    plan = tp_slices(config, shapes, args.rank, args.world)
    kept = sum(slice_bytes(shapes[name], piece) for name, piece in plan.items())
    files = sorted(directory.glob("*.safetensors"))
    tally = {"received": 0, "placed": 0, "strided": 0, "copied": 0, "staged": 0}
    if kind in ("cold", "warm", "full"):
        import streamer_client  # noqa: F401

        count_copies(tally)
    elif kind == "vllm":
        import safetensors  # noqa: F401
    else:
        import runai_model_streamer  # noqa: F401
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return
    rchar = _rchar()
    start = time.time()  # one clock for every process of the machine (the node's wall)
    state = load(kind, args, plan, files, tally)
    if device != "cpu":
        torch.cuda.synchronize(device)
    end = time.time()
    result = dict(tally, rank=args.rank, start=start, end=end, rchar=_rchar() - rchar, hwm=_hwm(), kept=kept,
                  to_device=sum(_nbytes(t) for t in state.values()), tensors=len(state))  # fmt: skip
    if kind == "runai":
        result["received"] = result["rchar"]
    result["bad"] = check(state, plan, files) if args.check else None
    print("result " + json.dumps(result), flush=True)


# =========================================================================== the checkpoint


def llama_config(size_gb: float, ranks: int, kv_heads: int | None) -> dict:
    """A Llama config of about ``size_gb`` bf16 bytes, its dimensions from the size (Llama-3-8B's
    from 3 GB up), split ``ranks`` ways."""
    hidden = 4096 if size_gb >= 3 else 2048 if size_gb >= 0.8 else 1024 if size_gb >= 0.15 else 512
    heads = hidden // HEAD_DIM
    inter = hidden * 7 // 2
    vocab = 128256 if hidden >= 4096 else 32000 if hidden >= 1024 else 8192
    kv = kv_heads or max(1, ranks // 2)
    per_layer = 2 * (2 * hidden * heads * HEAD_DIM + 2 * hidden * kv * HEAD_DIM + 3 * hidden * inter + 2 * hidden)
    fixed = 2 * (2 * vocab * hidden + hidden)
    layers = max(1, round((size_gb * GB - fixed) / per_layer))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "bfloat16",
              "hidden_size": hidden, "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": kv,
              "num_hidden_layers": layers, "vocab_size": vocab, "tie_word_embeddings": False, "rms_norm_eps": 1e-5}  # fmt: skip
    problems = [f"{what} {n} is not divisible by {ranks} ranks" for what, n in
                (("attention heads", heads), ("intermediate size", inter), ("vocabulary", vocab)) if n % ranks]  # fmt: skip
    if kv % ranks and ranks % kv:
        problems.append(f"{kv} KV heads and {ranks} ranks: neither divides the other")
    if heads % kv:
        problems.append(f"{heads} attention heads are not a multiple of {kv} KV heads")
    if problems:
        raise SystemExit("tp_node: " + "; ".join(problems))
    return config


def llama_shapes(config: dict) -> dict[str, list[int]]:
    """Every tensor of the config's checkpoint, in HF names and checkpoint order."""
    h, i, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    q, kv = config["num_attention_heads"] * HEAD_DIM, config["num_key_value_heads"] * HEAD_DIM
    shapes = {"model.embed_tokens.weight": [v, h]}
    for n in range(config["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes |= {p + "input_layernorm.weight": [h], p + "self_attn.q_proj.weight": [q, h],
                   p + "self_attn.k_proj.weight": [kv, h], p + "self_attn.v_proj.weight": [kv, h],
                   p + "self_attn.o_proj.weight": [h, q], p + "post_attention_layernorm.weight": [h],
                   p + "mlp.gate_proj.weight": [i, h], p + "mlp.up_proj.weight": [i, h], p + "mlp.down_proj.weight": [h, i]}  # fmt: skip
    shapes |= {"model.norm.weight": [h], "lm_head.weight": [v, h]}
    return shapes


def write_checkpoint(directory: Path, config: dict, shapes: dict, shards: int, device: str) -> int:
    """Random bf16 bits (made on ``device``) for every tensor of ``shapes``, in ``shards`` files of
    about equal bytes, in order, with an index and ``config.json``; the checkpoint's bytes."""
    import torch
    from safetensors.torch import save_file

    sizes = {name: math.prod(shape) * 2 for name, shape in shapes.items()}
    total = sum(sizes.values())
    groups: list[list[str]] = [[] for _ in range(shards)]
    at = 0
    for name, size in sizes.items():
        groups[min(shards - 1, at * shards // total)].append(name)
        at += size
    groups = [g for g in groups if g]
    g = torch.Generator(device=device).manual_seed(8)
    weight_map = {}
    for s, names in enumerate(groups):
        file = f"model-{s + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for name in names:
            bits = torch.randint(0, 256, (sizes[name],), dtype=torch.uint8, device=device, generator=g)
            tensors[name] = bits.view(torch.bfloat16).reshape(shapes[name]).cpu()
            weight_map[name] = file
        save_file(tensors, str(directory / file), metadata={"format": "pt"})
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return total


# =========================================================================== the orchestrator


@dataclass
class Row:
    key: str  # --rows
    name: str  # the label printed
    daemon: str | None = None  # "plain" or "retain"
    env: dict = field(default_factory=dict)
    failed: str = ""
    rounds: list = field(default_factory=list)  # per counted round: {"ranks": [...], "daemon": {...}}


def all_rows() -> dict[str, Row]:
    return {
        "cold": Row("cold", "ours, sliced, through a daemon: cold (page cache, warm daemon, nothing retained)", "plain"),
        "warm": Row("warm", "ours, sliced, warm restart: a retaining daemon's resident copy", "retain"),
        "full": Row("full", "ours through a daemon without slices: full tensors, narrowed in the rank", "plain"),
        "vllm": Row("vllm", "vLLM's own path: safe_open mmap views, narrow, copy_ to the device"),
        "runai": Row("runai", "plain Run:ai per rank: SafetensorsStreamer reads every file, narrow, copy_", env=RUNAI_ENV),
    }


ROWS = tuple(all_rows())

HOST_COPIES = {
    "cold": "the daemon's reads into its segments (its stats' bytes_read) + the bytes each rank's streamer_client copier "
            "copied (owned copies, gathered slices, staging-ring fills){gathered}",
    "full": "the daemon's reads into its segments + each rank's copier copies (owned full tensors) + its copy of each "
            "narrowed shard into a new device tensor{pageable}",
    "vllm": "each rank's copy of each narrowed view of the file's mapping (page cache) into a new device tensor{pageable}",
    "runai": "each rank's reads into Run:ai's buffers (its rchar) + its copy of each narrowed shard into a new device tensor"
             "{pageable}",
}  # fmt: skip
HOST_COPIES["warm"] = HOST_COPIES["cold"]
GATHERED_CUDA = "; to a GPU, + the gathered slices copied pageable when its segments are page-locked (the driver stages them)"
PAGEABLE_CUDA = (
    "; to a GPU the copy is pageable: the driver stages it (counted once), a strided narrowing made contiguous first (again)"
)


def host_bytes(row: Row, go: dict, cuda: bool) -> int:
    """The node's host-memory bytes copied in one go of ``row`` (:data:`HOST_COPIES`)."""
    total = go["daemon"].get("read", 0)
    for r in go["ranks"]:
        total += r["copied"] + r["staged"] + r["placed"]
        if row.key == "runai":
            total += r["rchar"]
        if cuda:
            total += r["strided"]  # torch copies a strided CPU source to a contiguous one before a GPU copy
            if row.key in ("cold", "warm") and r["staged"] == 0:
                total += r["copied"]  # page-locked segments: a gathered slice goes to the GPU with .to (pageable)
    return total


def spawn(row: Row, args, env: dict, rank: int, session: str, shapes: Path, directory: Path) -> subprocess.Popen:
    cmd = [sys.executable, __file__, "--worker", row.key, "--dir", str(directory), "--shapes", str(shapes),
           "--rank", str(rank), "--world", str(args.ranks), "--session", session, "--device", args.device]  # fmt: skip
    if not args.check:
        cmd.append("--no-check")
    return start_worker(cmd, env)


def run_row(row: Row, args, env: dict, session: str, shapes: Path, directory: Path) -> list[dict]:
    """One go of a row: ``--ranks`` fresh processes, released together once every one is ready."""
    procs = [spawn(row, args, env, r, session, shapes, directory) for r in range(args.ranks)]
    return [result for result, _ in released_together(procs, row.key, timeout=args.timeout)]


def daemon_delta(before, after) -> dict:
    """What a daemon did in one go (its stats before and after): bytes read from storage, bytes
    served from its resident copy, and each rank's bytes selected and delivered by its account."""
    known = {s.id for s in before.finished}
    ranks = {rank: {"selected": info.bytes_selected, "delivered": info.bytes_delivered}
             for s in after.finished if s.id not in known for rank, info in s.ranks.items()}  # fmt: skip
    return {"read": after.bytes_read - before.bytes_read,
            "served": after.resident.resident_bytes_served - before.resident.resident_bytes_served, "ranks": ranks}  # fmt: skip


def pinned_rate(device: str) -> float:
    """Bytes per second of a page-locked host buffer copied to ``device`` (median of the reps)."""
    import torch

    host = torch.empty(PINNED_BYTES, dtype=torch.uint8, pin_memory=True)
    host.fill_(1)
    dev = torch.empty(PINNED_BYTES, dtype=torch.uint8, device=device)
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize(device)
    times = []
    for _ in range(PINNED_REPS):
        start = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    del host, dev
    torch.cuda.empty_cache()
    return PINNED_BYTES / statistics.median(times)


def machine(device: str) -> str:
    import safetensors
    import torch

    try:
        import importlib.metadata

        runai = importlib.metadata.version("runai-model-streamer")
    except Exception:  # not installed: its row fails and says so
        runai = "?"
    memory = next((int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines()
                   if line.startswith("MemTotal:")), 0)  # fmt: skip
    if device == "cpu":
        gpu = "no GPU (--device cpu)"
    else:
        props = torch.cuda.get_device_properties(device)
        try:
            driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                    capture_output=True, text=True, timeout=30).stdout.split()[0]  # fmt: skip
        except (OSError, IndexError, subprocess.SubprocessError):
            driver = "?"
        gpu = f"{torch.cuda.device_count()} x {props.name} ({props.total_memory / GIB:.0f} GiB), driver {driver}, every rank on {device}"
    return (f"{gpu}; {os.cpu_count()} CPUs ({len(os.sched_getaffinity(0))} usable); {memory / GIB:.1f} GiB RAM; "
            f"page size {os.sysconf('SC_PAGE_SIZE')} B; kernel {platform.release()}; Python {platform.python_version()}; "
            f"torch {torch.__version__}; safetensors {safetensors.__version__}; runai-model-streamer {runai}")  # fmt: skip


def median(values):
    return statistics.median(values) if values else None


def summarize(rows: list[Row], model: int, cuda: bool, rate: float | None) -> tuple[list[dict], list[dict]]:
    """Per row: medians over the rounds (per rank: the rank's median, then the most of any
    rank); then the targets."""
    summary = []
    for row in rows:
        if not row.rounds:
            continue
        ranks = len(row.rounds[0]["ranks"])

        def per_rank(key, row=row, ranks=ranks):
            return [median([go["ranks"][r][key] for go in row.rounds]) for r in range(ranks)]

        received, kept = per_rank("received"), per_rank("kept")
        bad = [r["bad"] for go in row.rounds for r in go["ranks"]]
        summary.append({
            "row": row.key, "path": row.name, "ranks": ranks,
            "wall_s": median([max(r["end"] for r in go["ranks"]) - min(r["start"] for r in go["ranks"]) for go in row.rounds]),
            "received_per_rank": received, "kept_per_rank": kept,
            "received_over_kept": max(a / b for a, b in zip(received, kept)),
            "to_device_per_rank": per_rank("to_device"), "peak_rss_per_rank": per_rank("hwm"), "rchar_per_rank": per_rank("rchar"),
            "host_bytes": median([host_bytes(row, go, cuda) for go in row.rounds]),
            "daemon_read": median([go["daemon"].get("read", 0) for go in row.rounds]) if row.daemon else None,
            "daemon_served": median([go["daemon"].get("served", 0) for go in row.rounds]) if row.daemon else None,
            "bad_tensors": None if any(b is None for b in bad) else sum(bad),
            "host_copies": HOST_COPIES[row.key].format(gathered=GATHERED_CUDA if cuda else "", pageable=PAGEABLE_CUDA if cuda else ""),
        })  # fmt: skip
        summary[-1]["host_over_model"] = summary[-1]["host_bytes"] / model
    by = {s["row"]: s for s in summary}
    targets = []

    def target(what: str, value: float | None, limit: float, shown: str) -> None:
        met = None if value is None else value <= limit
        targets.append({"target": what, "value": value, "limit": limit, "shown": shown,
                        "met": met, "status": "not measured" if met is None else "met" if met else "MISSED"})  # fmt: skip

    for key in ("cold", "warm"):
        if key in by:
            s = by[key]
            target(f"{key}: bytes received by each rank ≤ {RECEIVED_OVER_KEPT} × the bytes it keeps", s["received_over_kept"],
                   RECEIVED_OVER_KEPT, f"{s['received_over_kept']:.3f} ×")  # fmt: skip
            target(f"{key}: node host-memory bytes copied ≤ {HOST_OVER_MODEL:g} × model bytes", s["host_over_model"],
                   HOST_OVER_MODEL, f"{s['host_bytes'] / GB:.3f} GB = {s['host_over_model']:.2f} ×")  # fmt: skip
    if "warm" in by:
        if rate:
            floor = model / rate
            target(f"warm restart ≤ {WARM_OVER_PINNED} × model bytes ÷ page-locked H2D rate", by["warm"]["wall_s"] / floor,
                   WARM_OVER_PINNED, f"{by['warm']['wall_s']:.3f} s ÷ {floor:.3f} s ({rate / GB:.1f} GB/s) = "
                   f"{by['warm']['wall_s'] / floor:.2f} ×")  # fmt: skip
        else:
            target(f"warm restart ≤ {WARM_OVER_PINNED} × model bytes ÷ page-locked H2D rate", None, WARM_OVER_PINNED,
                   "no GPU: no page-locked host-to-GPU rate")  # fmt: skip
    if "cold" in by and "vllm" in by:
        ratio = by["cold"]["wall_s"] / by["vllm"]["wall_s"]
        target(f"cold from the page cache ≤ {COLD_OVER_VLLM} × vLLM's own path's wall", ratio, COLD_OVER_VLLM,
               f"{by['cold']['wall_s']:.3f} s ÷ {by['vllm']['wall_s']:.3f} s = {ratio:.2f} ×")  # fmt: skip
    return summary, targets


def report(summary: list[dict], targets: list[dict], header: list[str], rounds: int) -> None:
    print()
    for line in header:
        print(line)
    print()
    ranks = summary[0]["ranks"] if summary else 0
    print(f"{'path (' + str(ranks) + ' fresh ranks; medians of ' + str(rounds) + ' rounds; per rank: the most of any rank)':<96} "
          f"{'wall s':>8} {'received GB':>11} {'÷ kept':>7} {'to device GB':>12} {'peak RSS GiB':>12} "
          f"{'host copied GB':>14} {'÷ model':>7} {'daemon read GB':>14} {'bad':>4}")  # fmt: skip
    for s in summary:
        read = "" if s["daemon_read"] is None else f"{s['daemon_read'] / GB:.3f}"
        bad = "-" if s["bad_tensors"] is None else str(s["bad_tensors"])
        print(f"{s['path']:<96} {s['wall_s']:>8.3f} {max(s['received_per_rank']) / GB:>11.3f} {s['received_over_kept']:>7.3f} "
              f"{max(s['to_device_per_rank']) / GB:>12.3f} {max(s['peak_rss_per_rank']) / GIB:>12.2f} "
              f"{s['host_bytes'] / GB:>14.3f} {s['host_over_model']:>7.2f} {read:>14} {bad:>4}")  # fmt: skip
    print()
    print("per rank (medians of the rounds): received / kept MB, peak RSS MiB")
    for s in summary:
        cells = [f"{a / 1e6:.1f}/{b / 1e6:.1f}, {h / MIB:.0f}" for a, b, h in
                 zip(s["received_per_rank"], s["kept_per_rank"], s["peak_rss_per_rank"])]  # fmt: skip
        print(f"  {s['row']:<6} " + " | ".join(cells))
    print()
    print("host copied, per row:")
    for s in summary:
        print(f"  {s['row']:<6} {s['host_copies']}")
    print()
    print("targets (stated for TP = 8 on one GPU):")
    for t in targets:
        print(f"  {t['target']}: {t['shown']}: {t['status']}")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda:0", help="every rank's device: cuda:N (one GPU for all) or cpu")
    parser.add_argument("--ranks", type=int, default=8, help="TP size: the rank processes of each row (default 8)")
    parser.add_argument("--size-gb", type=float, default=6.4, help="the checkpoint's size in GB (default 6.4)")
    parser.add_argument("--kv-heads", type=int, help="KV heads (default: ranks / 2, replicated over pairs of ranks)")
    parser.add_argument("--shards", type=int, help="safetensors files (default: one per 2 GB, at least 2)")
    parser.add_argument("--rounds", type=int, default=3, help="counted rounds, after one not counted (default 3)")
    parser.add_argument("--warmup", type=int, choices=(0, 1), default=1, help="rounds not counted first (default 1)")
    parser.add_argument("--time-limit", type=float, help="start no round that would end past this many seconds from the start")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"which rows, in order (default {','.join(ROWS)})")
    parser.add_argument("--disk-dir", type=Path, default=Path(tempfile.gettempdir()), help="where the checkpoint is written")
    parser.add_argument("--timeout", type=float, default=300, help="seconds a rank may take after the go signal (default 300)")
    parser.add_argument("--no-check", dest="check", action="store_false", help="skip the ranks' bit-exact checks")
    parser.add_argument("--json", type=Path, help="every measurement as JSON")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    for name in ("--dir", "--shapes", "--session"):
        parser.add_argument(name, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    return orchestrate(args)


def orchestrate(args) -> int:
    import torch

    begun = time.monotonic()
    cuda = args.device != "cpu"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("tp_node: --device cuda needs CUDA (--device cpu runs without a GPU)")
    keys = list(dict.fromkeys(k for k in args.rows.split(",") if k))
    unknown = [k for k in keys if k not in ROWS]
    if unknown or not keys:
        raise SystemExit(f"tp_node: --rows takes {', '.join(ROWS)}, not {', '.join(unknown) or 'nothing'}")
    rows = [all_rows()[k] for k in keys]
    config = llama_config(args.size_gb, args.ranks, args.kv_heads)
    shapes = llama_shapes(config)
    shards = args.shards or max(2, math.ceil(args.size_gb / 2))
    for path in (REPO / "client", REPO):  # the daemon below is this checkout's
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))
    from streamer_service.daemon.server import ChildDaemon

    command = " ".join(["python3", "benchmarks/tp_node.py", *sys.argv[1:]])
    header = [machine(args.device), f"command: {command}"]
    load_at_start = os.getloadavg()[0]  # a machine shared with other work: its load says how noisy the walls are
    print(header[0], flush=True)
    work = Path(tempfile.mkdtemp(prefix="tp-node-", dir=args.disk_dir))
    # The daemons' roots (their sockets) in a short path of their own: AF_UNIX paths are short.
    sockets = Path(tempfile.mkdtemp(prefix="tp-node-"))
    daemons: dict[str, ChildDaemon] = {}
    try:
        directory = work / "ckpt"
        directory.mkdir()
        started = time.monotonic()
        model = write_checkpoint(directory, config, shapes, shards, args.device if cuda else "cpu")
        for path in sorted(directory.iterdir()):  # every row reads it from the page cache
            with open(path, "rb") as f:
                while f.read(64 * MIB):
                    pass
        shapes_path = work / "shapes.json"
        shapes_path.write_text(json.dumps(shapes))
        kept = [
            sum(slice_bytes(shapes[n], p) for n, p in tp_slices(config, shapes, r, args.ranks).items()) for r in range(args.ranks)
        ]
        described = (f"checkpoint {model / GB:.3f} GB (GB = 1e9 B): Llama-shaped bf16, hidden {config['hidden_size']}, "
                     f"intermediate {config['intermediate_size']}, vocabulary {config['vocab_size']}, {config['num_hidden_layers']} "
                     f"layers, {config['num_attention_heads']} heads, {config['num_key_value_heads']} KV heads, {len(shapes)} tensors "
                     f"in {shards} files; TP = {args.ranks}: each rank keeps {min(kept) / GB:.3f}–{max(kept) / GB:.3f} GB, "
                     f"the ranks together {sum(kept) / model:.3f} × the model")  # fmt: skip
        header.append(described)
        print(f"{described} (written and read once in {time.monotonic() - started:.0f} s)", flush=True)
        rate = pinned_rate(args.device) if cuda else None
        if rate:
            header.append(
                f"page-locked host-to-GPU rate: {rate / GB:.2f} GB/s ({PINNED_BYTES // GIB} GiB, median of {PINNED_REPS})"
            )
            print(header[-1], flush=True)

        base = dict(os.environ)
        path = [str(REPO / "client"), str(REPO), base.get("PYTHONPATH", "")]
        base["PYTHONPATH"] = os.pathsep.join(p for p in path if p)
        base["STREAMER_CACHE_DIR"] = str(work / "rank-cache")
        base["LOCAL_WORLD_SIZE"] = str(args.ranks)  # as torchrun sets it: the ranks on this host
        for key in ("STREAMER_SOCKET", "STREAMER_SHM_DIR", "RUNAI_STREAMER_FS_STRATEGY", "STREAMER_RETENTION_BUDGET"):
            base.pop(key, None)
        for name in sorted({r.daemon for r in rows if r.daemon}):
            root = sockets / name
            root.mkdir()
            env = {"PYTHONPATH": base["PYTHONPATH"], "STREAMER_CACHE_DIR": str(root / "cache")}
            if name == "retain":
                env["STREAMER_RETENTION_BUDGET"] = f"{math.ceil(args.size_gb * 2 + 4)}GiB"
            daemons[name] = ChildDaemon(root, f"{math.ceil(args.size_gb + 4)}GiB", env=env)
            daemons[name].wait_preloaded()
            print(f"daemon {name}: shm {daemons[name].shm_dir}" + (f", retention {env['STREAMER_RETENTION_BUDGET']}" if name == "retain" else ""),
                  flush=True)  # fmt: skip

        def go(row: Row, label: str) -> dict | None:
            """One go of ``row``, printed; None where it failed (it is left out from then on)."""
            env = dict(base, **row.env)
            daemon = daemons.get(row.daemon)
            if daemon is not None:
                env.update(daemon.env())
                before = daemon.stats()
            try:
                ranks = run_row(row, args, env, f"tp-{os.getpid()}-{label.replace(' ', '')}-{row.key}", shapes_path, directory)
            except SystemExit as exc:  # a loader that does not run here: the other rows go on
                row.failed = str(exc)
                print(f"  FAILED {row.name}: {exc}", flush=True)
                return None
            done = {"ranks": ranks, "daemon": daemon_delta(before, daemon.stats()) if daemon is not None else {}}
            wall = max(r["end"] for r in ranks) - min(r["start"] for r in ranks)
            bad = "unchecked" if ranks[0]["bad"] is None else f"{sum(r['bad'] for r in ranks)} not bit-exact"
            print(f"  {label} {row.key}: wall {wall:.3f} s, received {sum(r['received'] for r in ranks) / GB:.3f} GB by "
                  f"{len(ranks)} ranks, daemon read {done['daemon'].get('read', 0) / GB:.3f} GB, {bad}", flush=True)  # fmt: skip
            return done

        # The round not counted: bytecode, the metadata caches, each daemon's first load (the
        # retaining daemon keeps the checkpoint from then on: the warm row's rounds are warm
        # restarts). Without it (--warmup 0) the warm row still loads once first, to fill it.
        if args.warmup:
            for row in rows:
                go(row, "warm-up")
        elif "warm" in keys:
            go(rows[keys.index("warm")], "fill")
        counted = 0
        for rnd in range(1, args.rounds + 1):
            round_start = time.monotonic()
            turn = rnd % len(rows)
            for row in rows[turn:] + rows[:turn]:
                if not row.failed and (done := go(row, f"round {rnd}")) is not None:
                    row.rounds.append(done)
            counted = rnd
            took = time.monotonic() - round_start
            if args.time_limit and rnd < args.rounds and time.monotonic() - begun + took > args.time_limit:
                print(f"  stopping after {rnd} of {args.rounds} rounds: another would end past --time-limit {args.time_limit:g} s",
                      flush=True)  # fmt: skip
                break

        summary, targets = summarize(rows, model, cuda, rate)
        header.append(f"load average (1 min): {load_at_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end")
        report(summary, targets, header, counted)
        problems = [f"FAILED {r.name}: {r.failed.splitlines()[0]}" for r in rows if r.failed]
        for s in summary:
            if s["bad_tensors"]:
                problems.append(f"{s['row']}: {s['bad_tensors']} tensors not bit-exact")
        for row in rows:
            if row.key in ("cold", "warm"):
                for go in row.rounds:
                    wrong = [r["rank"] for r in go["ranks"] if r["received"] != r["kept"]]
                    if wrong:
                        problems.append(f"{row.key}: ranks {wrong} received other than their slices' bytes")
        for line in problems:
            print(line)
        if args.json:
            args.json.write_text(json.dumps({
                "machine": header[0], "command": command, "checkpoint": {"bytes": model, "config": config, "files": shards,
                "tensors": len(shapes), "kept_per_rank": kept}, "pinned_h2d_bytes_per_s": rate, "rounds": counted,
                "rows": summary, "targets": targets, "ok": not problems, "problems": problems,
                "raw": {r.key: r.rounds for r in rows}}, indent=1))  # fmt: skip
        return 1 if problems else 0
    finally:
        for daemon in daemons.values():
            daemon.close()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(sockets, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
