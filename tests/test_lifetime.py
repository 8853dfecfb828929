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
import time
from pathlib import Path

import pytest
import torch
from daemon_harness import finish, finish_failed, wait_until
from safetensors import safe_open
from safetensors.torch import save_file

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
