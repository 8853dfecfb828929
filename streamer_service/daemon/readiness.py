"""Whether the daemon can take sessions: what ``GET /readyz`` answers, and why not.

Not ready while the daemon stops, once its reaper thread has ended (dead ranks would never be
reclaimed, idle segments never trimmed), or while the shm filesystem cannot hold the ring of
slots one load streams through: its free space plus what the daemon's own segments already
take there (ring, idle and resident segments), against the slots a load takes before its ranks
release any (``sizing.first_ring_slots``). A filesystem smaller than that fails every load at its first segment it has no room for.
Not ready either while someone else has removed a segment the daemon holds (``shm.SegmentStore.vanished``):
every load handed it fails.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..sizing import first_ring_slots
from .pages import Pages
from .shm import SegmentStore

__all__ = ["ShmRoom", "segments_removed", "shm_room"]


@dataclass(frozen=True)
class ShmRoom:
    shm_dir: Path
    free: int  # bytes the filesystem has free for this daemon
    held: int  # bytes of this daemon's segments on it
    ring: int  # bytes of the ring one load streams through
    slot: int
    budget: int  # what STREAMER_SHM_BUDGET claims

    @property
    def problem(self) -> str | None:
        if self.free + self.held >= self.ring:
            return None
        slots = self.ring // self.slot
        return (
            f"the shm filesystem at {self.shm_dir} has {_mib(self.free)} free"
            + (f" (and {_mib(self.held)} in this daemon's segments)" if self.held else "")
            + f": less than the {slots} slot{'s' if slots != 1 else ''} of {_mib(self.slot)} one load streams through,"
            f" while STREAMER_SHM_BUDGET claims {_mib(self.budget)}; give the shm dir more room"
            " (a larger tmpfs or emptyDir sizeLimit) or lower --shm-budget or STREAMER_SLOT_SIZE"
        )


def shm_room(shm_dir: Path, pages: Pages, *, budget: int, slot: int, in_flight: int, held: int) -> ShmRoom:
    ring = max(first_ring_slots(budget, slot, in_flight), 1) * pages.round(slot)
    return ShmRoom(shm_dir, _free_bytes(shm_dir, pages), held, ring, slot, budget)


def segments_removed(store: SegmentStore) -> str | None:
    """Why the daemon is not ready where another process removed some of its segments."""
    gone = store.vanished()
    if not gone:
        return None
    return (
        f"{len(gone)} of this daemon's shared-memory segments were removed from {store.shm_dir} by another process "
        f"({', '.join(gone[:4])}{', ...' if len(gone) > 4 else ''}): loads handed them fail; restart the daemon"
    )


def _free_bytes(shm_dir: Path, pages: Pages) -> int:
    st = os.statvfs(shm_dir)
    if st.f_blocks == 0 and pages.hugetlbfs:
        # hugetlbfs mounted without a size: its room is the machine's pool of free huge pages.
        try:
            return int(Path(f"/sys/kernel/mm/hugepages/hugepages-{pages.size // 1024}kB/free_hugepages").read_text()) * pages.size
        except (OSError, ValueError):
            return 0
    return st.f_bavail * st.f_frsize


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"
