"""The metadata cache under real concurrent processes: one download, crash safety, force-once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from streamer_service.metadata.cache import MARKER, MetadataCache
from streamer_service.settings import Settings
from streamer_service.uri import parse_uri

FILES = {
    "config.json": b'{"model_type": "llama"}',
    "tokenizer.json": b'{"version": "1.0"}',
    "tokenizer_config.json": b"{}",
    "modeling_x.py": b"X = 1\n",
}
PULL = [sys.executable, "-m", "streamer_service", "--log-level", "INFO", "pull"]


def _env(backend, **extra) -> dict[str, str]:
    env = {**os.environ, **backend.env, **extra}
    return env


def _object_gets(backend) -> list[str]:
    """Object downloads seen at the storage side (listings excluded)."""
    return [r.path for r in backend.proxy.requests if r.method == "GET" and _is_object_get(backend.name, r)]


def _is_object_get(name: str, r) -> bool:
    if name == "s3":
        return "list-type" not in r.query
    if name == "gcs":
        return "alt=media" in r.query or "/download/" in r.path
    return "restype=container" not in r.query  # azure: listing is ?restype=container&comp=list


def _run_many(n: int, env: dict[str, str], uri: str, extra=()) -> list[subprocess.CompletedProcess]:
    procs = [
        subprocess.Popen([*PULL, uri, *extra], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(n)
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=240)
        results.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return results


def _downloads_claimed(results) -> int:
    return sum("pulled 4 metadata files" in r.stderr for r in results)


def test_concurrent_pullers_download_once(backend):
    # 32 pullers on S3 (the path that matters most), 16 on the other backends to keep the run short.
    n = 32 if backend.name == "s3" else 16
    backend.put_tree("m", FILES)
    uri = backend.uri("m")
    if backend.proxy is not None:
        backend.proxy.delay_s = 0.05  # keep the first pull busy long enough for the others to queue
    results = _run_many(n, _env(backend), uri)
    assert [r.returncode for r in results] == [0] * n, [r.stderr for r in results if r.returncode]
    dirs = {r.stdout.strip().splitlines()[-1] for r in results}
    assert dirs == {str(MetadataCache(Settings()).dir_for(parse_uri(uri)))}
    assert _downloads_claimed(results) == 1
    if backend.proxy is not None:
        assert sorted(_object_gets(backend)) == sorted(set(_object_gets(backend)))  # each file fetched once
        assert len(_object_gets(backend)) == len(FILES)
    cache_dir = Path(dirs.pop())
    assert {p.name for p in cache_dir.rglob("*") if p.is_file()} == {*FILES, MARKER}
    assert not list(cache_dir.parent.glob(".tmp-*"))


def _wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.002)
    pytest.fail(f"timed out waiting for {what}")


def test_puller_killed_mid_download_leaves_nothing_half_done(backend, tmp_path):
    files = dict(FILES)
    if backend.proxy is None:
        # Local copies are fast: a large sparse file keeps the pull busy for long enough (above the
        # 256 MiB per-file cap of metadata pulls, so the cap is raised for this test's pulls).
        env = _env(backend, STREAMER_METADATA_MAX_FILE_BYTES="1GiB")
        big = tmp_path / "big.model"
        with open(big, "wb") as f:
            f.truncate(512 * 1024 * 1024)
        files["tokenizer.model"] = b""
        backend.put_tree("m", files)
        os.replace(big, Path(backend.uri("m")) / "tokenizer.model")
    else:
        env = _env(backend)
        backend.put_tree("m", files)
        backend.proxy.delay_s = 0.5
    uri = backend.uri("m")
    root = Path(os.environ["STREAMER_CACHE_DIR"])
    final = MetadataCache(Settings()).dir_for(parse_uri(uri))
    proc = subprocess.Popen([*PULL, uri], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_for(lambda: any(p.is_file() for p in root.glob(".tmp-*/*")), 60, "the pull to write its first file")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not final.exists()
    assert list(root.glob(".tmp-*")), "the killed puller should have left its temp dir"

    if backend.proxy is not None:
        backend.proxy.delay_s = 0
    result = subprocess.run([*PULL, uri], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == str(final)
    assert (final / MARKER).is_file()
    assert {p.relative_to(final).as_posix() for p in final.rglob("*") if p.is_file()} == {*files, MARKER}
    assert list(root.glob(".tmp-*")) == []
    assert "interrupted pull" in result.stderr


LAUNCHER = """
import subprocess, sys
cmd = sys.argv[1:]
procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(8)]
fails = 0
for p in procs:
    out, err = p.communicate()
    fails += p.returncode != 0
    sys.stderr.write(err)
sys.exit(fails)
"""

RANK = (
    "import logging, sys; logging.basicConfig(level=logging.INFO); "
    "from streamer_client import pull_metadata; print(pull_metadata(sys.argv[1]))"
)


def test_force_pull_once_per_launch(backend):
    backend.put_tree("m", FILES)
    uri = backend.uri("m")
    first = subprocess.run([*PULL, uri], env=_env(backend), capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr
    cache_dir = Path(first.stdout.strip().splitlines()[-1])
    backend.put("m/config.json", b'{"model_type": "llama", "revision": 2}')
    if backend.proxy is not None:
        backend.proxy.reset()

    # Eight ranks of launch L1, all forcing: exactly one re-download, the new bytes arrive.
    env = _env(backend, TRTLLM_OBJECT_STORAGE_FORCE_PULL="1", STREAMER_LAUNCH_ID="L1")
    results = _run_many(8, env, uri)
    assert [r.returncode for r in results] == [0] * 8, [r.stderr for r in results]
    assert _downloads_claimed(results) == 1
    assert (cache_dir / "config.json").read_bytes() == b'{"model_type": "llama", "revision": 2}'
    assert json.loads((cache_dir / MARKER).read_text())["launch_id"] == "L1"
    if backend.proxy is not None:
        assert len(_object_gets(backend)) == len(FILES)
        backend.proxy.reset()

    # More pulls of the same launch (later calls, other ranks) reuse it.
    results = _run_many(4, env, uri)
    assert _downloads_claimed(results) == 0 and all(r.returncode == 0 for r in results)
    if backend.proxy is not None:
        assert backend.proxy.count() == 0

    # Default launch id: ranks started by one launcher process share it.
    forced = {k: v for k, v in env.items() if k != "STREAMER_LAUNCH_ID"}
    rank_cmd = [sys.executable, "-c", RANK, uri]
    done = subprocess.run([sys.executable, "-c", LAUNCHER, *rank_cmd], env=forced, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("pulled 4 metadata files") == 1
    assert json.loads((cache_dir / MARKER).read_text())["launch_id"].startswith("ppid-")
    if backend.proxy is not None:
        assert len(_object_gets(backend)) == len(FILES)
