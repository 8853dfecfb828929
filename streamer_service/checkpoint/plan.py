"""From a selection of tensors to an ordered list of buffer-sized batches of byte ranges.

Two steps, both pure (no I/O, no torch), so a selection fails before any data
is read and the daemon can plan the union of several ranks' selections:

1. :func:`select` turns names / name prefixes (and priority prefixes) into the
   tensors to deliver, in delivery order (docs/architecture.md): priority groups first,
   then the rest in checkpoint order.
2. :func:`build_plan` turns any list of tensors, in delivery order, into
   :class:`Batch` es (docs/architecture.md):

   - adjacent tensors -- same file, byte-contiguous there, consecutive in
     delivery order -- are coalesced into one :class:`FileRange`;
   - ranges are packed into slots of at most ``slot_size`` buffer bytes, and a
     tensor is never split across slots;
   - a tensor that does not fit an empty slot is *oversized*: its own batch and
     its own buffer, read in parts of at most ``slot_size`` bytes.

   :func:`in_parts` turns each oversized batch into slot batches of one part each,
   for a reader with no buffer but its slots.

Buffer layout: each range starts at a buffer offset congruent to its file
offset modulo ``align`` (a few pad bytes at most). With the buffer's base
aligned to ``align`` that gives two things for the price of < ``align`` bytes
per range: a destination Run:ai can read into with O_DIRECT should a direct
filesystem strategy be chosen (its docstrings: ``runai_probe_direct_block_size``,
typically 512 or 4096 bytes), and tensors that are aligned in the file are
aligned in memory, so zero-copy views and device copies see naturally aligned
data. Pads count against ``slot_size``.
"""

from __future__ import annotations

import bisect
import enum
import mmap
from collections.abc import Mapping, Sequence, Set
from types import MappingProxyType
from typing import NamedTuple

from streamer_client._slicing import Cut
from streamer_client.errors import ConfigError, SelectionError

from .header import TensorInfo

__all__ = [
    "DEFAULT_ALIGN",
    "Batch",
    "BatchKind",
    "FileRange",
    "Placement",
    "Part",
    "Plan",
    "build_plan",
    "delivery_order",
    "in_parts",
    "select",
    "union_order",
]

DEFAULT_ALIGN = mmap.PAGESIZE
"""Range alignment in buffers: the page size covers the usual direct-I/O blocks and every dtype."""


# --------------------------------------------------------------------------- selection


def select(
    catalog_tensors: Sequence[TensorInfo],
    select: Sequence[str] | None = None,
    priority: Sequence[str] | None = None,
) -> list[TensorInfo]:
    """The tensors to deliver, in delivery order.

    ``catalog_tensors`` are in checkpoint order (as ``Catalog.tensors`` holds them). An entry of
    ``select`` or ``priority`` that equals the name of one of the checkpoint's tensors is that name,
    whether this selection holds it or not; any other entry is a plain string prefix (so
    ``"model.layers.1"`` also covers ``model.layers.10``: write ``"model.layers.1."`` for layer 1
    alone). ``select=None`` takes every tensor. Tensors matching ``priority`` entries come first,
    grouped in the order of the entries; the rest follows in checkpoint order.

    Fails closed with :class:`SelectionError`, before anything is read, on: an empty list, an
    empty or repeated entry, an entry that matches no tensor (for ``priority``: no selected
    tensor), and two entries that overlap (a prefix covering another entry; both are named).
    """
    if select is None:
        chosen = list(catalog_tensors)
    else:
        entries = _Entries.parse(select, "selection", [t.name for t in catalog_tensors])
        wanted = entries.matched_names()
        chosen = [t for t in catalog_tensors if t.name in wanted]
    if priority is None:
        return chosen
    catalog_names = frozenset(t.name for t in catalog_tensors)
    _Entries.parse(priority, "priority", [t.name for t in chosen], exact=catalog_names)
    return delivery_order(chosen, priority, catalog_names)


def union_order(
    catalog_tensors: Sequence[TensorInfo], ranks: Sequence[tuple[Sequence[TensorInfo], Sequence[str] | None]]
) -> list[TensorInfo]:
    """The daemon's delivery order for several ranks: ``(chosen, priority)`` of each, in rank order.

    The union of their selections, ordered by :func:`delivery_order` with their priority entries
    concatenated in rank order. Each rank gets its tensors in this order, so a rank whose priority
    entries are the group's gets exactly the order ``select`` gives it in-process.
    """
    union = {t.name for chosen, _ in ranks for t in chosen}
    priority = list(dict.fromkeys(p for _, entries in ranks for p in (entries or ())))
    catalog_names = frozenset(t.name for t in catalog_tensors)
    return delivery_order([t for t in catalog_tensors if t.name in union], priority, catalog_names)


