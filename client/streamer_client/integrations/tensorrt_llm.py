"""A TensorRT-LLM-style per-rank plan: groups of tensor names, each handed over once complete.

TensorRT-LLM's loaders build a rank's weights layer by layer. With :func:`load_groups` the
caller names, per rank, the tensors of each group (one per layer, say) and receives each group
as soon as all its tensors arrived, in arrival order, while later groups are still streaming;
only the tensors of incomplete groups are held.
"""

from __future__ import annotations

import os
from collections.abc import Hashable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

from .. import stream
from ..errors import ConfigError, SelectionError

if TYPE_CHECKING:
    import torch

__all__ = ["load_groups"]


def load_groups(
    uri: str | os.PathLike,
    groups: Mapping[Hashable, Sequence[str]],
    *,
    rank: int = 0,
    world_size: int = 1,
    device: str = "cpu",
    **stream_kwargs,
) -> Iterator[tuple[Hashable, dict[str, torch.Tensor]]]:
    """``(group key, {name: tensor})`` for each of ``groups``, as soon as the group is complete.

    Group entries are exact tensor names (``streamer-service inspect --json`` or the pulled
    ``model.safetensors.index.json`` lists them). An empty group, a name in two groups, or
    ``borrowed=True`` (a group keeps its tensors) raise :class:`ConfigError` here; a name the
    checkpoint lacks raises :class:`SelectionError` before any tensor data is read. Other keyword
    arguments go to :func:`streamer_client.stream`.
    """
    if stream_kwargs.get("borrowed"):
        raise ConfigError("load_groups keeps each group's tensors until it is complete: borrowed views cannot be kept")
    group_of: dict[str, Hashable] = {}
    for key, names in groups.items():
        if isinstance(names, str) or not names:
            raise ConfigError(f"group {key!r} must be a non-empty list of tensor names, got {names!r}")
        for name in names:
            if name in group_of:
                raise ConfigError(f"tensor {name!r} is in group {group_of[name]!r} and in group {key!r}", key=name)
            group_of[name] = key
    tensors = stream(uri, select=list(group_of), rank=rank, world_size=world_size, device=device, **stream_kwargs)
    return _assemble(tensors, groups, group_of, os.fspath(uri))


def _assemble(tensors, groups, group_of, uri: str) -> Iterator:
    missing = {key: len(names) for key, names in groups.items()}
    arrived: dict[Hashable, dict] = {key: {} for key in groups}
    try:
        for name, tensor in tensors:
            key = group_of.get(name)
            if key is None:  # an entry matched as a name prefix, not as a name
                raise SelectionError(
                    f"{uri}: received {name!r}, which no group names; group entries must be whole tensor names",
                    uri=uri,
                    key=name,
                )
            arrived[key][name] = tensor
            missing[key] -= 1
            if missing[key] == 0:
                yield key, arrived.pop(key)
    finally:
        tensors.close()
    incomplete = {key: sorted(set(groups[key]) - set(got)) for key, got in arrived.items()}
    if incomplete:
        key, names = next(iter(incomplete.items()))
        raise SelectionError(
            f"{uri}: the stream ended before group {key!r} was complete: missing {', '.join(map(repr, names[:5]))}",
            uri=uri,
            key=names[0],
        )
