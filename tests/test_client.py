"""The public client API in in-process mode: stream, load_state_dict, pull_metadata."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import streamer_client
from checkpoints import ground_truth, make_sharded_checkpoint, mixed_tensors, tensor_bytes
from streamer_client.errors import ConfigError, SelectionError


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and tensor_bytes(a) == tensor_bytes(b)
    )


@pytest.fixture
def checkpoint(tmp_path):
    src = tmp_path / "ckpt"
    tensors = mixed_tensors(seed=7)
    tensors["big.weight"] = torch.randn(512, 512)  # 1 MiB: larger than the budget below
    make_sharded_checkpoint(src, tensors, n_shards=2)
    return src


def test_load_state_dict_matches_safetensors(checkpoint):
    got = streamer_client.load_state_dict(str(checkpoint), budget="256KiB")
    truth = ground_truth(checkpoint)
    assert set(got) == set(truth)
    for name in truth:
        assert _same(got[name], truth[name]), name


def test_stream_selects_names_and_prefixes_priority_first(checkpoint):
    items = list(streamer_client.stream(checkpoint, select=["embed.weight", "layers.0.mlp."], priority="layers.0.mlp.fp8"))
    names = [n for n, _ in items]
    assert names[:2] == ["layers.0.mlp.fp8_e4m3", "layers.0.mlp.fp8_e5m2"]
    assert set(names) == {"embed.weight", "layers.0.mlp.fp8_e4m3", "layers.0.mlp.fp8_e5m2", "layers.0.mlp.int8"}


def test_bad_selection_fails_before_reading(checkpoint):
    streamer_client.load_state_dict(checkpoint, select="embed.weight")  # catalog now cached
    for shard in checkpoint.glob("*.safetensors"):
        shard.write_bytes(b"")  # any read of tensor data would now fail differently
    with pytest.raises(SelectionError, match="'no.such.tensor'"):
        streamer_client.stream(str(checkpoint), select=["embed.weight", "no.such.tensor"])


def test_argument_errors(checkpoint):
    with pytest.raises(ConfigError, match="rank 4 is outside world_size 4"):
        streamer_client.stream(checkpoint, rank=4, world_size=4)
    with pytest.raises(ConfigError, match="invalid argument"):
        streamer_client.stream(checkpoint, budget="lots")
    with pytest.raises(ConfigError, match="borrowed views cannot be kept"):
        streamer_client.load_state_dict(checkpoint, borrowed=True)


SCRIPT = textwrap.dedent(
    """
    import json, sys, torch, streamer_client
    out = {}
    for name, t in streamer_client.stream(sys.argv[1], budget="256KiB"):
        out[name] = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes().hex()
    print(json.dumps(out))
    """
)


# Run:ai 0.17.0 keeps per-process state per object store (an S3 read breaks later GCS reads in
# the same process), so each backend streams in a process of its own, as a rank would.
@pytest.mark.parametrize("backend", ["local", "s3", "gcs"], indirect=True)
def test_stream_from_each_backend_in_a_rank_process(backend, checkpoint):
    backend.put_tree("m", {p.name: p.read_bytes() for p in checkpoint.iterdir()})
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, backend.uri("m")],
        env={**os.environ, **backend.env}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    got = json.loads(result.stdout.splitlines()[-1])
    truth = ground_truth(checkpoint)
    assert set(got) == set(truth)
    for name, t in truth.items():
        assert bytes.fromhex(got[name]) == tensor_bytes(t), name
    if backend.proxy is not None:
        # Tensor bytes came through storage once: ranged GETs cover at most the shards' size.
        assert backend.proxy.count(has_range=True) > 0


def test_demo_runs_and_verifies(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "streamer_service", "demo", "--ranks", "2", "--size-mb", "8"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "demo: OK, every tensor matches safetensors" in result.stdout
    assert result.stdout.count("byte-exact") == 2


FALLBACK = """
import logging, sys, streamer_client
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
for _ in range(2):
    assert len(streamer_client.load_state_dict(sys.argv[1])) > 0
print("ok")
"""


def test_unreachable_daemon_falls_back_in_process_and_says_so_once(checkpoint, tmp_path):
    env = {**os.environ, "STREAMER_SOCKET": str(tmp_path / "nobody.sock")}
    result = subprocess.run([sys.executable, "-c", FALLBACK, str(checkpoint)], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "ok"
    said = [line for line in result.stderr.splitlines() if "no streamer daemon answers at" in line]
    assert len(said) == 1 and said[0].startswith("WARNING") and str(tmp_path / "nobody.sock") in said[0]