def delivery_order(tensors: Sequence[TensorInfo], priority: Sequence[str] | None, names: Set[str]) -> list[TensorInfo]:
    """``tensors`` (in checkpoint order) in delivery order: the one ordering rule of both modes.

    Tensors matching a ``priority`` entry come first, grouped in the order of the entries, then
    the rest in checkpoint order. An entry in ``names`` (the whole checkpoint's tensor names, not
    only those of ``tensors``) is that name; any other entry is a prefix: an entry means the same
    for a rank's selection and for the union of several. A tensor two entries match belongs to
    the first (``select`` refuses overlaps in one rank's entries; the daemon orders the union of
    its ranks' selections with their entries concatenated in rank order, where they may overlap).
    """
    if not priority:
        return list(tensors)
    exact: dict[str, int] = {}
    prefixes: dict[str, int] = {}
    for i, entry in enumerate(priority):
        (exact if entry in names else prefixes).setdefault(entry, i)
    rest = len(priority)

    def group(t: TensorInfo) -> int:
        # Every prefix of the name is looked up once: O(len(name)) per tensor, whatever the entries.
        found = [prefixes[t.name[:k]] for k in range(1, len(t.name) + 1) if t.name[:k] in prefixes]
        if t.name in exact:
            found.append(exact[t.name])
        return min(found, default=rest)

    return sorted(tensors, key=group)  # stable: checkpoint order within a group


class _Entries:
    """Validated selection or priority entries against the names they may match."""

    __slots__ = ("what", "entries", "sorted_names", "names", "exact")

    def __init__(
        self, what: str, entries: tuple[str, ...], sorted_names: tuple[str, ...], names: frozenset[str], exact: frozenset[str]
    ) -> None:
        self.what = what
        self.entries = entries
        self.sorted_names = sorted_names
        self.names = names
        self.exact = exact  # an entry equal to one of these is that name, never a prefix

    @classmethod
    def parse(cls, entries: Sequence[str], what: str, names: Sequence[str], exact: Set[str] | None = None) -> _Entries:
        """``entries`` checked against ``names`` (what they may match); ``exact``: the names an
        entry equal to is that name (the checkpoint's, which may be more than ``names``)."""
        if isinstance(entries, str):  # a lone string would otherwise be read as a list of letters
            raise SelectionError(f"{what} must be a list of names or prefixes, got the string {entries!r}")
        matchable = frozenset(names)
        parsed = cls(what, tuple(entries), tuple(sorted(names)), matchable, matchable if exact is None else frozenset(exact))
        parsed._check_entries()
        for entry in parsed.entries:
            if not parsed.matches(entry):
                raise SelectionError(
                    f"{what} entry {entry!r} matches no {'selected ' if what == 'priority' else ''}tensor name or prefix",
                    key=entry,
                )
        parsed._check_no_overlap()
        return parsed

    def _check_entries(self) -> None:
        if not self.entries:
            raise SelectionError(f"{self.what} is empty: pass None to take every tensor")
        seen: set[str] = set()
        for entry in self.entries:
            if not isinstance(entry, str) or not entry:
                raise SelectionError(f"{self.what} entry {entry!r} is not a non-empty string", key=str(entry))
            if entry in seen:
                raise SelectionError(f"{self.what} entry {entry!r} is given twice", key=entry)
            seen.add(entry)

    def _check_no_overlap(self) -> None:
        # Strings starting with p follow p directly in sorted order, so an entry can only be covered
        # by the latest prefix entry before it; a name entry covers nothing but itself.
        last_prefix: str | None = None
        for entry in sorted(self.entries):
            if last_prefix is not None and entry.startswith(last_prefix):
                raise SelectionError(
                    f"{self.what} entries overlap: prefix {last_prefix!r} also covers {entry!r}",
                    key=entry,
                )
            if entry not in self.exact:
                last_prefix = entry

    def matches(self, entry: str) -> list[str]:
        """``[entry]`` if it is a name (``[]`` if not one of ``names``), else every name it is a
        prefix of (sorted)."""
        if entry in self.exact:
            return [entry] if entry in self.names else []
        start = bisect.bisect_left(self.sorted_names, entry)
        end = start
        while end < len(self.sorted_names) and self.sorted_names[end].startswith(entry):
            end += 1
        return list(self.sorted_names[start:end])

    def matched_names(self) -> set[str]:
        return {name for entry in self.entries for name in self.matches(entry)}


