"""The embedded engine: a checkpoint's tensors in the calling process, no daemon, no shared memory.

An engine plans a selection (:meth:`EmbeddedEngine.plan`) and streams it (:meth:`EmbeddedEngine.stream`)
one of two ways (docs/architecture.md), each in a module of its own, imported when first chosen:

- a load of a local directory to a CUDA device, where the mapped reader is chosen
  (:mod:`~streamer_service.readers.choice`), has no ring and no reader: its tensors are copied
  from the files' mappings through the process's small staging ring to the device, as a daemon's
  rank copies from its segments (:mod:`~streamer_service.embedded.staged`);
- every other load reads each batch into a buffer of the engine's ring and builds its tensors
  over it (:mod:`~streamer_service.embedded.ring_load`).
"""

from __future__ import annotations

import contextlib
import mmap
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from streamer_client._dtypes import check_loadable
from streamer_client._request import target
from streamer_client._slicing import Cut, Slices, cuts, take
from streamer_client.errors import BorrowedTensorError, ConfigError

from ..checkpoint.catalog import Catalog
from ..checkpoint.plan import DEFAULT_ALIGN, Plan, build_plan
from ..checkpoint.plan import select as select_tensors
from ..checkpoint.slices import sliced
from ..checkpoint.versions import ObjectVersions
from ..readers.base import ReaderFactory
from ..readers.choice import reader_for, reads_mappings
from ..readers.runai import storage_environment
from ..settings import Settings
from ..sizing import in_flight_bytes, slot_bytes
from ..uri import StorageURI
from .stats import EngineStats

if TYPE_CHECKING:
    from .buffers import PinnedPool

__all__ = [
    "BorrowedTensorError",
    "EmbeddedEngine",
    "EngineConfig",
    "EngineStats",
]


@dataclass(frozen=True)
class EngineConfig:
    """What one engine may use: ``budget`` bytes of buffers in slots of at most ``slot_size``."""

    budget: int
    slot_size: int
    align: int = DEFAULT_ALIGN
    storage_environment: tuple[tuple[str, str], ...] = ()  # Run:ai's retry/timeout variables
    local_reader: str = "mapped"  # Settings.local_reader: how local files are read (readers.choice.reader_for)
    in_flight: int | None = None  # bytes submitted to storage and not yet landed, at most (sizing.in_flight_bytes)

    def __post_init__(self) -> None:
        if not isinstance(self.budget, int) or self.budget <= 0:
            raise ConfigError(f"buffer budget must be a positive number of bytes, got {self.budget!r}")
        if not isinstance(self.slot_size, int) or not 0 < self.slot_size <= self.budget:
            raise ConfigError(f"slot size must be positive and at most the budget ({self.budget}), got {self.slot_size!r}")
        if self.align <= 0 or self.align & (self.align - 1) or mmap.PAGESIZE % self.align:
            # Buffers are page-aligned mmaps, so congruence holds for any power of two up to a page.
            raise ConfigError(f"alignment must be a power of two dividing {mmap.PAGESIZE}, got {self.align!r}")
        if self.slot_size < self.align:
            # A device load reads an oversized tensor in parts of a slot, each but the first aligned.
            raise ConfigError(f"slot size must be at least the alignment ({self.align} bytes), got {self.slot_size!r}")

    @classmethod
    def from_settings(cls, settings: Settings) -> EngineConfig:
        """The settings' budget and slot size (shrunk as ``sizing.slot_bytes`` says), and the bytes in
        flight for the NIC rate."""
        budget = int(settings.shm_budget)
        slot = slot_bytes(budget, int(settings.slot_size))
        return cls(
            budget=budget,
            slot_size=slot,
            in_flight=in_flight_bytes(settings.target_gbps, slot, budget),
            storage_environment=tuple(storage_environment(settings).items()),
            local_reader=settings.local_reader,
        )


