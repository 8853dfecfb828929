"""Huge-page segments: what the shm dir gives, segments in whole pages, reports, clear errors.

The daemon tests run it in a private mount namespace (``unshare -m``, root only, as the Azure and
full-filesystem tests do) where the shm dir is a tmpfs mounted ``huge=always``, or a hugetlbfs whose
pool is the machine's (empty here: the exhausted-pool case). Nothing on the machine changes.
"""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import pytest
import yaml
from daemon_harness import DaemonProcess, finish, finish_failed, leftovers, segment_files

from streamer_client import _protocol as protocol
from streamer_service.daemon.pages import SMALL_PAGE, Pages, detect_pages

MIB = 2**20

namespaces = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("nsenter") is None,
    reason="needs root and util-linux unshare/nsenter for a private mount namespace",
)


def _mountinfo(*mounts: tuple[str, str, str]) -> str:
    """mountinfo lines for (mount point, fs type, super options)."""
    return "".join(
        f"{20 + i} 1 0:{i} / {point} rw,relatime - {fstype} none {options}\n" for i, (point, fstype, options) in enumerate(mounts)
    )


@pytest.mark.parametrize(
    ("fstype", "options", "shmem", "want"),
    [
        ("tmpfs", "rw,size=1024k", "always within_size advise [never] deny force", Pages(SMALL_PAGE, "tmpfs")),
        ("tmpfs", "rw,size=1024k,huge=always", "always within_size advise [never] deny force", Pages(2 * MIB, "tmpfs huge=always")),
        ("tmpfs", "rw,huge=within_size", "[never]", Pages(2 * MIB, "tmpfs huge=within_size")),
        ("tmpfs", "rw,huge=advise", "[never]", Pages(SMALL_PAGE, "tmpfs huge=advise")),
        ("tmpfs", "rw", "always within_size advise never deny [force]", Pages(2 * MIB, "tmpfs huge=always")),
        ("tmpfs", "rw,huge=always", "always within_size advise never [deny] force",
         Pages(SMALL_PAGE, "tmpfs (transparent huge pages denied by the kernel)")),
        ("hugetlbfs", "rw,pagesize=2M", "[never]", Pages(2 * MIB, "hugetlbfs pagesize=2M", hugetlbfs=True)),
        ("hugetlbfs", "rw,pagesize=1024M", "[never]", Pages(1024 * MIB, "hugetlbfs pagesize=1024M", hugetlbfs=True)),
        ("ext4", "rw", "[never]", Pages(SMALL_PAGE, "ext4")),
    ],
)  # fmt: skip
def test_detect_pages_reads_the_mount_of_the_shm_dir(tmp_path, fstype, options, shmem, want):
    shm = tmp_path / "shm"
    shm.mkdir(exist_ok=True)
    info = _mountinfo(("/", "ext4", "rw"), (str(tmp_path), "tmpfs", "rw"), (str(shm), fstype, options))
    assert detect_pages(shm, mountinfo=info, shmem_enabled=shmem, pmd_size=2 * MIB) == want


def test_detect_pages_takes_the_longest_mount_point_and_the_latest_mount(tmp_path):
    shm = tmp_path / "a" / "b"
    shm.mkdir(parents=True)
    info = _mountinfo(
        (str(tmp_path), "tmpfs", "rw,huge=always"),
        (str(tmp_path / "a"), "tmpfs", "rw"),  # nearer: the dir is on this one
        (str(tmp_path / "ab"), "tmpfs", "rw,huge=always"),  # a name prefix, not a parent
    )
    assert detect_pages(shm, mountinfo=info, shmem_enabled="[never]", pmd_size=2 * MIB).size == SMALL_PAGE
    again = info + _mountinfo((str(tmp_path / "a"), "tmpfs", "rw,huge=always"))  # mounted over it later
    assert detect_pages(shm, mountinfo=again, shmem_enabled="[never]", pmd_size=2 * MIB).size == 2 * MIB


