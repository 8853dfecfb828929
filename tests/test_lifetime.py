"""The lifetime of a segment, with a real daemon and real rank processes: bytes a rank was handed
stay those bytes until it releases them or its process is gone, whatever happens to its session.

Each test makes the hazard real: a session that fails or a rank that is fenced while a slow rank
holds a reply, and another checkpoint's load (every float 7.0) in the same pool right after,
which takes the segments that went idle last. Every tensor a rank yields is compared with
``safetensors``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
from daemon_harness import finish, finish_failed, wait_until
from safetensors import safe_open
from safetensors.torch import save_file

from streamer_service.checkpoint.catalog import build_catalog
from streamer_service.sample import rank_selection
from streamer_service.settings import Settings
from streamer_service.storage import open_storage
from streamer_service.uri import parse_uri

# Segments stay idle for the next load, as a daemon runs by default: the next load takes the ones
# that went idle last, so a slot handed back too early is written at once.
POOLED = {"STREAMER_SLOT_SIZE": "1MiB", "STREAMER_SEGMENT_IDLE_S": "60"}


def sevens(src: Path, dst: Path) -> Path:
    """A checkpoint of ``src``'s names, dtypes and shapes with every value 7.0."""
    dst.mkdir(parents=True)
    for shard in sorted(src.glob("*.safetensors")):
        with safe_open(shard, "pt") as f:
            tensors = {name: torch.full_like(f.get_tensor(name), 7.0) for name in f.keys()}
        save_file(tensors, dst / shard.name, metadata={"format": "pt"})
    for other in src.iterdir():
        if not other.name.endswith(".safetensors"):
            shutil.copy(other, dst / other.name)
    return dst


def _replace(shard: Path) -> None:
    """A new version of ``shard`` (same bytes, another file): the load's version checks see it changed."""
    new = shard.with_name(shard.name + ".new")
    shutil.copy(shard, new)
    os.utime(new, ns=(time.time_ns(), shard.stat().st_mtime_ns + 10**9))
    os.replace(new, shard)


def _got(proc, count: int) -> None:
    for _ in range(count):
        line = proc.stderr.readline()
        assert line.startswith("got "), line


@pytest.mark.parametrize("borrowed", [False, True], ids=["owned", "borrowed"])
def test_a_failed_session_leaves_a_slow_rank_its_bytes_while_another_load_runs(sample, daemon, tmp_path, borrowed):
    """The session fails (a shard changes) while a slow rank holds a reply; another checkpoint
    loads at once in the same pool. The slow rank yields only its own checkpoint's bytes, then
    the session's error; the other load's bytes are its own."""
    other = sevens(sample, tmp_path / "sevens")
    d = daemon(POOLED, "--shm-budget", "4MiB")
    slow = d.start_rank(str(sample), 0, 1, sample, None, RANK_SLOW_S="0.5", RANK_BORROWED="1" if borrowed else "")
    _got(slow, 2)
    _replace(sample / "model-00002-of-00002.safetensors")
    failed = wait_until(lambda: [s for s in d.stats()["finished"] if s["state"] == "failed"], 120, "the session to fail")
    assert "ObjectChangedError" in json.dumps(failed) or "changed" in failed[0]["error"]
    fast = d.start_rank(str(other), 0, 1, other, None)
    assert finish(fast, timeout=120)["bad"] == []
    result = finish_failed(slow, timeout=300)
    assert result["bad"] == [] and result["got"]
    assert result["error"]["type"] == "ObjectChangedError"
    assert d.healthy()


def _catalog(src: Path):
    return build_catalog(open_storage(parse_uri(str(src)), Settings()))


def _outcome(proc, timeout: float = 300) -> dict | None:
    """A rank's result, finished or failed with a StreamerError (``error`` set); ``None`` for a
    rank the test killed."""
    out, err = proc.communicate(timeout=timeout)
    if proc.returncode == -signal.SIGKILL:
        return None
    assert proc.returncode in (0, 3), f"rank exited {proc.returncode}: {out[-1000:]} {err[-3000:]}"
    return json.loads(out.strip().splitlines()[-1])


FAULTS = ("changed", "killed", "stalled", "none")


