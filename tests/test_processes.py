"""Full filesystems under a real daemon: the cache disk and the shm filesystem.

Each runs the daemon in a private mount namespace where the dir is a small tmpfs (root only, like
the Azure streaming tests; nothing on the machine changes). The other process scenarios of the
matrix live beside the code they exercise (docs/reliability.md): tests/test_metadata_processes.py
(32 concurrent pullers, a puller killed mid-download) and tests/test_daemon.py (a rank killed
mid-load, the daemon killed mid-load and restarted).
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from daemon_harness import DaemonProcess, finish_failed, leftovers, segment_files

from streamer_service.sample import build_sample

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("nsenter") is None,
    reason="needs root and util-linux unshare/nsenter for a private mount namespace with a small tmpfs",
)


@pytest.fixture(scope="module")
def sample(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("sample") / "ckpt"
    build_sample(src, size_mb=12)
    # A tokenizer larger than the cache filesystem below.
    (src / "tokenizer.json").write_bytes(os.urandom(512 * 1024))
    return src


def test_cache_disk_full_is_a_cache_error_and_leaves_nothing_half_filled(sample, tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir(exist_ok=True)
    d = DaemonProcess(tmp_path, {"STREAMER_CACHE_DIR": str(cache)}, tmpfs={cache: "256k"}).start()
    try:
        with d.client() as c:
            for r in (
                c.post("/v1/metadata", json={"uri": str(sample)}),
                c.post("/v1/sessions/join", json={"uri": str(sample), "session": "s", "rank": 0, "world_size": 1}),
            ):
                assert r.status_code == 500, r.text
                error = r.json()["error"]
                assert error["type"] == "CacheError"
                assert "no space left on the cache filesystem" in error["message"] and str(sample) in error["message"]
        assert list(cache.iterdir()) == []  # the tmpfs took every write, outside it nothing changed
        assert list(d.view(cache).glob("*")) == []  # not even the lock file: nothing was cached
        assert leftovers(d, cache) == ([], [])
        assert d.healthy()
    finally:
        d.stop()


@pytest.mark.parametrize(
    "env",
    [
        {},  # each segment made when the load needs it
        {"STREAMER_SEGMENT_IDLE_S": "1"},  # the ring prepared at start: it fills the dir before any load
        {"STREAMER_RETENTION_BUDGET": "64MiB"},  # kept segments made ahead of the batches that need them
    ],
    ids=["on-demand", "prepared-at-start", "retained-made-ahead"],
)
def test_shm_smaller_than_the_budget_is_a_config_error_not_a_sigbus(sample, tmp_path, env):
    d = DaemonProcess(
        tmp_path, {"STREAMER_SLOT_SIZE": "1MiB", "STREAMER_RANK_TIMEOUT_S": "5", **env}, "--shm-budget", "64MiB",
        tmpfs={tmp_path / "shm": "3m"},
    ).start()  # fmt: skip
    try:
        rank = d.start_rank(str(sample), 0, 1, sample, None)
        result = finish_failed(rank)
        assert rank.returncode != -signal.SIGBUS
        assert result["error"]["type"] == "ConfigError"
        assert str(d.shm_dir) in result["error"]["message"]
        assert result["bad"] == []  # what was delivered before is whole
        assert d.finished()[-1]["state"] == "failed"
        _, half = leftovers(d, tmp_path / "cache", timeout=10 if not env.get("STREAMER_RETENTION_BUDGET") else 0)
        # Nothing stays but the resident copy of the batches that were loaded (none without retention).
        assert half == [] and sum(p.stat().st_size for p in segment_files(d.view(d.shm_dir))) == d.stats()["resident_bytes"]
        assert d.healthy()
    finally:
        d.stop()


_MAPPING_REFUSED = """
import resource, sys
from pathlib import Path
from streamer_service.daemon.shm import Segment
vm = int(next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmSize:"))) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + 32 * 2**20, resource.RLIM_INFINITY))  # room for 32 MiB more
try:
    Segment("seg-1", Path(sys.argv[1]) / "seg-1", 256 * 2**20)  # allocated in the dir, then not mappable
except OSError as exc:
    print("refused", exc.errno)
"""


def test_a_segment_whose_mapping_fails_leaves_no_file(tmp_path):
    # The file is allocated before it is mapped: a refused mmap must not leave it for the startup sweep.
    (shm := tmp_path / "segments").mkdir()
    out = subprocess.run([sys.executable, "-c", _MAPPING_REFUSED, str(shm)], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == f"refused {errno.ENOMEM}"
    assert list(shm.iterdir()) == []


def test_segments_prepared_at_start_give_way_to_a_load_the_shm_dir_has_room_for(tmp_path):
    # A 5 MiB dir, a 4 MiB budget: the daemon prepares four 1 MiB ring slots at start; the load's
    # first batch is a 2.5 MiB tensor (its own segment), which fits only once idle ones are unlinked.
    import numpy as np
    from daemon_harness import finish, wait_until
    from safetensors.numpy import save_file

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    rng = np.random.default_rng(16)
    save_file({"big": rng.integers(0, 256, 5 * 2**19, dtype=np.uint8), "small": rng.integers(0, 256, 2**16, dtype=np.uint8)},
              str(ckpt / "model.safetensors"))  # fmt: skip
    (ckpt / "model.safetensors.index.json").write_text(
        '{"weight_map": {"big": "model.safetensors", "small": "model.safetensors"}}'
    )
    d = DaemonProcess(
        tmp_path, {"STREAMER_SLOT_SIZE": "1MiB", "STREAMER_SEGMENT_IDLE_S": "30"}, "--shm-budget", "4MiB",
        tmpfs={tmp_path / "shm": "5m"},
    ).start()  # fmt: skip
    try:
        with d.client() as c:
            ready = wait_until(
                lambda: (r := c.get("/readyz").json()) and not r["segments_preparing"] and r, what="segments prepared"
            )
        assert ready["segments_prepared"] == 4
        result = finish(d.start_rank(str(ckpt), 0, 1, ckpt, None))
        assert result["bad"] == [] and result["got"]
        assert d.finished()[-1]["state"] == "done"
    finally:
        d.stop()
