"""One rank process of a benchmark run, for each contender (A-D), and the check of its bytes.

Every rank is its own process. It imports what its contender needs, reports ready, waits for
the parent's go (the clock starts there), loads its selection, consuming each tensor the way an
engine would before moving on (check it, drop it), and reports when it finished, how many bytes it
got, its ``rchar`` during the load and its peak RSS (``VmHWM``).

Checks: ``full`` compares every byte of every tensor with ``safetensors``' own read of the local
ground-truth checkpoint (warm-up repetitions and ``--quick``); ``sample`` compares dtype, shape
and 3 x 64 bytes (start, middle, end) per tensor against values taken from that ground truth
beforehand (timed repetitions: constant work per tensor, the same for every contender).
"""

from __future__ import annotations

import enum
import json
import os
import pickle
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .measure import read_io, read_status_kib

__all__ = ["Mode", "RankJob", "RankResult", "rank_main", "take_samples"]

SAMPLE_BYTES = 64


class Mode(str, enum.Enum):
    RUNAI = "A"  # each rank: plain Run:ai SafetensorsStreamer on its own selection
    DAEMON = "B"  # each rank: streamer_client through the node daemon
    EMBEDDED = "C"  # one process: streamer_client in-process, the union of the selections
    NAIVE = "D"  # download the checkpoint with the cloud SDK, then each rank: safetensors

    @property
    def label(self) -> str:
        return _LABELS[self]


_LABELS = {
    Mode.RUNAI: "A plain Run:ai per rank",
    Mode.DAEMON: "B daemon",
    Mode.EMBEDDED: "C embedded, 1 process",
    Mode.NAIVE: "D download + safetensors",
}


@dataclass(frozen=True)
class RankJob:
    mode: Mode
    uri: str  # the checkpoint at the source (a local dir or s3://bucket/prefix)
    rank: int
    world_size: int
    select: tuple[str, ...]
    truth_dir: str  # the local ground-truth checkpoint (index + shards)
    full_check: bool
    samples_path: str
    env: dict[str, str]
    launch_id: str
    borrowed: bool = False  # A: owned=False; B, C: borrowed=True (zero-copy views, valid until the next tensor)
    runai_paths: tuple[str, ...] = ()  # A: the shards (paths or URIs) this rank's selection lives in
    download_dir: str | None = None  # D from object storage: where rank 0 downloads to
    downloads: tuple[str, ...] = ()  # D: object keys to download
    endpoint: str | None = None  # D: the S3 endpoint


@dataclass(frozen=True)
class RankResult:
    rank: int
    tensors: int = 0
    nbytes: int = 0
    finished: float = 0.0  # time.monotonic() (system-wide on Linux) when the last tensor was consumed
    rchar: int = 0
    peak_rss: int = 0
    mismatches: tuple[str, ...] = field(default_factory=tuple)
    error: str | None = None


def rank_main(job: RankJob, ready, go, downloaded, results) -> None:
    """Process entry point. ``ready``: a barrier of all ranks and the parent; ``go``/``downloaded``: events."""
    os.environ.update(job.env)
    if job.mode is not Mode.DAEMON:
        os.environ.pop("STREAMER_SOCKET", None)  # A, C and D never talk to a daemon
    try:
        load = _LOADERS[job.mode]
        check = Checker(job)
        _preload(job.mode)
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which fails the run
        ready.abort()
        results.put(RankResult(job.rank, error=f"{type(exc).__name__}: {exc}"))
        return
    try:
        ready.wait()
    except threading.BrokenBarrierError:
        results.put(RankResult(job.rank, error="another process of this run failed before the start"))
        return
    go.wait()
    io_start = read_io()["rchar"]
    tensors = nbytes = 0
    try:
        for name, tensor in load(job, downloaded):
            check(name, tensor)
            tensors += 1
            nbytes += tensor.numel() * tensor.element_size()
            del tensor
        finished = time.monotonic()
        rchar = read_io()["rchar"] - io_start
        mismatches = check.finish()
        results.put(RankResult(job.rank, tensors, nbytes, finished, rchar, read_status_kib("self", "VmHWM") * 1024,
                               tuple(mismatches)))  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which fails the run
        if job.mode is Mode.NAIVE:
            downloaded.set()  # the other ranks must not wait for a download that failed
        results.put(RankResult(job.rank, tensors, nbytes, error=f"{type(exc).__name__}: {exc}"))


def _preload(mode: Mode) -> None:
    # Imports are not what is measured: every contender's modules are loaded before the clock starts.
    if mode is Mode.RUNAI:
        import runai_model_streamer  # noqa: F401
    elif mode is Mode.DAEMON:
        import streamer_client._daemon  # noqa: F401
    elif mode is Mode.EMBEDDED:
        import streamer_client  # noqa: F401

        from ..embedded import stream  # noqa: F401  (the in-process engine, imported as a load would)
        from ..readers.runai.contract import load_native

        load_native()  # Run:ai's native library, as A's import of runai_model_streamer opens it
    else:
        import boto3  # noqa: F401
        import safetensors.torch  # noqa: F401