def test_huge_pages_round_segment_sizes_up_to_whole_pages():
    pages = Pages(2 * MIB, "tmpfs huge=always")
    assert [pages.round(n) for n in (1, 2 * MIB, 2 * MIB + 1, 256 * MIB)] == [2 * MIB, 2 * MIB, 4 * MIB, 256 * MIB]
    assert Pages(SMALL_PAGE, "tmpfs").round(12345) == 12345  # small pages: exact sizes, as before


def _readyz_and_page_gauge(d: DaemonProcess) -> tuple[dict, float]:
    with d.client() as c:
        ready = c.get("/readyz").json()
        line = next(x for x in c.get("/metrics").text.splitlines() if x.startswith("streamer_shm_page_size_bytes "))
    return ready, float(line.split()[1])


def _joined_page_size(d: DaemonProcess, uri: str) -> int:
    """The segments' page size a rank's join is told (the rank then leaves at once)."""
    join = protocol.JoinRequest(uri=uri, session="pages", rank=0, world_size=1)
    with d.client() as c:
        reply = protocol.JoinReply.from_wire(c.post(protocol.JOIN_PATH, json=join.to_wire()).json())
        c.post(protocol.rank_path(reply.session_id, 0, "leave"), json=protocol.LeaveRequest().to_wire()).raise_for_status()
    return reply.shm_page_size


def _daemon_on(tmp_path, mount: str, **env: str) -> DaemonProcess:
    """A daemon (16 MiB budget) whose shm dir is ``mount`` (see DaemonProcess) in its own namespace."""
    env = {"STREAMER_CACHE_DIR": str(tmp_path / "cache"), **env}
    return DaemonProcess(tmp_path, env, "--shm-budget", "16MiB", tmpfs={tmp_path / "shm": mount}).start()


@namespaces
def test_daemon_on_a_huge_page_tmpfs_makes_whole_page_segments_and_says_so(sample, tmp_path):
    shm = tmp_path / "shm"
    d = _daemon_on(tmp_path, "96m,huge=always", STREAMER_SLOT_SIZE="3MiB", STREAMER_RETENTION_BUDGET="64MiB")
    try:
        ready, gauge = _readyz_and_page_gauge(d)
        assert (ready["shm_page_size"], ready["shm_pages"], gauge) == (2 * MIB, "tmpfs huge=always", 2 * MIB)
        assert _joined_page_size(d, str(sample)) == 2 * MIB  # a CUDA rank then page-locks (STREAMER_PIN_SEGMENTS=auto)
        result = finish(d.start_rank(str(sample), 0, 1, sample, None))
        assert result["bad"] == [] and result["got"]
        # The resident copy's segments stay: each a whole number of 2 MiB pages (ring slots of
        # 3 MiB would be 4 MiB), and nothing of the machine's /dev/shm was used.
        sizes = [p.stat().st_size for p in segment_files(d.view(shm))]
        assert sizes and all(size % (2 * MIB) == 0 for size in sizes), sizes
        assert sum(sizes) == d.stats()["resident_bytes"]
        assert list(shm.iterdir()) == []
    finally:
        d.stop()
    log = d.log.read_text()
    assert "2048 KiB pages: tmpfs huge=always" in log
    assert "KiB pages (" not in log  # no small-page warning


def test_daemon_on_small_pages_warns_once_with_what_to_do(sample, tmp_path):
    d = DaemonProcess(tmp_path, {"STREAMER_CACHE_DIR": str(tmp_path / "cache")}).start()
    try:
        ready, gauge = _readyz_and_page_gauge(d)
        assert ready["shm_page_size"] == gauge == SMALL_PAGE == _joined_page_size(d, str(sample))
        for _ in range(2):  # loads do not repeat it
            assert finish(d.start_rank(str(sample), 0, 1, sample, None))["bad"] == []
    finally:
        d.stop()
    warnings = [line for line in d.log.read_text().splitlines() if "KiB pages (" in line]
    assert len(warnings) == 1, warnings
    assert f"shared-memory dir {d.shm_dir} gives 4 KiB pages" in warnings[0]
    assert "a CUDA rank's first load copies every byte once more on the host" in warnings[0]
    assert "huge=always" in warnings[0] and "HugePages-2Mi" in warnings[0] and "docs/deploy.md" in warnings[0]


