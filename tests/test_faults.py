"""Storage faults under a real daemon: a fault-injecting proxy in front of the storage emulator.

Where retries can recover (a share of ranged GETs answered 503 SlowDown or 500, reset mid-body,
or cut short), the load completes byte-exact. Where they cannot (every tensor read stalls past
the timeout, or is refused), the rank gets a clear error naming the object URI and byte range
within a bounded time, and every tensor it did get is whole. An object overwritten during a load
fails it naming the key; no rank ever sees a mix of old and new bytes. After every scenario the
shm dir is empty, the cache holds no half-filled dir and the daemon answers ``/healthz``.

Recoverable faults run on S3 and GCS (one Run:ai backend per daemon process); the rest on S3.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from daemon_harness import DaemonProcess, finish, finish_failed, leftovers
from harness.faults import always, cloud_error, every_nth, range_get
from harness.proxy import Fault, RecordedRequest

from streamer_service.sample import build_sample

# Tight storage settings, so that the unrecoverable cases end in seconds (docs/reliability.md).
FAST_FAILING = {
    "STREAMER_STORAGE_READ_TIMEOUT_S": "1",
    "STREAMER_STORAGE_RETRIES": "1",
    "STREAMER_STORAGE_RETRY_DEADLINE_S": "2",
}
BOUND_S = 60  # measured here: 10-20 s for a stalled or refused load with FAST_FAILING


@pytest.fixture(scope="module")
def sample(tmp_path_factory) -> Path:
    """A ~12 MB MoE-shaped checkpoint in 2 shards; with 1 MiB slots a load is ~20 ranged GETs."""
    src = tmp_path_factory.mktemp("sample") / "ckpt"
    build_sample(src, size_mb=12)
    return src


@pytest.fixture
def cloud_daemon(request, backend, sample, tmp_path):
    """The sample on the backend (through the proxy) and a daemon reading it; yields (daemon, uri)."""
    backend.put_tree("ckpt", {p.name: p.read_bytes() for p in sample.iterdir()})
    d = DaemonProcess(
        tmp_path, {**backend.env, **FAST_FAILING, "STREAMER_SLOT_SIZE": "1MiB", "STREAMER_RANK_TIMEOUT_S": "5"},
        "--shm-budget", "4MiB",
    )  # fmt: skip
    d.start()
    try:
        yield d, backend.uri("ckpt")
    finally:
        backend.proxy.release_stalls()
        d.stop()


def _names(sample: Path) -> list[str]:
    return sorted(json.loads((sample / "model.safetensors.index.json").read_text())["weight_map"])


def _clean_after(d: DaemonProcess) -> None:
    shm, half = leftovers(d, Path(os.environ["STREAMER_CACHE_DIR"]))
    assert (shm, half) == ([], [])
    assert d.healthy()


def _tensor_read(r: RecordedRequest) -> bool:
    """A ranged GET of tensor bytes (Run:ai), not of a header (``bytes=0-7``, ``bytes=8-...``)."""
    return range_get(r) and int(re.match(r"bytes=(\d+)-", r.range).group(1)) > 8


RECOVERABLE = {  # kind -> the fault, in the format of the backend's cloud
    "503-slowdown": lambda backend: cloud_error(backend, 503),
    "500-internal": lambda backend: cloud_error(backend, 500),
    "reset-mid-body": lambda backend: Fault.reset(),
    "truncated-body": lambda backend: Fault.truncated(),
}


def _each_kind_in_turn(backend: str) -> tuple:
    """A hook that answers with the next kind of fault each time it is asked, and a log of them."""
    order = itertools.cycle(RECOVERABLE)
    used: list[tuple[str, str]] = []

    def hook(r: RecordedRequest):
        kind = next(order)
        used.append((kind, r.range))
        return RECOVERABLE[kind](backend)

    return hook, used


@pytest.mark.parametrize("backend", ["s3", "gcs"], indirect=True)
def test_a_share_of_failing_range_gets_is_retried_byte_exact(cloud_daemon, backend, sample):
    d, uri = cloud_daemon
    # Every third ranged GET, header reads (boto3) and tensor reads (Run:ai) alike, fails with the
    # next of 503 SlowDown, 500, a reset mid-body and a truncated body.
    hook, used = _each_kind_in_turn(backend.name)
    backend.proxy.fault = every_nth(3, hook)
    result = finish(d.start_rank(uri, 0, 1, sample, None))
    assert result["bad"] == [] and sorted(result["got"]) == _names(sample)
    assert {kind for kind, _ in used} == set(RECOVERABLE)
    damaged = [r for r in backend.proxy.requests if range_get(r) and r.status in (None, 500, 503)]
    assert len(damaged) == len(used)
    assert any(_tensor_read(r) for r in damaged) and any(not _tensor_read(r) for r in damaged)
    assert d.finished()[-1]["state"] == "done"
    _clean_after(d)


UNRECOVERABLE = {
    "stalled-past-timeout": always(Fault.stalled(120)),
    "always-503": lambda r: cloud_error("s3", 503),
}


@pytest.mark.parametrize("backend", ["s3"], indirect=True)
@pytest.mark.parametrize("fault", list(UNRECOVERABLE))
def test_unrecoverable_reads_fail_clearly_in_bounded_time(fault, cloud_daemon, backend, sample):
    d, uri = cloud_daemon
    hook = UNRECOVERABLE[fault]
    backend.proxy.fault = lambda r: hook(r) if _tensor_read(r) else None
    started = time.monotonic()
    result = finish_failed(d.start_rank(uri, 0, 1, sample, None))
    elapsed = time.monotonic() - started
    assert elapsed < BOUND_S, elapsed
    error = result["error"]
    assert error["type"] == "StorageError", error
    assert re.search(rf"{re.escape(uri)}/model-0000\d-of-00002\.safetensors: bytes \[\d+, \d+\): ", error["message"])
    assert "; tensors '" in error["message"]
    assert result["bad"] == []  # nothing partial: whatever arrived before the failure is whole
    assert len(result["got"]) < len(_names(sample))
    # Run:ai retried each failed read (RUNAI_STREAMER_S3_MAX_RETRIES from STREAMER_STORAGE_RETRIES).
    attempts = {}
    for r in backend.proxy.requests:
        if _tensor_read(r):
            attempts[r.range] = attempts.get(r.range, 0) + 1
    assert attempts and min(attempts.values()) >= 1 + int(FAST_FAILING["STREAMER_STORAGE_RETRIES"])
    backend.proxy.release_stalls()
    finished = d.finished()[-1]
    assert finished["state"] == "failed" and uri in finished["error"]
    _clean_after(d)


@pytest.mark.parametrize("backend", ["s3"], indirect=True)
def test_an_object_overwritten_mid_load_fails_naming_the_key_never_mixing(cloud_daemon, backend, sample, tmp_path):
    d, uri = cloud_daemon
    # The same shapes with other values: equal sizes and headers, so only the bytes differ.
    new = tmp_path / "new"
    build_sample(new, size_mb=12, seed=1)
    shard = "model-00002-of-00002.safetensors"
    assert (new / shard).stat().st_size == (sample / shard).stat().st_size

    def overwrite_on_first_read(r: RecordedRequest):
        if _tensor_read(r) and r.path.endswith(shard) and not replaced:
            replaced.append(r.range)
            backend.put(f"ckpt/{shard}", (new / shard).read_bytes())  # before this GET is forwarded
        return None

    replaced: list[str] = []
    backend.proxy.fault = overwrite_on_first_read
    result = finish_failed(d.start_rank(uri, 0, 1, sample, None))
    assert replaced
    assert result["error"]["type"] == "ObjectChangedError"
    assert result["error"]["key"] == shard and f"{uri}/{shard} changed while it was being loaded" in result["error"]["message"]
    assert result["bad"] == []  # every tensor delivered is the old version's
    _clean_after(d)

    # The metadata cache still records the old version: the next load refuses it too, and says how to recover.
    backend.proxy.fault = None
    again = finish_failed(d.start_rank(uri, 0, 1, sample, None))
    assert again["error"]["type"] == "ObjectChangedError" and again["bad"] == []
    assert "TRTLLM_OBJECT_STORAGE_FORCE_PULL=1" in again["error"]["message"]
    backend.put_tree("ckpt", {p.name: p.read_bytes() for p in new.iterdir()})  # the rest of the new version
    pull = "import streamer_client, sys; streamer_client.pull_metadata(sys.argv[1], force=True, launch_id='relaunch')"
    subprocess.run([sys.executable, "-c", pull, uri], env=d.rank_env(), check=True, timeout=60)
    result = finish(d.start_rank(uri, 0, 1, new, None))
    assert result["bad"] == [] and sorted(result["got"]) == _names(new)
    _clean_after(d)


def test_in_process_loads_check_object_versions_too(sample, tmp_path):
    """The embedded engine (no daemon) runs the same check: a local shard rewritten mid-load."""
    from streamer_client._request import StreamRequest
    from streamer_client.errors import ObjectChangedError
    from streamer_service.embedded.backend import stream
    from streamer_service.settings import Settings

    src, new = tmp_path / "ckpt", tmp_path / "new"
    subprocess.run(["cp", "-r", str(sample), str(src)], check=True)
    build_sample(new, size_mb=12, seed=1)
    shard = "model-00002-of-00002.safetensors"
    settings = Settings(shm_budget="2MiB", slot_size="1MiB")
    got = []
    with pytest.raises(ObjectChangedError) as info:
        for name, _ in stream(StreamRequest(str(src)), settings):
            if not got:
                (src / shard).write_bytes((new / shard).read_bytes())  # same size, other bytes
            got.append(name)
    message = str(info.value)
    if info.value.key == shard:  # the version check after a batch saw the rewrite
        assert f"{src / shard} changed while it was being loaded" in message
    else:
        # A read still in flight when write_bytes truncated the file met its end: the range fails
        # (Run:ai: a short read; the mapped reader: the copy's SIGBUS guard), naming its tensors.
        assert message.startswith(f"{src / shard}: bytes [") and ("End of file" in message or "cut short" in message)
    assert 0 < len(got) < len(_names(sample))


CREDENTIALS_NAMED = {
    "s3": "credentials: environment variables AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY; check them",
    "gcs": "credentials: anonymous (STORAGE_EMULATOR_HOST or no Application Default Credentials); check them",
}


@pytest.mark.parametrize("backend", ["s3", "gcs"], indirect=True)
def test_refused_credentials_with_a_warm_cache_are_an_access_error_naming_their_source(cloud_daemon, backend, sample):
    """With metadata and catalog cached, only Run:ai touches storage, and it says "File access error"
    for a 403: that is an access error naming the credentials' source, not the endpoint settings."""
    d, uri = cloud_daemon
    assert finish(d.start_rank(uri, 0, 1, sample, None))["bad"] == []  # warms the cache
    backend.proxy.fault = lambda r: cloud_error(backend.name, 403, r.method)  # credentials revoked
    result = finish_failed(d.start_rank(uri, 0, 1, sample, None))
    error = result["error"]
    assert error["type"] == "StorageAccessDeniedError", error
    assert (
        error["message"].startswith("access denied to 'ckpt/model-0000") and CREDENTIALS_NAMED[backend.name] in error["message"]
    )
    assert result["got"] == [] and result["bad"] == []
    _clean_after(d)