# --------------------------------------------------------------------------- contenders


def _load_runai(job: RankJob, downloaded) -> Iterator[tuple[str, torch.Tensor]]:
    from runai_model_streamer import SafetensorsStreamer

    with SafetensorsStreamer() as streamer:
        streamer.stream_files(list(job.runai_paths), tensor_names=list(job.select), owned=not job.borrowed)
        yield from streamer.get_tensors()


def _load_client(job: RankJob, downloaded) -> Iterator[tuple[str, torch.Tensor]]:
    import streamer_client

    return streamer_client.stream(
        job.uri,
        select=list(job.select),
        rank=job.rank,
        world_size=job.world_size,
        launch_id=job.launch_id,
        borrowed=job.borrowed,
    )


def _load_naive(job: RankJob, downloaded) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    directory = Path(job.uri)
    if job.download_dir is not None:
        directory = Path(job.download_dir)
        if job.rank == 0:
            _download(job)
            downloaded.set()
        else:
            downloaded.wait()
        if not (directory / "model.safetensors.index.json").exists():
            raise RuntimeError(f"rank 0's download to {directory} failed")
    weight_map = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    handles = {}
    for name in job.select:
        shard = weight_map[name]
        if shard not in handles:
            handles[shard] = safe_open(str(directory / shard), "pt")
        # get_tensor maps the file and reads nothing until touched: clone() reads every byte into the
        # process's memory, as A's and B's owned tensors are (and as a copy to a GPU would read them).
        yield name, handles[shard].get_tensor(name).clone()


def _download(job: RankJob) -> None:
    """What a script without a streaming loader does: the SDK's managed download of every object."""
    from .sources import BUCKET, s3_client

    client = s3_client(job.endpoint)
    target = Path(job.download_dir)
    target.mkdir(parents=True, exist_ok=True)
    for key in job.downloads:
        client.download_file(BUCKET, key, str(target / key.rsplit("/", 1)[-1]))


_LOADERS = {Mode.RUNAI: _load_runai, Mode.DAEMON: _load_client, Mode.EMBEDDED: _load_client, Mode.NAIVE: _load_naive}


# --------------------------------------------------------------------------- checks


def _flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8) if tensor.numel() else torch.empty(0, dtype=torch.uint8)


def _spots(nbytes: int) -> list[tuple[int, int]]:
    n = min(SAMPLE_BYTES, nbytes)
    return [(0, n), (max(0, nbytes // 2 - n // 2), n), (nbytes - n, n)] if nbytes else []


def take_samples(truth_dir: Path, out: Path) -> None:
    """Write, for every tensor of the ground truth, its dtype, shape and sampled bytes."""
    from safetensors import safe_open

    weight_map = json.loads((truth_dir / "model.safetensors.index.json").read_text())["weight_map"]
    samples = {}
    for shard in sorted(set(weight_map.values())):
        with safe_open(str(truth_dir / shard), "pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                tensor = f.get_tensor(name)
                flat = _flat_bytes(tensor)
                spots = _spots(flat.numel())
                samples[name] = (tensor.dtype, tuple(tensor.shape), [(o, flat[o : o + n].numpy().tobytes()) for o, n in spots])
    out.write_bytes(pickle.dumps(samples))


class Checker:
    """Compares each received tensor with the ground truth; collects the names that differ."""

    def __init__(self, job: RankJob) -> None:
        self._full = job.full_check
        self._truth = Path(job.truth_dir)
        self._expected = set(job.select)
        self._seen: set[str] = set()
        self.bad: list[str] = []
        with open(job.samples_path, "rb") as f:
            self._samples = pickle.load(f)
        self._weight_map = json.loads((self._truth / "model.safetensors.index.json").read_text())["weight_map"]
        self._handles: dict = {}

    def __call__(self, name: str, tensor: torch.Tensor) -> None:
        self._seen.add(name)
        if not self._matches(name, tensor):
            self.bad.append(name)

    def _matches(self, name: str, tensor: torch.Tensor) -> bool:
        sample = self._samples.get(name)
        if sample is None:
            return False
        dtype, shape, spots = sample
        if tensor.dtype != dtype or tuple(tensor.shape) != shape or tensor.device.type != "cpu":
            return False
        flat = _flat_bytes(tensor)
        if self._full:
            from safetensors import safe_open

            shard = self._weight_map[name]
            if shard not in self._handles:
                self._handles[shard] = safe_open(str(self._truth / shard), "pt")
            return torch.equal(_flat_bytes(self._handles[shard].get_tensor(name)), flat)
        return all(flat[o : o + len(b)].numpy().tobytes() == b for o, b in spots)

    def finish(self) -> list[str]:
        """Names that differed, then names missing or not asked for."""
        return self.bad + sorted(self._expected ^ self._seen)
