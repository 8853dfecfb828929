"""Whose memory limit the shared-memory segments count against (docs/deploy.md, "Memory sizing").

Linux charges a tmpfs page to the memory cgroup of the process that first touches it, and a later
mapping by another process does not move the charge. The daemon allocates every segment
(``posix_fallocate``) before Run:ai writes into it, so both the ring and the resident copies
should be charged to the daemon's cgroup, and nothing to the ranks' that map them. This runs the
daemon and two rank processes in two sibling memory cgroups made for the test (root; cgroup v2,
or the v1 memory controller where that is what the machine has), with a memory limit on the
daemon's, loads a checkpoint with a retention budget, and reads each cgroup's shmem counter.
Both cgroups are removed afterwards; nothing else on the machine changes.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import pytest
from daemon_harness import DaemonProcess, finish

MiB = 1024**2


def _own_memory_cgroup() -> tuple[Path, str] | None:
    """(dir of this process's memory cgroup, "v1" | "v2"), or None when there is none to use."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        hierarchy, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            base = Path("/sys/fs/cgroup/memory")
            return (base / path.lstrip("/"), "v1") if base.is_dir() else None
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        if line.startswith("0::"):
            base = Path("/sys/fs/cgroup")
            if "memory" in (base / "cgroup.controllers").read_text().split() if (base / "cgroup.controllers").exists() else False:
                return base / line[3:].lstrip("/"), "v2"
    return None


class MemoryCgroup:
    """A child memory cgroup of this process's own, removed on close."""

    def __init__(self, parent: Path, version: str, name: str, limit: int | None = None) -> None:
        self.version = version
        self.path = parent / name
        self.path.mkdir()
        if limit is not None:
            (self.path / ("memory.limit_in_bytes" if version == "v1" else "memory.max")).write_text(str(limit))

    @property
    def wrap(self) -> list[str]:
        """A command prefix that moves the command's process into this cgroup before it runs."""
        return ["sh", "-c", f'echo $$ > {self.path}/cgroup.procs && exec "$@"', "sh"]

    def shmem(self) -> int:
        """Bytes of tmpfs/shm pages charged to this cgroup (its own, not its children's)."""
        for line in (self.path / "memory.stat").read_text().splitlines():
            key, value = line.split()
            if key == "shmem":
                return int(value)
        raise AssertionError(f"no shmem in {self.path}/memory.stat")

    def close(self) -> None:
        deadline = time.monotonic() + 10
        while self.path.exists():
            try:
                self.path.rmdir()
            except OSError:  # processes still exiting
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)


@pytest.fixture
def cgroups():
    if os.geteuid() != 0:
        pytest.skip("creating memory cgroups needs root")
    found = _own_memory_cgroup()
    if found is None:
        pytest.skip("no memory cgroup controller on this machine")
    parent, version = found
    made: list[MemoryCgroup] = []

    def make(name: str, limit: int | None = None) -> MemoryCgroup:
        try:
            cg = MemoryCgroup(parent, version, f"streamer-test-{uuid.uuid4().hex[:8]}-{name}", limit)
        except OSError as exc:
            pytest.skip(f"cannot create a memory cgroup under {parent}: {exc}")
        made.append(cg)
        return cg

    yield make
    for cg in made:
        cg.close()


@pytest.fixture
def shm_root():
    """A dir on /dev/shm (tmpfs, as the manifests' shm volumes are), removed afterwards."""
    import shutil
    import tempfile

    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    root = Path(tempfile.mkdtemp(prefix="streamer-cgroup-test-", dir="/dev/shm"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


def test_ring_and_resident_copy_are_charged_to_the_daemon_not_the_ranks(cgroups, sample, shm_root):
    from streamer_service.checkpoint.catalog import build_catalog
    from streamer_service.settings import Settings
    from streamer_service.storage import open_storage
    from streamer_service.uri import parse_uri

    total = sum(t.nbytes for t in build_catalog(open_storage(parse_uri(str(sample)), Settings())).tensors)
    daemon_cg = cgroups("daemon", limit=4096 * MiB)  # the daemon container's limit
    ranks_cg = cgroups("ranks")  # the engine container
    d = DaemonProcess(shm_root, {"STREAMER_RANK_TIMEOUT_S": "300"}, "--shm-budget", "8MiB",
                      "--retention-budget", "256MiB", wrap=daemon_cg.wrap).start()  # fmt: skip
    try:
        before = daemon_cg.shmem()
        ranks = [d.start_rank(str(sample), r, 2, sample, None, wrap=ranks_cg.wrap) for r in range(2)]
        for p in ranks:
            assert finish(p)["bad"] == []
        stats = d.stats()
        resident = stats["resident_bytes"]  # segment sizes: the tensors' bytes, page-rounded
        assert total <= resident < total + 1 * MiB  # the whole checkpoint stayed in shared memory
        charged = daemon_cg.shmem() - before
        # Every resident byte (and the ring's idle segments, if any) is on the daemon's bill...
        assert resident <= charged <= resident + stats["shm_in_use"] + 1 * MiB, (charged, resident)
        # ...and none on the ranks', though both mapped all of it.
        assert ranks_cg.shmem() < 1 * MiB, ranks_cg.shmem()
    finally:
        d.stop()
    # A stopping daemon unlinks its segments: the charge goes with them.
    assert daemon_cg.shmem() < 1 * MiB
    assert list(d.shm_dir.iterdir()) == []
