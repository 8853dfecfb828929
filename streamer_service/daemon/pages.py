"""The pages that back a shm dir's files: 4 KiB, or huge pages.

:func:`detect_pages` reads what the shm dir's filesystem backs files
with: hugetlbfs (Kubernetes ``emptyDir: {medium: HugePages-2Mi}``), a tmpfs
mounted ``huge=always`` / ``within_size`` (or any tmpfs when the kernel's
``shmem_enabled`` is ``force``), else 4 KiB pages. With huge pages every segment
is a whole number of them (hugetlbfs requires it; on tmpfs a partial last page
would be a small one). Page-locking and first-touch costs fall with the page
count (``cudaHostRegister`` works page by page, and a 2 MiB page stands for 512
small ones), so a CUDA rank
page-locks huge-page segments for a cold load and stages 4 KiB ones
(``streamer_client._daemon``). hugetlbfs has a fixed pool: ``posix_fallocate``
reserves a segment's pages up front, so an exhausted pool is a clear error when
the segment is made, never a SIGBUS on first touch; and nothing here
``write()`` s to a segment (hugetlbfs has no write()).
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["SMALL_PAGE", "Pages", "detect_pages", "small_pages_advice"]

SMALL_PAGE = mmap.PAGESIZE
_THP_SHMEM = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
_THP_PMD_SIZE = Path("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size")


@dataclass(frozen=True)
class Pages:
    """What backs the files of a shm dir: ``size`` bytes a page, and how we know."""

    size: int
    source: str  # "hugetlbfs", "tmpfs huge=always", ..., or "tmpfs" / the fs type (small pages)
    hugetlbfs: bool = False

    @property
    def huge(self) -> bool:
        return self.size > SMALL_PAGE

    def round(self, nbytes: int) -> int:
        """``nbytes`` up to whole huge pages (unchanged on small pages: no file needs padding there)."""
        if not self.huge:
            return nbytes
        return -(-nbytes // self.size) * self.size


def _mount_of(path: Path, mountinfo: str) -> tuple[str, dict[str, str]] | None:
    """``(fs type, super options)`` of the mount holding ``path`` (the longest mount point prefix)."""
    target = os.path.realpath(path)
    best: tuple[int, str, dict[str, str]] | None = None
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 3:
            continue
        point = fields[4].replace("\\040", " ")
        if target != point and not target.startswith(point.rstrip("/") + "/"):
            continue
        if best is None or len(point) >= best[0]:  # later lines are later mounts: they win a tie
            options = dict(o.partition("=")[::2] for o in tail[2].split(","))
            best = (len(point), tail[0], options)
    return None if best is None else (best[1], best[2])


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _size(text: str) -> int | None:
    """A mount option's page size (``2M``, ``1G``, ``2097152``)."""
    units = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    text = text.strip().lower()
    number, unit = (text[:-1], text[-1]) if text and text[-1] in "kmg" else (text, "")
    return int(number) * units[unit] if number.isdigit() else None


def detect_pages(
    shm_dir: Path, *, mountinfo: str | None = None, shmem_enabled: str | None = None, pmd_size: int | None = None
) -> Pages:
    """The page size files in ``shm_dir`` get (see the module docstring). Arguments for tests."""
    mountinfo = _read(Path("/proc/self/mountinfo")) if mountinfo is None else mountinfo
    mount = _mount_of(Path(shm_dir), mountinfo)
    if mount is None:
        return Pages(SMALL_PAGE, "unknown")
    fstype, options = mount
    if fstype == "hugetlbfs":
        size = _size(options.get("pagesize", "")) or os.statvfs(shm_dir).f_bsize
        return Pages(size, f"hugetlbfs pagesize={size // 2**20}M", hugetlbfs=True)
    if fstype != "tmpfs":
        return Pages(SMALL_PAGE, fstype)
    if shmem_enabled is None:
        shmem_enabled = _read(_THP_SHMEM)
    chosen = next((w[1:-1] for w in shmem_enabled.split() if w.startswith("[")), "")
    huge = options.get("huge", "never")
    if chosen == "deny":
        return Pages(SMALL_PAGE, "tmpfs (transparent huge pages denied by the kernel)")
    if chosen == "force":
        huge = "always"
    if huge not in ("always", "within_size"):
        return Pages(SMALL_PAGE, "tmpfs" if huge == "never" else f"tmpfs huge={huge}")
    if pmd_size is None:
        pmd_size = int(_read(_THP_PMD_SIZE).strip() or 0)
    if pmd_size <= SMALL_PAGE:
        return Pages(SMALL_PAGE, f"tmpfs huge={huge} (no transparent huge pages in this kernel)")
    return Pages(pmd_size, f"tmpfs huge={huge}")


def small_pages_advice(shm_dir: Path, pages: Pages) -> str:
    """The one warning a daemon gives when its segments fall back to small pages."""
    return (
        f"shared-memory dir {shm_dir} gives {pages.size // 1024} KiB pages ({pages.source}): page-locking "
        "them costs a rank loading alone more than it saves, so a CUDA rank's first load copies every byte once "
        "more on the host (through its staging ring) than on 2 MiB pages, where it page-locks the segments beside "
        "the reads, and a cold load takes longer (several CUDA ranks of one load page-lock a ring of a few "
        "slots instead). For huge pages, point --shm-dir at a tmpfs mounted with huge=always "
        "(mount -t tmpfs -o huge=always,size=N "
        "none DIR) or at hugetlbfs (Kubernetes: emptyDir medium HugePages-2Mi with hugepages-2Mi "
        "requests); see docs/deploy.md, 'Huge-page segments'"
    )
