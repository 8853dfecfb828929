"""The kernel's account of this process's mappings (/proc/self/smaps, /proc/self/pagemap), for
tests of buffer memory."""

from __future__ import annotations

import mmap
import struct


def mapping(address: int) -> dict[str, str]:
    """The smaps entry of the mapping holding ``address``: its perms and fields (kB values kept as text)."""
    entry: dict[str, str] | None = None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
                if entry is not None:
                    return entry
                start, end = (int(x, 16) for x in head[0].split("-"))
                entry = {"perms": head[1]} if start <= address < end else None
            elif entry is not None:
                key, _, value = line.partition(":")
                entry[key] = value.strip()
    if entry is None:
        raise AssertionError(f"no mapping holds 0x{address:x}")
    return entry


def resident_bytes(address: int) -> int:
    """Bytes of the mapping holding ``address`` that this process has pages mapped for (``Rss``)."""
    return int(mapping(address)["Rss"].split()[0]) * 1024


def resident_in(address: int, nbytes: int) -> int:
    """Bytes of ``[address, address + nbytes)`` (page-aligned) that this process has pages of its
    own mapped for: present and mapped by it alone (``/proc/self/pagemap`` bits 63 and 56), so the
    shared zero page a read maps is not counted, as in ``Rss``. Those pages only: the smaps entry
    of an anonymous buffer may be merged with a neighbour's, whose pages its ``Rss`` counts too."""
    page = mmap.PAGESIZE
    with open("/proc/self/pagemap", "rb") as pagemap:
        pagemap.seek(address // page * 8)
        entries = pagemap.read(-(-nbytes // page) * 8)
    return sum(entry >> 63 & entry >> 56 & 1 for (entry,) in struct.iter_unpack("<Q", entries)) * page
