"""The public client API in in-process mode: stream, load_state_dict, pull_metadata."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from checkpoints import ground_truth, make_sharded_checkpoint, mixed_tensors, tensor_bytes

import streamer_client
from streamer_client.errors import CheckpointError, ConfigError, DaemonError, SelectionError


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and tensor_bytes(a) == tensor_bytes(b)


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
    # Named as the caller passed it, in one line (not as STREAMER_SHM_BUDGET, not a pydantic dump).
    with pytest.raises(ConfigError, match=r"^invalid argument: budget='lots': [^\n]+$"):
        streamer_client.stream(checkpoint, budget="lots")
    with pytest.raises(ConfigError, match=r"^invalid argument: budget='1': a budget of 1 bytes is below one slot"):
        streamer_client.stream(checkpoint, budget="1")
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


def test_budget_and_cache_dir_through_a_daemon_are_checked_and_said_once_per_process(checkpoint, daemon, tmp_path, caplog):
    """Through a daemon a bad value raises as in-process; a good one is the daemon's to decide
    (its --shm-budget, its cache): one WARNING says so per process, however many loads pass it."""
    import logging

    from streamer_client.errors import SettingsError

    d = daemon()
    for call in (streamer_client.stream, streamer_client.load_state_dict):
        with pytest.raises(SettingsError, match=r"^invalid argument: budget='lots': [^\n]+$"):
            call(checkpoint, socket=d.socket, budget="lots")
        with pytest.raises(SettingsError, match=r"^invalid argument: cache_dir=123: not a path$"):
            call(checkpoint, socket=d.socket, cache_dir=123)
    with pytest.raises(SettingsError, match=r"^invalid argument: cache_dir=123: not a path$"):
        streamer_client.pull_metadata(checkpoint, socket=d.socket, cache_dir=123)
    assert d.stats()["finished"] == []  # refused before any session was joined
    truth = ground_truth(checkpoint)
    with caplog.at_level(logging.WARNING, logger="streamer_client"), pytest.warns(RuntimeWarning) as warned:
        for _ in range(3):
            got = streamer_client.load_state_dict(checkpoint, socket=d.socket, budget="64KiB", cache_dir=tmp_path / "mine")
            assert set(got) == set(truth) and all(_same(got[n], truth[n]) for n in truth)
    said = f"budget= and cache_dir= apply to in-process loads only; the daemon at {d.socket} loads with its own (serve --shm-budget, --cache-dir)"
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == [said]
    assert [str(w.message) for w in warned if w.category is RuntimeWarning] == [said]
    assert not (tmp_path / "mine").exists()  # the daemon's cache, not the argument's
    assert len(d.finished(3)) == 3  # (the last session is filed once its thread ends, after the rank left)


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
    result = subprocess.run(
        [sys.executable, "-c", FALLBACK, str(checkpoint)], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "ok"
    said = [line for line in result.stderr.splitlines() if "no streamer daemon answers at" in line]
    assert len(said) == 1 and said[0].startswith("WARNING") and str(tmp_path / "nobody.sock") in said[0]


@pytest.mark.parametrize("backend", ["local"], indirect=True)  # in this process: one object store at most
def test_a_listing_cached_mid_upload_is_listed_again_once_the_upload_finished(backend, tmp_path):
    """A load while 2 of 5 shards exist fails naming the missing shard; once the upload finishes, the
    next load lists the shards again and succeeds without a forced pull."""
    src = tmp_path / "five"
    shards = make_sharded_checkpoint(src, mixed_tensors(seed=3), n_shards=5)
    files = {p.name: p.read_bytes() for p in src.iterdir()}
    backend.put_tree("m", {k: v for k, v in files.items() if k not in shards[2:]})  # index + 2 of 5
    uri = backend.uri("m")
    with pytest.raises(CheckpointError) as info:
        streamer_client.load_state_dict(uri)
    assert f"names shard {shards[2]!r}, which does not exist" in str(info.value)
    assert "upload is still in progress" not in str(info.value)  # a local dir is read as it is: no upload hint
    backend.put_tree("m", {k: files[k] for k in shards[2:]})  # the upload finishes
    got = streamer_client.load_state_dict(uri)  # no force: the stale listing is noticed and replaced
    want = ground_truth(src)
    assert set(got) == set(want) and all(_same(got[k], want[k]) for k in want)


def test_require_daemon_fails_instead_of_reading_storage(checkpoint, tmp_path, monkeypatch):
    with pytest.raises(
        DaemonError, match=r"no streamer daemon answers at /run/streamer/daemon.sock, and STREAMER_REQUIRE_DAEMON=1"
    ):
        streamer_client.stream(checkpoint, require_daemon=True)
    monkeypatch.setenv("STREAMER_REQUIRE_DAEMON", "1")
    monkeypatch.setenv("STREAMER_SOCKET", str(tmp_path / "nobody.sock"))
    for call in (lambda: streamer_client.load_state_dict(checkpoint), lambda: streamer_client.pull_metadata(checkpoint)):
        with pytest.raises(DaemonError, match=f"no streamer daemon answers at {tmp_path / 'nobody.sock'}"):
            call()
    assert not (tmp_path / "cache").exists()  # nothing was read in-process


def test_ranks_find_the_daemon_at_the_default_socket_the_daemon_serves_on():
    from streamer_client import _settings as settings
    from streamer_service.daemon import server

    assert server.DEFAULT_SOCKET == settings.DEFAULT_SOCKET == Path("/run/streamer/daemon.sock")
    assert settings.Settings().socket is None  # STREAMER_SOCKET unset: the default is probed


TWO_STORES = textwrap.dedent(
    """
    import json, sys, torch, streamer_client
    loads = []
    try:
        for uri in sys.argv[1:]:
            loads.append({n: t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes().hex()
                          for n, t in streamer_client.stream(uri, budget="256KiB")})
    finally:
        print(json.dumps(loads), flush=True)
    """
)


@pytest.mark.parametrize("in_daemon", [False, True], ids=["in-process", "daemon"])
def test_a_second_object_store_in_one_process_is_refused_up_front(checkpoint, s3_service, gcs_service, daemon, in_daemon):
    """Run:ai 0.17.0 fails every read from a second object store in one process (S3 then GCS, GCS
    then S3) with "File access error"; docs/daemon.md's claim is checked here, and the second load
    is refused before any read with an error that says why."""
    backends = [s3_service.new_backend(), gcs_service.new_backend()]
    try:
        env = dict(os.environ)
        for b in backends:
            b.put_tree("m", {p.name: p.read_bytes() for p in checkpoint.iterdir()})
            env.update(b.env)
        if in_daemon:
            env["STREAMER_SOCKET"] = str(daemon(env).socket)
        result = subprocess.run(
            [sys.executable, "-c", TWO_STORES, *(b.uri("m") for b in backends)],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 1
        assert (
            f"ConfigError: cannot stream {backends[1].uri('m')}: this process already streamed from s3:// and Run:ai 0.17.0 "
            "keeps per-process state per object store"
        ) in result.stderr.replace("streamer_client.errors.", ""), result.stderr[-3000:]
        truth = ground_truth(checkpoint)
        got = json.loads([line for line in result.stdout.splitlines() if line.startswith("[")][-1])
        assert len(got) == 1 and all(bytes.fromhex(got[0][n]) == tensor_bytes(t) for n, t in truth.items())  # S3 was fine
        # Of the second store only the headers were read (bytes=0-7 and the JSON after them).
        assert {r.range.split("-")[0] for r in backends[1].proxy.requests if r.range} <= {"bytes=0", "bytes=8"}
    finally:
        for b in backends:
            b.close()