class EmbeddedEngine:
    """Streams one checkpoint's tensors in-process (no daemon, no shared memory).

    Each :meth:`stream` has its own ring and reader and may use the whole budget: run one at a
    time to stay within it. ``reader_factory`` builds the reader (keyword arguments
    ``fs_strategy`` and ``environment``; default: for a load to a CUDA device
    :func:`~streamer_service.readers.choice.reader_for` the URI, else Run:ai's); tests may replace it. A
    device load whose reader would be the mapped reader is staged from the files' mappings instead
    (:mod:`~streamer_service.embedded.staged`). ``versions`` checks each loaded batch's objects
    against the catalog's versions before delivery.
    """

    def __init__(
        self,
        uri: StorageURI,
        catalog: Catalog,
        config: EngineConfig,
        *,
        reader_factory: ReaderFactory | None = None,
        versions: ObjectVersions | None = None,
        pool: PinnedPool | None = None,
    ) -> None:
        self.uri = uri
        self.catalog = catalog
        self.config = config
        self._versions = versions
        self.stats = EngineStats()
        self._reader_factory = reader_factory  # None: readers.choice.reader_for the URI and the device
        self._pool = pool  # page-locked slots of CUDA loads (default: the process's pool)

    def plan(self, select: list[str] | None = None, priority: list[str] | None = None, slices: Slices | None = None) -> Plan:
        """Select (names / prefixes, see :func:`streamer_service.checkpoint.plan.select`) and plan for this
        engine's slots; with ``slices`` (:mod:`streamer_client._slicing`) each sliced tensor is read only
        over the rows that hold its slice, and :meth:`stream` cuts it (``Plan.cuts``). Raises
        :class:`SelectionError` without reading anything."""
        tensors = select_tensors(self.catalog.tensors, select, priority)
        tensors, within = sliced(tensors, cuts(tensors, slices, uri=self.uri.normalized))
        return build_plan(tensors, self.config.slot_size, align=self.config.align)._replace(cuts=within)

    def stream(
        self, plan: Plan, *, device: str | torch.device = "cpu", borrowed: bool = False
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` for every tensor of ``plan``, in plan order.

        Arguments are checked here, before anything is read; reading starts at the first ``next``.
        A storage failure raises the :class:`StorageError` Run:ai reported, naming the file and
        byte range; no tensor of the failed batch is yielded.
        """
        device = target(device, borrowed)
        self._check_plan(plan)
        if plan.cuts:
            return _cut(self._run(plan, device, borrowed), plan.cuts, borrowed)
        return self._run(plan, device, borrowed)

    def _check_plan(self, plan: Plan) -> None:
        if plan.slot_size > self.config.slot_size:
            raise ConfigError(f"plan has slots of {plan.slot_size} bytes but this engine's slot size is {self.config.slot_size}")
        if mmap.PAGESIZE % plan.align:
            raise ConfigError(f"plan alignment {plan.align} does not divide the page size {mmap.PAGESIZE}")
        check_loadable(plan.tensors, uri=self.uri.normalized)

    def _run(self, plan: Plan, device: torch.device, borrowed: bool) -> Iterator[tuple[str, torch.Tensor]]:
        factory = self._reader_factory
        if factory is None:  # a CPU load's tensors are the bytes read: into the caller's memory
            factory = reader_for(self.uri, self.config.local_reader, into_callers_memory=device.type != "cuda")
        try:
            if device.type == "cuda" and reads_mappings(factory):
                # Local files to a device: staged from their mappings, no ring of ours.
                from .staged import StagedFiles

                yield from StagedFiles(self.uri, plan, device, self.stats, self._versions).run()
            else:
                from .ring_load import through_ring

                config = self.config
                yield from through_ring(
                    self.uri, plan, device, borrowed, factory, self.stats, self._versions, self._pool,
                    budget=config.budget, in_flight=config.in_flight, environment=dict(config.storage_environment),
                )  # fmt: skip
        finally:
            if self._versions is not None:
                self._versions.close()

    def __repr__(self) -> str:
        return f"EmbeddedEngine({self.uri.normalized!r}, {self.config}, {self.stats})"


def _cut(
    tensors: Iterator[tuple[str, torch.Tensor]], cuts: Mapping[str, Cut], borrowed: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """``tensors`` with those ``cuts`` names cut: a new tensor of the slice's bytes, or where
    ``borrowed`` and the slice is one piece, a view of the borrowed tensor."""
    with contextlib.closing(tensors):
        for name, tensor in tensors:
            c = cuts.get(name)
            yield name, tensor if c is None else take(tensor, c, view=borrowed)
