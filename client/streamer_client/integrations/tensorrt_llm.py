"""A TensorRT-LLM-style per-rank plan: groups of tensor names, each handed over once complete.

TensorRT-LLM's loaders build a rank's weights layer by layer. With :func:`load_groups` the
caller names, per rank, the tensors of each group (one per layer, say) and receives each group
as soon as all its tensors arrived, in arrival order, while later groups are still streaming;
only the tensors of incomplete groups (and of groups the caller still holds) are held. A tensor
may be named in several groups (tied or shared weights): it is read once and handed to each.
:func:`rank_groups` makes such a plan from a TensorRT-LLM ``Mapping``: the pipeline stage's
layers, the experts of its ``moe_ep_rank``, and every tensor outside the layers.
"""

from __future__ import annotations

import os
import re
from collections.abc import Hashable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .. import stream
from ..errors import ConfigError, SelectionError
from ._engine import layer_index

if TYPE_CHECKING:
    import torch

__all__ = ["expert_index", "load_groups", "rank_groups"]

_LAYER_KEY = re.compile(r"^(.*?(?:^|\.)layers\.\d+)\.")
_EXPERT = re.compile(r"(?:^|\.)experts\.(\d+)\.")


def expert_index(name: str) -> int | None:
    """The routed expert a tensor name belongs to (``...experts.<e>.``), or None."""
    match = _EXPERT.search(name)
    return int(match.group(1)) if match else None


def rank_groups(names: Iterable[str], mapping: Any, num_layers: int | None = None) -> dict[str, list[str]]:
    """This rank's plan: one group per decoder layer it holds and one per module outside the layers.

    ``mapping`` is TensorRT-LLM's ``Mapping`` (``pp_size``, ``pp_layers``, ``moe_ep_size``,
    ``moe_ep_rank``). With ``pp_size > 1`` only the layers of ``mapping.pp_layers(num_layers)``
    are kept; with ``moe_ep_size > 1`` only the experts of ``moe_ep_rank``, in TensorRT-LLM's
    contiguous split (expert ``e`` of ``E`` on EP rank ``e // (E / moe_ep_size)``, ``E`` counted
    from the names). Tensors outside the layers (embedding, final norm, LM head) go to every rank.
    A layer's group is keyed by its name prefix (``model.layers.3``), any other tensor's by its
    module (``model.embed_tokens``, ``lm_head``).
    """
    names = list(names)
    stage = None
    if getattr(mapping, "pp_size", 1) > 1:
        if num_layers is None:
            raise ConfigError("rank_groups: pipeline parallelism needs num_layers", key="num_layers")
        stage = set(mapping.pp_layers(num_layers))
    ep_size, ep_rank = getattr(mapping, "moe_ep_size", 1), getattr(mapping, "moe_ep_rank", 0)
    per_rank = None
    if ep_size > 1:
        experts = {e for e in map(expert_index, names) if e is not None}
        if experts:
            count = max(experts) + 1
            if count % ep_size:
                raise ConfigError(
                    f"rank_groups: {count} experts do not split evenly over moe_ep_size {ep_size}", key="moe_ep_size"
                )
            per_rank = count // ep_size
    groups: dict[str, list[str]] = {}
    for name in names:
        layer = layer_index(name)
        if layer is not None and stage is not None and layer not in stage:
            continue
        expert = expert_index(name)
        if expert is not None and per_rank is not None and expert // per_rank != ep_rank:
            continue
        match = _LAYER_KEY.match(name)
        key = match.group(1) if match else name.rpartition(".")[0] or name
        groups.setdefault(key, []).append(name)
    return groups


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
    ``model.safetensors.index.json`` lists them). A name may be in several groups (tied or shared
    weights): it is streamed once, and the same tensor is in each of those groups' dicts; it is
    held until the last of them is handed over. Groups completed by the same tensor come in the
    order of ``groups``. An empty group, a name twice in one group, or ``borrowed=True`` (a group
    keeps its tensors) raise :class:`ConfigError` here; a name the checkpoint lacks raises
    :class:`SelectionError` before any tensor data is read. Other keyword arguments go to
    :func:`streamer_client.stream`.
    """
    if stream_kwargs.get("borrowed"):
        raise ConfigError("load_groups keeps each group's tensors until it is complete: borrowed views cannot be kept")
    groups_of: dict[str, list[Hashable]] = {}
    for key, names in groups.items():
        if isinstance(names, str) or not names:
            raise ConfigError(f"group {key!r} must be a non-empty list of tensor names, got {names!r}")
        for name in names:
            keys = groups_of.setdefault(name, [])
            if key in keys:
                raise ConfigError(f"tensor {name!r} is twice in group {key!r}", key=name)
            keys.append(key)
    tensors = stream(uri, select=list(groups_of), rank=rank, world_size=world_size, device=device, **stream_kwargs)
    return _assemble(tensors, groups, groups_of, os.fspath(uri))


def _assemble(tensors, groups, groups_of, uri: str) -> Iterator:
    missing = {key: len(names) for key, names in groups.items()}
    arrived: dict[Hashable, dict] = {key: {} for key in groups}
    try:
        for name, tensor in tensors:
            keys = groups_of.get(name)
            if keys is None:  # an entry matched as a name prefix, not as a name
                raise SelectionError(
                    f"{uri}: received {name!r}, which no group names; group entries must be whole tensor names",
                    uri=uri,
                    key=name,
                )
            complete = []
            for key in keys:
                arrived[key][name] = tensor
                missing[key] -= 1
                if missing[key] == 0:
                    complete.append(key)
            del tensor  # held by its groups only, so a group handed over and dropped frees it
            for key in complete:
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