def _round(d, fault: str, r: int, sample: Path, other: Path, tmp_path: Path, on: dict[str, str]) -> None:
    """One round: a load of a fresh copy of ``sample`` (its ranks slow; on the CPU owned or
    borrowed by round) with ``fault`` injected, and a load of ``other`` on the same pool at the
    same time. ``on``: the ranks' environment (their device, how they copy)."""
    src = tmp_path / f"round-{r}"
    shutil.copytree(sample, src)
    borrowed = "RANK_DEVICE" not in on and (fault == "changed" or r % 2)
    slow = {"RANK_SLOW_S": "0.5" if fault == "changed" else "0.2", "RANK_BORROWED": "1" if borrowed else "", **on}
    victim = {"killed": {"RANK_STALL_AFTER": "2"}, "stalled": {"RANK_STALL_AFTER": "2"}}.get(fault, {})
    names = [t.name for t in _catalog(src).tensors]
    fenced = d.log.read_text().count("rank 1 silent")
    world = 1 if fault == "changed" else 2  # one rank holding its whole checkpoint's replies, as a slow engine does
    a = [
        d.start_rank(str(src), k, world, src, rank_selection(names, k, world), **slow, **(victim if k else {}))
        for k in range(world)
    ]
    b = [d.start_rank(str(other), k, 2, other, None, RANK_AWAIT_GO="1", **on) for k in range(2)]
    if fault == "changed":
        failures = sum(s["state"] == "failed" for s in d.stats()["finished"])
        _got(a[0], 2)
        _replace(src / "model-00002-of-00002.safetensors")
        wait_until(lambda: sum(s["state"] == "failed" for s in d.stats()["finished"]) > failures, 120, "the load to fail")
    elif victim:
        wait_until(lambda: "stalled" in a[1].stderr.readline(), 120, "rank 1 to stall")
        if fault == "killed":
            a[1].kill()
        else:  # alive and silent past the rank timeout: fenced, and kept what it holds until killed below
            wait_until(lambda: d.log.read_text().count("rank 1 silent") > fenced, 120, "rank 1 to be fenced")
    for p in b:  # the other load starts once the fault has hit: it takes the segments that went idle last
        assert p.stderr.readline().strip() == "ready"
        p.stdin.write("go\n")
        p.stdin.flush()
    results = [_outcome(p) for p in b]
    assert all(res is not None and "error" not in res and res["bad"] == [] for res in results), results
    if fault == "stalled":
        a[1].kill()
    outcomes = [_outcome(p) for p in a]
    for res in outcomes:
        assert res is None or res["bad"] == [], res
    if fault == "none":
        assert all(res is not None and "error" not in res for res in outcomes), outcomes
    if fault == "changed":
        assert outcomes[0]["error"]["type"] == "ObjectChangedError"
    shutil.rmtree(src)
    assert d.healthy()


def _churn(sample: Path, daemon, tmp_path: Path, rounds: int, on: dict[str, str] | None = None) -> None:
    other = sevens(sample, tmp_path / "sevens")
    d = daemon({**POOLED, "STREAMER_RANK_TIMEOUT_S": "5"}, "--shm-budget", "4MiB")
    for r in range(rounds):
        _round(d, FAULTS[r % len(FAULTS)], r, sample, other, tmp_path, on or {})
    # Last, the daemon stops while a slow rank holds a reply: the rank yields its own bytes, then the error.
    src = tmp_path / "last"
    shutil.copytree(sample, src)
    slow = d.start_rank(str(src), 0, 1, src, None, RANK_SLOW_S="0.2", **(on or {}))
    _got(slow, 2)
    d.stop()
    res = _outcome(slow)
    assert res["bad"] == [] and res["error"]["type"] in ("SessionError", "DaemonError"), res
    assert list(d.shm_dir.iterdir()) == []


@pytest.mark.timeout(900)  # rank processes start torch: minutes on a loaded 2-core machine
def test_churn_of_loads_with_faults_never_yields_a_wrong_byte(sample, daemon, tmp_path):
    """Loads of different checkpoints share a small pool while faults hit them (a shard changed, a
    rank killed -9, a live rank stalled past the rank timeout, the daemon stopped) and slow ranks
    hold replies: every tensor any rank yields equals safetensors."""
    _churn(sample, daemon, tmp_path, rounds=len(FAULTS))


# The ranks page-lock the daemon's segments and copy from them to the GPU by DMA
# (STREAMER_PIN_SEGMENTS=always): a segment reused while a rank's copies still read it would show
# as a wrong tensor on the device.
PAGE_LOCKED = {"RANK_DEVICE": "cuda:0", "STREAMER_PIN_SEGMENTS": "always"}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.timeout(900)
def test_churn_of_page_locked_cuda_loads_with_faults_never_yields_a_wrong_byte(sample, daemon, tmp_path):
    """The churn above with every rank on a GPU, copying from page-locked segments."""
    _churn(sample, daemon, tmp_path, rounds=2 * len(FAULTS), on=PAGE_LOCKED)


@pytest.mark.soak
@pytest.mark.timeout(7200)
def test_churn_of_loads_with_faults_never_yields_a_wrong_byte_soak(sample, daemon, tmp_path):
    _churn(sample, daemon, tmp_path, rounds=200)
