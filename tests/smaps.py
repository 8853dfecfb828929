"""The kernel's account of this process's mappings (/proc/self/smaps), for tests of buffer memory."""

from __future__ import annotations


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