# --------------------------------------------------------------------------- plan


class BatchKind(enum.Enum):
    SLOT = "slot"
    """Fits a ring slot: the slot is reused once the batch has been delivered."""

    OVERSIZED = "oversized"
    """One tensor that fits no slot: a dedicated buffer, read in parts of at most ``slot_size``."""


class FileRange(NamedTuple):
    """``nbytes`` read from ``file`` at ``offset`` into the batch buffer at ``buffer_offset``."""

    file: str
    offset: int
    nbytes: int
    buffer_offset: int

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


class Placement(NamedTuple):
    """Where a tensor's bytes land in its batch's buffer."""

    tensor: TensorInfo
    buffer_offset: int


class Batch(NamedTuple):
    """One buffer's worth: the ranges to read into it and the tensors they deliver, in order.

    ``buffer_bytes`` is what the buffer must hold (data plus alignment pads); a batch of empty
    tensors has no ranges and needs no buffer.
    """

    kind: BatchKind
    ranges: tuple[FileRange, ...]
    placements: tuple[Placement, ...]
    buffer_bytes: int

    @property
    def data_bytes(self) -> int:
        return sum(r.nbytes for r in self.ranges)

    @property
    def files(self) -> tuple[str, ...]:
        """The files this batch reads, in order of first appearance."""
        return tuple(dict.fromkeys(r.file for r in self.ranges))


class Plan(NamedTuple):
    """Batches in delivery order, for slots of ``slot_size`` bytes with ranges aligned to ``align``;
    ``cuts``: the tensors a load cuts after it read them (``checkpoint.slices.sliced``), by name."""

    batches: tuple[Batch, ...]
    slot_size: int
    align: int
    cuts: Mapping[str, Cut] = MappingProxyType({})

    @property
    def tensors(self) -> tuple[TensorInfo, ...]:
        """Every planned tensor, in delivery order."""
        return tuple(p.tensor for b in self.batches for p in b.placements)

    @property
    def data_bytes(self) -> int:
        return sum(b.data_bytes for b in self.batches)

    @property
    def slot_bytes(self) -> int:
        """The buffer a ring slot needs for this plan: its largest slot batch (<= ``slot_size``)."""
        return max((b.buffer_bytes for b in self.batches if b.kind is BatchKind.SLOT), default=0)

    @property
    def oversized_bytes(self) -> int:
        """The largest dedicated buffer this plan needs (0 without oversized tensors)."""
        return max((b.buffer_bytes for b in self.batches if b.kind is BatchKind.OVERSIZED), default=0)

    def __repr__(self) -> str:
        oversized = sum(b.kind is BatchKind.OVERSIZED for b in self.batches)
        return (
            f"Plan({len(self.batches)} batches ({oversized} oversized), {len(self.tensors)} tensors, "
            f"{self.data_bytes} bytes, slot_size={self.slot_size}, align={self.align})"
        )


def build_plan(tensors: Sequence[TensorInfo], slot_size: int, *, align: int = DEFAULT_ALIGN) -> Plan:
    """Plan ``tensors`` (in delivery order, each at most once) into batches; see the module docstring."""
    _check_plan_args(slot_size, align)
    _check_unique(tensors)
    batches: list[Batch] = []
    packer = _SlotPacker(slot_size, align)
    for tensor in tensors:
        if packer.add(tensor):
            continue
        packer.flush_into(batches)
        if not packer.add(tensor):  # does not fit even an empty slot
            batches.append(_oversized(tensor, slot_size, align))
    packer.flush_into(batches)
    return Plan(tuple(batches), slot_size, align)


def _check_plan_args(slot_size: int, align: int) -> None:
    if not isinstance(slot_size, int) or slot_size <= 0:
        raise ConfigError(f"slot size must be a positive number of bytes, got {slot_size!r}")
    if not isinstance(align, int) or align <= 0 or align & (align - 1):
        raise ConfigError(f"alignment must be a power of two, got {align!r}")


def _check_unique(tensors: Sequence[TensorInfo]) -> None:
    seen: set[str] = set()
    for tensor in tensors:
        if tensor.name in seen:
            raise SelectionError(f"tensor {tensor.name!r} is planned twice", key=tensor.name)
        seen.add(tensor.name)


def _padded(cursor: int, file_offset: int, align: int) -> int:
    """The first buffer offset >= ``cursor`` congruent to ``file_offset`` modulo ``align``."""
    return cursor + (file_offset - cursor) % align


