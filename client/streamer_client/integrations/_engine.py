"""What every engine loader needs, engine-independent: options, node-local ranks, one session key,
and a rank's selection from the checkpoint's tensor names.

The engine modules (:mod:`.vllm_loader`, :mod:`.tensorrt_llm`, :mod:`.sglang`) take these from
their engine's own state (process groups, ``Mapping``, configs) and hand them to
:func:`streamer_client.stream`.
"""

from __future__ import annotations

import json
import os
import re
import socket as _socket
import struct
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, ConfigError

__all__ = [
    "LOAD_FORMAT",
    "LoaderOptions",
    "NodeRanks",
    "agree_on_node",
    "config_value",
    "is_object_uri",
    "layer_index",
    "safetensors_table",
    "select_names",
    "source_uri",
    "torch_all_gather",
    "weight_names",
]

# The load format our vLLM loader registers under (``--load-format streamer``).
LOAD_FORMAT = "streamer"

OBJECT_SCHEMES = ("s3://", "gs://", "az://")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def is_object_uri(value: object) -> bool:
    return isinstance(value, str) and value.lower().startswith(OBJECT_SCHEMES)


@dataclass(frozen=True)
class LoaderOptions:
    """The options an engine passes through (vLLM: ``model_loader_extra_config``)."""

    socket: str | None = None
    session: str | None = None
    budget: int | str | None = None
    borrowed: bool = False
    uri: str | None = None  # where the weights are, when the engine's model path is the metadata dir

    KEYS = ("socket", "session", "budget", "borrowed", "uri")

    @classmethod
    def parse(cls, extra: Mapping[str, Any] | None, *, where: str) -> LoaderOptions:
        """Validated options; an unknown key or a wrong type raises :class:`ConfigError` naming it."""
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(cls.KEYS))
        if unknown:
            raise ConfigError(f"{where}: unknown option {unknown[0]!r} (known: {', '.join(cls.KEYS)})", key=unknown[0])
        for key in ("socket", "session", "uri"):
            if extra.get(key) is not None and not (isinstance(extra[key], str) and extra[key]):
                raise ConfigError(f"{where}: {key} must be a non-empty string, got {extra[key]!r}", key=key)
        budget = extra.get("budget")
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, str))):
            raise ConfigError(f"{where}: budget must be a byte count or a size like '8GiB', got {budget!r}", key="budget")
        borrowed = extra.get("borrowed", False)
        if not isinstance(borrowed, bool):
            raise ConfigError(f"{where}: borrowed must be true or false, got {borrowed!r}", key="borrowed")
        return cls(extra.get("socket"), extra.get("session"), budget, borrowed, extra.get("uri"))

    def stream_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"borrowed": self.borrowed}
        if self.socket is not None:
            kwargs["socket"] = self.socket
        if self.budget is not None:
            kwargs["budget"] = self.budget
        return kwargs


@dataclass(frozen=True)
class NodeRanks:
    """This process among the ranks of one engine on this node, and the engine's session key."""

    rank: int
    world_size: int
    session: str


def agree_on_node(all_gather: Callable[[Any], list[Any]] | None, *, global_rank: int, session: str | None, uri: str) -> NodeRanks:
    """Node-local rank and world size, and one session key, agreed by one collective.

    ``all_gather(obj)`` returns every rank's ``obj`` in global-rank order (None: a single rank).
    The node-local rank is this process's place among the ranks on its host, by global rank, so it
    holds however the launcher placed them (Ray included). The key is global rank 0's, so every
    rank of the engine names the same daemon session even where the default key (the ranks'
    common parent process) does not hold.
    """
    host = _socket.gethostname()
    proposal = session or f"engine-{uuid.uuid4().hex}:{uri}"
    if all_gather is None:
        return NodeRanks(0, 1, proposal)
    gathered = all_gather((host, proposal))
    same_host = [r for r, (h, _) in enumerate(gathered) if h == host]
    return NodeRanks(same_host.index(global_rank), len(same_host), gathered[0][1])


def layer_index(name: str) -> int | None:
    """The decoder layer a tensor name belongs to (``...layers.<i>.``), or None."""
    match = _LAYER.search(name)
    return int(match.group(1)) if match else None


def select_names(names: Iterable[str], *, keep_layer: Callable[[int], bool] | None = None,
                 keep: Callable[[str], bool] | None = None) -> list[str]:  # fmt: skip
    """The names a rank needs: layers it holds (``keep_layer``), and what ``keep`` allows."""
    chosen = []
    for name in names:
        layer = layer_index(name)
        if keep_layer is not None and layer is not None and not keep_layer(layer):
            continue
        if keep is not None and not keep(name):
            continue
        chosen.append(name)
    return chosen


def source_uri(checkpoint_dir: str | os.PathLike) -> str:
    """The checkpoint an engine's model path stands for.

    An object-storage URI is itself; a metadata dir pulled by :func:`streamer_client.pull_metadata`
    names its URI in ``.runai_complete`` (the cache's marker, docs/metadata-cache.md); any other
    directory is a local checkpoint.
    """
    path = os.fspath(checkpoint_dir)
    if is_object_uri(path):
        return path
    try:
        uri = json.loads((Path(path) / ".runai_complete").read_text(encoding="utf-8"))["uri"]
    except (OSError, ValueError, KeyError, TypeError):
        return path
    return uri if isinstance(uri, str) and uri else path


def config_value(metadata_dir: str | os.PathLike, key: str):
    """One value of the pulled ``config.json`` (its ``text_config`` for multimodal configs)."""
    config = json.loads((Path(metadata_dir) / "config.json").read_text(encoding="utf-8"))
    return config.get(key, (config.get("text_config") or {}).get(key))


def torch_all_gather():
    """An all-gather over torch.distributed's default group, or None when it is not running."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None, 0

    def all_gather(obj):
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out

    return all_gather, dist.get_rank()


def weight_names(metadata_dir: str | os.PathLike) -> list[str] | None:
    """Tensor names from the pulled ``model.safetensors.index.json``; None without an index."""
    index = Path(metadata_dir) / "model.safetensors.index.json"
    try:
        return sorted(json.loads(index.read_text(encoding="utf-8"))["weight_map"])
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{index} is not a safetensors index: {exc}", key=str(index)) from None


def safetensors_table(directory: str | os.PathLike) -> dict[str, tuple[str, tuple[int, ...]]] | None:
    """``name: (safetensors dtype, shape)`` from the headers of a local checkpoint's
    ``*.safetensors`` files, file by file in data order; None where ``directory`` is not a local
    directory holding any (an object-storage URI's headers are read by the service, not here)."""
    if is_object_uri(directory) or not Path(directory).is_dir():
        return None
    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        return None
    table: dict[str, tuple[str, tuple[int, ...]]] = {}
    for path in files:
        try:
            with open(path, "rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(size))
            header.pop("__metadata__", None)
            entries = sorted(header.items(), key=lambda item: item[1]["data_offsets"][0])
            for name, entry in entries:
                table.setdefault(name, (entry["dtype"], tuple(int(d) for d in entry["shape"])))
        except (OSError, ValueError, KeyError, TypeError, struct.error) as exc:
            raise CheckpointError(f"{path}: not a safetensors header ({exc})", key=str(path)) from None
    return table
