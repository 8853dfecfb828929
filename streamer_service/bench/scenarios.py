"""What each rank loads in one benchmark scenario: a list of tensor names per rank."""

from __future__ import annotations

import enum
from collections.abc import Sequence

from ..checkpoint.header import TensorInfo
from ..sample import rank_selection

__all__ = ["Scenario", "selections"]


class Scenario(str, enum.Enum):
    REPLICATED = "replicated"  # every rank needs every tensor (data parallel, or TP of a dense model's weights read whole)
    TP = "tp"  # every rank needs the shared tensors, plus its own experts (MoE expert parallel)
    DISJOINT = "disjoint"  # contiguous blocks of the checkpoint, one per rank (pipeline parallel)


def selections(scenario: Scenario, tensors: Sequence[TensorInfo], world_size: int) -> list[list[str]]:
    """One selection per rank, each in checkpoint order."""
    names = [t.name for t in tensors]
    if scenario is Scenario.REPLICATED:
        return [list(names) for _ in range(world_size)]
    if scenario is Scenario.TP:
        return [rank_selection(names, rank, world_size) for rank in range(world_size)]
    return _contiguous_blocks(tensors, world_size)


def _contiguous_blocks(tensors: Sequence[TensorInfo], world_size: int) -> list[list[str]]:
    """Split the checkpoint into ``world_size`` runs of tensors of about equal bytes; none empty."""
    if world_size > len(tensors):
        raise ValueError(f"a disjoint split of {len(tensors)} tensors needs at most that many ranks, not {world_size}")
    total = sum(t.nbytes for t in tensors)
    blocks: list[list[str]] = [[] for _ in range(world_size)]
    seen = 0
    for index, tensor in enumerate(tensors):
        rank = min(world_size - 1, seen * world_size // total) if total else index * world_size // len(tensors)
        # Leave at least one tensor for each rank still to come.
        rank = max(rank, world_size - (len(tensors) - index))
        blocks[rank].append(tensor.name)
        seen += tensor.nbytes
    if any(not block for block in blocks):
        # A few huge tensors: fall back to an even split by count, still contiguous.
        per = len(tensors) / world_size
        blocks = [[t.name for t in tensors[round(r * per) : round((r + 1) * per)]] for r in range(world_size)]
    return blocks
