"""A load of a local directory to a CUDA device, staged straight from the mapped files.

A daemon's rank stages the bytes of its segments: the native copier's threads copy them, a window
at a time, into the process's small page-locked staging ring, and each window's host-to-device
copies run while the next one fills (:class:`streamer_client._delivery.Staging`). A local file is
the same kind of source: mapped once (:func:`~streamer_service.readers.mapped.file_maps`, kept
across loads), its tensors' bytes are at known addresses. So an embedded load of a local directory
to a device goes the same way, with no read into a ring of its own first: the bytes are copied
once on the host (file -> staging ring), as by InstantTensor, the staging ring's 96 MiB are all
that is page-locked, and the copier's threads never wait for the interpreter between batches.

What the engine's ring path checks, this checks too, with the same errors:

- a file that cannot be opened or mapped is a :class:`StorageError`, and a tensor past the end the
  file has now an :class:`ObjectChangedError`, both naming the file, the byte range and the tensors,
  before anything of that batch is copied;
- a file cut short while its bytes are copied (SIGBUS in a copying thread, caught) is an
  :class:`ObjectChangedError` naming the tensor;
- each batch's files are checked against the catalog's versions (``versions``) once its bytes are
  all copied out of them, before any of its tensors is yielded: a file rewritten in place fails
  the load at the first batch read after the change, as in the ring path.

Batches are the plan's: their tensors are yielded in plan order, each batch's once its last window
is copied out of the files, which is when the next batch's first window is being filled.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from streamer_client import _delivery as delivery
from streamer_client._cuda import PinnedCopier
from streamer_client.errors import StorageError

from ..checkpoint.header import TensorInfo
from ..checkpoint.plan import Batch, Plan
from ..load.pipeline import Versions, naming_tensors
from ..readers.base import ReadRange
from ..readers.mapped import cut_short, file_maps, shorter, unmappable
from ..uri import StorageURI

if TYPE_CHECKING:
    from .stats import EngineStats

__all__ = ["StagedFiles"]


class StagedFiles:
    """One staged load of ``plan`` from the local directory ``uri`` to ``device`` (see the module
    docstring); :meth:`run` once. Its counters go to ``stats`` (the engine's)."""

    def __init__(
        self, uri: StorageURI, plan: Plan, device: torch.device, stats: EngineStats, versions: Versions | None = None
    ) -> None:
        self._uri = uri
        self._plan = plan
        self._device = device
        self._stats = stats
        self._versions = versions
        self._maps = file_maps()
        self._mappings: dict[str, object] = {}  # path -> its mapping, held until every copy out of it is done

    def run(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` of every tensor of the plan, in plan order."""
        self._maps.enter()  # no mapping is dropped while this load may copy out of it
        pinned = PinnedCopier(self._device)
        staging: delivery.Staging | None = None
        try:
            delivery.reserve(self._device, [t.nbytes for t in self._plan.tensors])
            staging = delivery.Staging(pinned)
            batches = self._plan.batches
            for k, batch in enumerate(batches):
                tensors = [p.tensor for p in batch.placements]
                try:
                    items = self._sources(tensors)
                except StorageError:
                    for done, outs in staging.flush_batch():  # every batch before the failed one is delivered
                        yield from self._hand_out(done, outs)
                    raise
                fault = functools.partial(self._cut_short, tensors)
                for done, outs in staging.copy_batch(batch, items, fault, hold=k + 1 < len(batches)):
                    yield from self._hand_out(done, outs)
        finally:
            try:
                if staging is not None:
                    staging.close()  # a window still held, the device copies: waited for
            finally:
                pinned.close()
                self._mappings.clear()
                self._maps.leave()

    def _sources(self, tensors: Sequence[TensorInfo]) -> list[tuple[int, str, Sequence[int]]]:
        """``(address, dtype, shape)`` of each tensor with bytes, in its file's mapping."""
        items = []
        for t in tensors:
            if not t.nbytes:
                continue
            path = self._uri.child(t.file)
            mapping = self._mappings.get(path)
            if mapping is None:
                try:
                    mapping = self._mappings[path] = self._maps.open(path)
                except OSError as exc:
                    names = [u.name for u in tensors if u.nbytes and u.file == t.file]
                    raise naming_tensors(unmappable(path, _range(t), exc), names) from None
            if t.end > mapping.size:
                raise naming_tensors(shorter(path, _range(t), mapping.size), [t.name])
            items.append((mapping.address + t.offset, t.dtype, t.shape))
        return items

    def _cut_short(self, tensors: Sequence[TensorInfo], i: int) -> StorageError:
        t = [u for u in tensors if u.nbytes][i]
        return naming_tensors(cut_short(self._uri.child(t.file), _range(t)), [t.name])

    def _hand_out(self, batch: Batch, staged: list[torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        """A batch whose bytes are all copied out of its files (``staged``: the tensors with
        bytes): checked, then its tensors yielded."""
        if self._versions is not None and batch.ranges:
            self._versions.check(batch, time.monotonic())
        nbytes = sum(p.tensor.nbytes for p in batch.placements)
        self._stats.bytes_read += nbytes
        self._stats.bytes_copied += nbytes
        staged.reverse()
        for placement in batch.placements:
            t = placement.tensor
            tensor = staged.pop() if t.nbytes else delivery.empty(t.dtype, t.shape, self._device)
            self._stats.tensors += 1
            yield t.name, tensor
            del tensor


def _range(t: TensorInfo) -> ReadRange:
    return ReadRange(t.offset, t.nbytes, 0)