@namespaces
def test_exhausted_hugetlbfs_pool_is_a_config_error_not_a_sigbus(sample, tmp_path):
    if int(next(line.split()[1] for line in open("/proc/meminfo") if line.startswith("HugePages_Free:"))):
        pytest.skip("this machine has free huge pages: the pool is not exhausted")
    shm = tmp_path / "shm"
    d = _daemon_on(tmp_path, "hugetlbfs:pagesize=2M", STREAMER_SLOT_SIZE="2MiB", STREAMER_RANK_TIMEOUT_S="5")
    try:
        ready, _ = _readyz_and_page_gauge(d)
        assert (ready["shm_page_size"], ready["shm_pages"]) == (2 * MIB, "hugetlbfs pagesize=2M")
        rank = d.start_rank(str(sample), 0, 1, sample, None)
        result = finish_failed(rank)
        assert rank.returncode != -signal.SIGBUS
        assert result["error"]["type"] == "ConfigError"
        message = result["error"]["message"]
        assert f"hugetlbfs shared-memory dir {shm} has no free 2 MiB pages" in message
        assert "HugePages_Free" in message and "STREAMER_SHM_BUDGET" in message
        assert leftovers(d, tmp_path / "cache") == ([], [])
        assert d.healthy()
    finally:
        d.stop()


# --------------------------------------------------------------------------- the deploy variant

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"


def _apply(doc: dict, ops: list[dict]) -> dict:
    """RFC 6902 ``test``/``add``/``replace`` on ``doc`` (what the overlay uses), in place."""
    for op in ops:
        *parents, last = [int(p) if p.isdigit() else p for p in op["path"].lstrip("/").split("/")]
        target = doc
        for p in parents:
            target = target[p]
        if op["op"] == "test":
            assert target[last] == op["value"], f"{op['path']} is {target[last]!r}, the overlay expects {op['value']!r}"
        else:
            assert op["op"] in ("add", "replace") and (op["op"] == "add" or last in target or isinstance(last, int))
            target[last] = op["value"]
    return doc


def test_the_huge_page_deploy_variant_puts_the_segments_on_2mib_pages():
    kustomization = yaml.safe_load((DEPLOY / "hugepages" / "kustomization.yaml").read_text())
    assert kustomization["resources"] == ["../sidecar"]
    deployment = yaml.safe_load((DEPLOY / "sidecar" / "deployment.yaml").read_text())
    (patch,) = kustomization["patches"]
    assert patch["target"] == {"kind": "Deployment", "name": deployment["metadata"]["name"]}
    spec = _apply(deployment, yaml.safe_load(patch["patch"]))["spec"]["template"]["spec"]
    volume = next(v for v in spec["volumes"] if v["name"] == "streamer-shm")
    assert volume["emptyDir"] == {"medium": "HugePages-2Mi"}
    streamer = spec["initContainers"][0]
    env = {e["name"]: e.get("value") for e in streamer["env"]}
    mount = next(m for m in streamer["volumeMounts"] if m["name"] == "streamer-shm")
    assert mount["mountPath"] == env["STREAMER_SHM_DIR"]
    resources = streamer["resources"]
    huge = resources["limits"]["hugepages-2Mi"]
    assert resources["requests"]["hugepages-2Mi"] == huge  # Kubernetes requires requests == limits for huge pages
    gib = lambda v: int(v.removesuffix("Gi").removesuffix("GiB"))  # noqa: E731
    assert gib(env["STREAMER_SHM_BUDGET"]) < gib(huge)  # room for one oversized tensor beyond the budget
    engine = next(c for c in spec["containers"] if c["name"] == "engine")
    assert any(m["name"] == "streamer-shm" for m in engine["volumeMounts"])  # the ranks map the same volume
