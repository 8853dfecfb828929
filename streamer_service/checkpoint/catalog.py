"""The tensor table of a checkpoint: index json + safetensors headers.

Which files make up the checkpoint:

- ``model.safetensors.index.json`` at the top of the prefix wins: its
  ``weight_map`` (tensor -> shard, relative to the index) names the shards, and
  every other ``*.safetensors`` beside it is ignored (e.g. a ``consolidated``
  copy that Mistral repos ship next to the HF shards). A tensor present in two
  of its shards is taken from the one the index names (logged once).
- Without an index, every ``*.safetensors`` at the top of the prefix (not in
  subdirectories), provided they form one shard set. Two sets side by side
  (``model.safetensors`` and ``model-00001-of-00002.safetensors``) are refused:
  loading both would duplicate or mix weights, and picking one is a guess.

Tensor order is checkpoint order (docs/architecture.md): files in the index's order of
first appearance (sorted names without an index), then offset within a file.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from types import MappingProxyType
from typing import Any

from streamer_client.errors import CheckpointError, HeaderError, ObjectNotFoundError

from ..storage.base import ObjectInfo, Storage
from .header import FileHeader, TensorInfo, read_header

__all__ = [
    "INDEX_NAME",
    "Catalog",
    "build_catalog",
    "shard_group",
]

log = logging.getLogger(__name__)

INDEX_NAME = "model.safetensors.index.json"
SAFETENSORS_SUFFIX = ".safetensors"

# Object storage answers a small range read in tens of milliseconds; a few
# hundred shards read one by one would take tens of seconds. A handful of
# threads hides that latency without hammering the endpoint.
HEADER_READ_WORKERS = 8

# Real indexes are megabytes even for ~100k-tensor MoE checkpoints; anything
# this large is not an index, and we would hold all of it in memory.
MAX_INDEX_BYTES = 512 * 1024 * 1024

_CATALOG_FORMAT = 1

_SHARD_RE = re.compile(r"-(\d+)-of-(\d+)(?=\.safetensors$)")
_DIGITS_RE = re.compile(r"\d+")


class Catalog:
    """Every tensor of one checkpoint, in checkpoint order, plus the files it came from.

    ``files`` are the safetensors objects the tensors live in, in checkpoint
    order; ``index`` is the index object when one was used.
    """

    def __init__(
        self,
        tensors: Sequence[TensorInfo],
        files: Sequence[ObjectInfo],
        index: ObjectInfo | None = None,
    ) -> None:
        self.tensors: tuple[TensorInfo, ...] = tuple(tensors)
        self.files: tuple[ObjectInfo, ...] = tuple(files)
        self.index = index
        by_name: dict[str, TensorInfo] = {}
        for tensor in self.tensors:
            if by_name.setdefault(tensor.name, tensor) is not tensor:
                raise CheckpointError(f"catalog lists tensor {tensor.name!r} more than once", key=tensor.name)
        self.by_name: Mapping[str, TensorInfo] = MappingProxyType(by_name)

    @property
    def index_used(self) -> bool:
        return self.index is not None

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def __iter__(self) -> Iterator[TensorInfo]:
        return iter(self.tensors)

    def __contains__(self, name: object) -> bool:
        return name in self.by_name

    def __getitem__(self, name: str) -> TensorInfo:
        return self.by_name[name]

    def __repr__(self) -> str:
        return (
            f"Catalog({len(self.tensors)} tensors, {len(self.files)} files, "
            f"{self.total_bytes} bytes, index_used={self.index_used})"
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Catalog):
            return NotImplemented
        return (self.tensors, self.files, self.index) == (other.tensors, other.files, other.index)

    # ------------------------------------------------------------------ caching

    @staticmethod
    def fingerprint(objects: Iterable[ObjectInfo]) -> str:
        """A stable key for a cached catalog: sha256 over what the catalog reads.

        Covers every ``*.safetensors`` object and the index (name, size, etag),
        in name order, so any added, removed or rewritten shard or index gives
        a new key; non-weight files (README, config) do not. The format
        version is mixed in so a change of the cached layout misses old caches.
        """
        relevant = sorted(
            (o.name, o.size, o.etag) for o in objects if o.name.endswith(SAFETENSORS_SUFFIX) or o.name == INDEX_NAME
        )
        payload = json.dumps({"format": _CATALOG_FORMAT, "objects": relevant}, separators=(",", ":"))
        return hashlib.sha256(payload.encode("utf-8")).hexdigest()

    def to_json(self) -> dict[str, Any]:
        return {
            "format": _CATALOG_FORMAT,
            "index": _object_to_json(self.index) if self.index else None,
            "files": [_object_to_json(o) for o in self.files],
            "tensors": [t.to_json() for t in self.tensors],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Catalog:
        """Rebuild a catalog from :meth:`to_json`; ``CheckpointError`` if it is not one.

        A cache file can be truncated or from another version: callers should
        treat the error as a cache miss and rebuild.
        """
        try:
            if data.get("format") != _CATALOG_FORMAT:
                raise ValueError(f"unsupported catalog format {data.get('format')!r}")
            index = _object_from_json(data["index"]) if data["index"] is not None else None
            files = [_object_from_json(o) for o in data["files"]]
            tensors = [_tensor_from_json(t) for t in data["tensors"]]
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CheckpointError(f"cached catalog is malformed: {exc!r}") from None
        return cls(tensors, files, index)


def _object_to_json(obj: ObjectInfo) -> dict[str, Any]:
    return {"name": obj.name, "size": obj.size, "etag": obj.etag}


def _object_from_json(data: Mapping[str, Any]) -> ObjectInfo:
    return ObjectInfo(
        name=_typed(data["name"], str),
        size=_typed(data["size"], int),
        etag=_typed(data["etag"], str),
    )


def _tensor_from_json(data: Mapping[str, Any]) -> TensorInfo:
    shape = data["shape"]
    if not isinstance(shape, list):
        raise TypeError(f"shape must be a list, got {shape!r}")
    return TensorInfo(
        name=_typed(data["name"], str),
        dtype=_typed(data["dtype"], str),
        shape=tuple(_typed(d, int) for d in shape),
        file=_typed(data["file"], str),
        offset=_typed(data["offset"], int),
        nbytes=_typed(data["nbytes"], int),
    )


def _typed(value: Any, kind: type) -> Any:
    if type(value) is not kind:  # bool is not an int here either
        raise TypeError(f"expected {kind.__name__}, got {value!r}")
    return value


# ---------------------------------------------------------------------- building


def build_catalog(
    storage: Storage,
    objects: list[ObjectInfo] | None = None,
    *,
    max_workers: int = HEADER_READ_WORKERS,
) -> Catalog:
    """Read the index (if any) and every shard header under ``storage``'s prefix.

    ``objects`` is the prefix listing (default: ``storage.list_objects()``);
    pass it when the caller already listed, so sizes and etags agree with the
    metadata cache's record.
    """
    if objects is None:
        objects = storage.list_objects()
    listing = {o.name: o for o in objects}
    index = listing.get(INDEX_NAME)
    if index is not None:
        return _catalog_from_index(storage, index, listing, max_workers)
    return _catalog_without_index(storage, listing, max_workers)


def _catalog_from_index(storage: Storage, index: ObjectInfo, listing: Mapping[str, ObjectInfo], max_workers: int) -> Catalog:
    weight_map = _read_weight_map(storage, index)
    shard_names = list(dict.fromkeys(weight_map.values()))  # first appearance order
    missing = [name for name in shard_names if name not in listing]
    if missing:
        raise CheckpointError(
            f"{storage.uri.child(INDEX_NAME)} names shard {missing[0]!r}, which does not exist "
            f"under {storage.uri}" + (f" (nor {len(missing) - 1} more)" if len(missing) > 1 else ""),
            uri=storage.uri.normalized,
            key=missing[0],
        )
    files = [listing[name] for name in shard_names]
    headers = _follow_index(_read_headers(storage, files, max_workers), weight_map, storage)
    _check_unique(headers, storage)
    _check_against_index(headers, weight_map, storage)
    return Catalog([t for h in headers for t in h.tensors], files, index)


def _read_weight_map(storage: Storage, index: ObjectInfo) -> dict[str, str]:
    where = storage.uri.child(INDEX_NAME)
    if index.size > MAX_INDEX_BYTES:
        raise CheckpointError(f"{where} is {index.size} bytes, larger than any real index", key=INDEX_NAME)
    buffer = io.BytesIO()
    storage.download(index, buffer)

    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        keys = [k for k, _ in pairs]
        if len(set(keys)) != len(keys):
            dup = next(k for k in keys if keys.count(k) > 1)
            raise CheckpointError(f"{where} names {dup!r} more than once", key=INDEX_NAME)
        return dict(pairs)

    try:
        data = json.loads(buffer.getvalue().decode("utf-8"), object_pairs_hook=unique)
    except CheckpointError:
        raise
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"{where} is not valid JSON: {exc}", key=INDEX_NAME) from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise CheckpointError(f"{where} has no weight_map of tensor name -> shard file", key=INDEX_NAME)
    if not weight_map:
        raise CheckpointError(f"{where} has an empty weight_map", key=INDEX_NAME)
    return weight_map


def _follow_index(headers: Sequence[FileHeader], weight_map: Mapping[str, str], storage: Storage) -> list[FileHeader]:
    """A tensor in more than one shard is taken from the shard the index names, as transformers
    does; its other copies are left out, and the catalog says so once in the log. A tensor the
    index names in none of them is left to :func:`_check_against_index`."""
    where: dict[str, list[str]] = {}
    for header in headers:
        for tensor in header.tensors:
            where.setdefault(tensor.name, []).append(header.file)
    dropped = {
        name: [f for f in shards if f != weight_map[name]]
        for name, shards in where.items()
        if len(shards) > 1 and weight_map.get(name) in shards
    }
    if not dropped:
        return list(headers)
    first = next(iter(dropped))
    log.warning(
        "%s: %d tensor(s) are in more than one shard; following %s, which names the shard to load each from "
        "(e.g. %r from %r, not %r)",
        storage.uri, len(dropped), INDEX_NAME, first, weight_map[first], dropped[first][0],
    )  # fmt: skip
    return [h._replace(tensors=tuple(t for t in h.tensors if h.file not in dropped.get(t.name, ()))) for h in headers]


def _check_against_index(headers: Sequence[FileHeader], weight_map: Mapping[str, str], storage: Storage) -> None:
    in_headers = {t.name: h.file for h in headers for t in h.tensors}
    for name, shard in weight_map.items():
        if in_headers.get(name) != shard:
            raise CheckpointError(
                f"{storage.uri}: {INDEX_NAME} maps tensor {name!r} to {shard!r}, but that shard's header has no such tensor",
                uri=storage.uri.normalized,
                key=shard,
            )
    # A tensor in a shard but not in the index is refused rather than loaded
    # or dropped: index-driven loaders (transformers) would never see it while
    # shard-driven ones (vLLM iterates every tensor of each listed file) would,
    # so the two disagree on what the model is; the index is stale or wrong.
    for header in headers:
        for tensor in header.tensors:
            if tensor.name not in weight_map:
                raise CheckpointError(
                    f"{storage.uri}: tensor {tensor.name!r} is in shard {header.file!r} but not in "
                    f"{INDEX_NAME} (stale or incomplete index)",
                    uri=storage.uri.normalized,
                    key=header.file,
                )


def _catalog_without_index(storage: Storage, listing: Mapping[str, ObjectInfo], max_workers: int) -> Catalog:
    names = sorted(n for n in listing if "/" not in n and n.endswith(SAFETENSORS_SUFFIX))
    if not names:
        raise ObjectNotFoundError(
            f"no *.safetensors files and no {INDEX_NAME} under {storage.uri}",
            uri=storage.uri.normalized,
        )
    _check_single_shard_set(names, storage)
    files = [listing[name] for name in names]
    headers = _read_headers(storage, files, max_workers)
    _check_unique(headers, storage)
    return Catalog([t for h in headers for t in h.tensors], files, None)


def shard_group(name: str) -> str:
    """The shard set a file name belongs to.

    ``model-00001-of-00003.safetensors`` -> ``model-*-of-00003.safetensors``
    (the total stays: a 2-shard and a 3-shard set are different sets);
    otherwise every number becomes ``*``, so ``consolidated.00.safetensors``
    and ``consolidated.01.safetensors`` are one set and ``model.safetensors``
    is a set of its own.
    """
    match = _SHARD_RE.search(name)
    if match is not None:
        return f"{name[: match.start()]}-*-of-{match.group(2)}{name[match.end() :]}"
    return _DIGITS_RE.sub("*", name)


def _check_single_shard_set(names: Sequence[str], storage: Storage) -> None:
    groups: dict[str, list[str]] = {}
    for name in names:
        groups.setdefault(shard_group(name), []).append(name)
    if len(groups) > 1:
        listed = "; ".join(f"{group}: {', '.join(members)}" for group, members in sorted(groups.items()))
        raise CheckpointError(
            f"{storage.uri} holds {len(groups)} competing sets of safetensors files and no "
            f"{INDEX_NAME} to choose between them ({listed}); add an index or remove a set",
            uri=storage.uri.normalized,
        )
    _check_complete(names, storage)


def _check_complete(names: Sequence[str], storage: Storage) -> None:
    # Without an index, a missing "-0000i-of-0000n" shard would otherwise pass
    # as a smaller model and fail much later, in the engine.
    match = _SHARD_RE.search(names[0])
    if match is None:
        return
    total = match.group(2)
    stem, suffix = names[0][: match.start()], names[0][match.end() :]
    width = len(match.group(1))
    expected = [f"{stem}-{i:0{width}d}-of-{total}{suffix}" for i in range(1, int(total) + 1)]
    missing = sorted(set(expected) - set(names))
    unexpected = sorted(set(names) - set(expected))
    if missing or unexpected:
        problems = [f"missing {', '.join(missing)}"] if missing else []
        problems += [f"unexpected {', '.join(unexpected)}"] if unexpected else []
        raise CheckpointError(
            f"{storage.uri}: shard set {shard_group(names[0])} is incomplete: {'; '.join(problems)}",
            uri=storage.uri.normalized,
            key=(missing or unexpected)[0],
        )


def _read_headers(storage: Storage, files: Sequence[ObjectInfo], max_workers: int) -> list[FileHeader]:
    """Headers of ``files`` in the same order, read concurrently."""

    def read(obj: ObjectInfo) -> FileHeader:
        return read_header(storage, obj.name, obj.size)

    if len(files) <= 1 or max_workers <= 1:
        return [read(obj) for obj in files]
    workers = min(max_workers, len(files))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="header") as pool:
        # map() yields in input order and re-raises the first failure in that
        # order, so results and errors are deterministic.
        return list(pool.map(read, files))


def _check_unique(headers: Sequence[FileHeader], storage: Storage) -> None:
    seen: dict[str, str] = {}
    for header in headers:
        for tensor in header.tensors:
            first = seen.setdefault(tensor.name, header.file)
            if first != header.file:
                raise HeaderError(
                    f"{storage.uri}: tensor {tensor.name!r} is in both {first!r} and {header.file!r}",
                    uri=storage.uri.normalized,
                    key=tensor.name,
                )
