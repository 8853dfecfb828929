"""``weights_iterator``: every tensor of a checkpoint as ``(name, tensor)``, for a model's
``load_weights`` (the vLLM and SGLang loaders stream through it; :mod:`.vllm` exports it).

vLLM's own loaders (``safetensors_weights_iterator``, ``runai_safetensors_weights_iterator``)
yield every tensor of the checkpoint as ``(name, tensor)`` on the CPU, and each tensor-parallel
rank's ``weight_loader`` narrows the full tensor to its shard while copying it into the
parameter. This iterator keeps that contract: full tensors, checkpoint order, CPU by default, a
progress bar on rank 0 only. What changes is underneath: with a node daemon the node's ranks
share one read of each byte (``rank``/``world_size`` are the ranks on this node). Imports no engine.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

from .. import stream

if TYPE_CHECKING:
    import torch

__all__ = ["weights_iterator"]


def weights_iterator(
    uri: str | os.PathLike,
    *,
    rank: int = 0,
    world_size: int = 1,
    select: str | Sequence[str] | None = None,
    name_filter: Callable[[str], bool] | None = None,
    device: str = "cpu",
    progress: bool | None = None,
    **stream_kwargs,
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for every tensor of ``uri`` (or of ``select``), in checkpoint order.

    ``select`` (names and/or prefixes) decides what is read at all; ``name_filter`` drops
    yielded names without changing what is read (vLLM's skip rules, e.g. ``rotary_emb.inv_freq``),
    so prefer ``select`` for what this rank never needs. Tensors are safe to keep; a loader that
    copies each tensor at once may pass ``borrowed=True`` to skip one host copy (docs/client.md).

    ``progress=None`` draws a bar on rank 0 when tqdm is installed (vLLM installs it), like vLLM.
    Other keyword arguments go to :func:`streamer_client.stream` (``socket``, ``session``, ...).
    """
    if progress is None:
        progress = rank == 0 and importlib.util.find_spec("tqdm") is not None
    tensors = stream(uri, select=select, rank=rank, world_size=world_size, device=device, progress=progress, **stream_kwargs)
    if name_filter is None:
        return tensors
    return _filtered(tensors, name_filter)


def _filtered(tensors, keep: Callable[[str], bool]) -> Iterator:
    try:
        for item in tensors:
            if keep(item[0]):
                yield item
            del item  # hold no reference to a borrowed view across the next step
    finally:
        tensors.close()