class _SlotPacker:
    """Accumulates one slot batch; ``add`` says whether the tensor fit."""

    __slots__ = ("slot_size", "align", "ranges", "placements", "cursor")

    def __init__(self, slot_size: int, align: int) -> None:
        self.slot_size = slot_size
        self.align = align
        self.ranges: list[FileRange] = []
        self.placements: list[Placement] = []
        self.cursor = 0  # buffer bytes used so far

    def add(self, tensor: TensorInfo) -> bool:
        if tensor.nbytes == 0:
            # Nothing to read: it needs no range and must not break the coalescing of its neighbours.
            self.placements.append(Placement(tensor, self.cursor))
            return True
        if self._extends_last_range(tensor):
            return self._extend(tensor)
        return self._open_range(tensor)

    def _extends_last_range(self, tensor: TensorInfo) -> bool:
        # The last range always ends with the previous non-empty tensor of this batch, so this is
        # "same file, byte-contiguous, consecutive in delivery order".
        last = self.ranges[-1] if self.ranges else None
        return last is not None and last.file == tensor.file and last.end == tensor.offset

    def _extend(self, tensor: TensorInfo) -> bool:
        if self.cursor + tensor.nbytes > self.slot_size:
            return False
        last = self.ranges[-1]
        self.ranges[-1] = FileRange(last.file, last.offset, last.nbytes + tensor.nbytes, last.buffer_offset)
        self._place(tensor, self.cursor)
        return True

    def _open_range(self, tensor: TensorInfo) -> bool:
        start = _padded(self.cursor, tensor.offset, self.align)
        if start + tensor.nbytes > self.slot_size:
            return False
        self.ranges.append(FileRange(tensor.file, tensor.offset, tensor.nbytes, start))
        self._place(tensor, start)
        return True

    def _place(self, tensor: TensorInfo, buffer_offset: int) -> None:
        self.placements.append(Placement(tensor, buffer_offset))
        self.cursor = buffer_offset + tensor.nbytes

    def flush_into(self, batches: list[Batch]) -> None:
        if self.placements:
            batches.append(Batch(BatchKind.SLOT, tuple(self.ranges), tuple(self.placements), self.cursor))
        self.ranges, self.placements, self.cursor = [], [], 0


def _oversized(tensor: TensorInfo, slot_size: int, align: int) -> Batch:
    start = _padded(0, tensor.offset, align)
    parts = tuple(
        FileRange(tensor.file, tensor.offset + done, min(slot_size, tensor.nbytes - done), start + done)
        for done in range(0, tensor.nbytes, slot_size)
    )
    return Batch(BatchKind.OVERSIZED, parts, (Placement(tensor, start),), start + tensor.nbytes)


# --------------------------------------------------------------------------- oversized tensors in parts


class Part(NamedTuple):
    """Bytes ``[start, start + nbytes)`` of an oversized tensor, alone in a slot batch (:func:`in_parts`):
    placed like a :class:`Placement` (``tensor``, ``buffer_offset``), and delivered with its last part."""

    tensor: TensorInfo
    buffer_offset: int
    start: int
    nbytes: int

    @property
    def last(self) -> bool:
        return self.start + self.nbytes == self.tensor.nbytes


def in_parts(plan: Plan, slot_bytes: int) -> Plan:
    """``plan`` with each oversized tensor as consecutive slot batches of at most ``slot_bytes``
    (``slot_bytes`` >= ``plan.align``), in the same order: for a reader whose slots are its only
    buffers (the embedded engine's device loads, which copy each part to its place on the GPU).

    Every part but the first starts at an aligned file offset, so its range needs no pad; the
    first keeps the pad that makes its buffer offset congruent to its file offset.
    """
    if not plan.oversized_bytes:
        return plan
    if slot_bytes < plan.align:
        raise ConfigError(f"parts need slots of at least the alignment ({plan.align} bytes), got {slot_bytes}")
    step = slot_bytes // plan.align * plan.align
    batches: list[Batch] = []
    for batch in plan.batches:
        if batch.kind is not BatchKind.OVERSIZED:
            batches.append(batch)
            continue
        tensor = batch.placements[0].tensor
        start = 0
        while start < tensor.nbytes:
            offset = tensor.offset + start
            pad = _padded(0, offset, plan.align)
            nbytes = min(step - pad, tensor.nbytes - start)
            part = Part(tensor, pad, start, nbytes)
            batches.append(Batch(BatchKind.SLOT, (FileRange(tensor.file, offset, nbytes, pad),), (part,), pad + nbytes))
            start += nbytes
    return Plan(tuple(batches), plan.slot_size, plan.align)
