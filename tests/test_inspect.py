"""`streamer-service inspect` and the cached catalog, on every backend."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch
from checkpoints import make_sharded_checkpoint, mixed_tensors, tensor_bytes
from safetensors.torch import load_file

from streamer_service.checkpoint.open import open_checkpoint
from streamer_service.settings import Settings


def _upload(backend, src, prefix="ckpt") -> str:
    backend.put_tree(prefix, {p.name: p.read_bytes() for p in src.iterdir()})
    return backend.uri(prefix)


def test_inspect_json_slices_exact_tensor_bytes(backend, tmp_path):
    src = tmp_path / "src"
    tensors = mixed_tensors(seed=3)
    shards = make_sharded_checkpoint(src, tensors, n_shards=3)
    uri = _upload(backend, src)

    result = subprocess.run(
        [sys.executable, "-m", "streamer_service", "inspect", uri, "--json"],
        env={**os.environ, **backend.env}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [list(r) for r in rows] == [["name", "dtype", "shape", "file", "offset", "nbytes"]] * len(tensors)
    assert {r["name"] for r in rows} == set(tensors)
    assert {r["file"] for r in rows} == set(shards)

    truth = {}
    for shard in shards:
        truth.update(load_file(src / shard))
    for r in rows:
        raw = (src / r["file"]).read_bytes()[r["offset"] : r["offset"] + r["nbytes"]]
        assert raw == tensor_bytes(truth[r["name"]]), r["name"]
        assert r["shape"] == list(truth[r["name"]].shape)


def test_catalog_is_cached_and_a_changed_shard_misses(backend, tmp_path):
    src = tmp_path / "src"
    make_sharded_checkpoint(src, mixed_tensors(seed=1), n_shards=2)
    uri = _upload(backend, src)
    first = open_checkpoint(uri, Settings())
    if backend.proxy is not None:
        assert backend.proxy.count(has_range=True) >= 2 * 2  # two ranged reads per shard header
        backend.proxy.reset()
    second = open_checkpoint(uri, Settings())
    assert second.catalog == first.catalog
    if backend.proxy is not None:
        assert backend.proxy.count() == 0

    # Rewrite the checkpoint with other shapes; a forced pull of a new launch sees it.
    make_sharded_checkpoint(src, {k: torch.cat([v.reshape(-1)] * 2) for k, v in mixed_tensors(seed=1).items()}, n_shards=2)
    _upload(backend, src)
    third = open_checkpoint(uri, Settings(), force=True, launch_id="relaunch")
    assert third.catalog != first.catalog
    assert third.catalog["embed.weight"].shape == (256,)


def test_inspect_table_for_people(tmp_path):
    src = tmp_path / "src"
    make_sharded_checkpoint(src, mixed_tensors(seed=0), n_shards=1)
    result = subprocess.run(
        [sys.executable, "-m", "streamer_service", "inspect", str(src)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    header = result.stdout.splitlines()[0].split()
    assert header == ["NAME", "DTYPE", "SHAPE", "FILE", "OFFSET", "NBYTES"]
    assert "embed.weight" in result.stdout and "BF16" in result.stdout
