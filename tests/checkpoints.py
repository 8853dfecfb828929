"""Build sample checkpoints for tests: real ones with safetensors, bad ones by hand.

Also a minimal directory-backed :class:`Storage`, so header and catalog tests do
not depend on a particular backend.
"""

from __future__ import annotations

import json
import os
import struct
import threading
from pathlib import Path
from typing import Any, BinaryIO

import torch
from safetensors.torch import save_file

from streamer_client.errors import ObjectNotFoundError
from streamer_service.storage.base import ObjectInfo, Storage
from streamer_service.uri import StorageURI, parse_uri

__all__ = [
    "CountingStorage",
    "DirStorage",
    "INDEX_NAME",
    "make_sharded_checkpoint",
    "many_small_tensors",
    "mixed_tensors",
    "shard_name",
    "write_raw_safetensors",
]

INDEX_NAME = "model.safetensors.index.json"


def shard_name(i: int, n: int) -> str:
    """HF's shard naming, 1-based: ``model-00001-of-00003.safetensors``."""
    return f"model-{i:05d}-of-{n:05d}.safetensors"


def make_sharded_checkpoint(
    directory: str | os.PathLike,
    tensors: dict[str, torch.Tensor],
    n_shards: int,
    with_index: bool = True,
) -> list[str]:
    """Write ``tensors`` as ``n_shards`` HF-style shards (+ index); return the shard names.

    Tensors are split into contiguous runs in dict order, as transformers'
    size-based sharding does. The index is written like ``save_pretrained``
    writes it: ``{"metadata": {"total_size": ...}, "weight_map": {...}}`` with
    sorted keys, indent 2 and a trailing newline.
    """
    if not 1 <= n_shards <= max(len(tensors), 1):
        raise ValueError(f"cannot split {len(tensors)} tensors into {n_shards} shards")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    names = list(tensors)
    per_shard = -(-len(names) // n_shards)
    weight_map: dict[str, str] = {}
    shards = []
    for i in range(n_shards):
        chunk = names[i * per_shard : (i + 1) * per_shard]
        shard = shard_name(i + 1, n_shards)
        part = {k: tensors[k].contiguous() for k in chunk}
        save_file(part, str(directory / shard), metadata={"format": "pt"})
        weight_map.update({k: shard for k in chunk})
        shards.append(shard)
    if with_index:
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (directory / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return shards


def mixed_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """One tensor of each interesting dtype and shape, filled with random (non-zero) data."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=g) + 0.5  # +0.5: keep zeros rare even after f8 rounding

    return {
        "embed.weight": randn(16, 8).to(torch.bfloat16),
        "layers.0.attn.q.weight": randn(8, 8).to(torch.float16),
        "layers.0.norm.weight": randn(8),
        "layers.0.mlp.fp8_e4m3": randn(4, 6).to(torch.float8_e4m3fn),
        "layers.0.mlp.fp8_e5m2": randn(3, 5).to(torch.float8_e5m2),
        "layers.0.mlp.int8": torch.randint(-128, 127, (5, 7), generator=g, dtype=torch.int8),
        "layers.0.mask": torch.rand(3, 3, generator=g) > 0.5,
        "layers.0.scale": randn(),  # 0-d
        "layers.0.empty": torch.empty(0, 4),
        "layers.0.f64": randn(2, 3).to(torch.float64),
        "layers.0.i64": torch.randint(-(2**40), 2**40, (3,), generator=g, dtype=torch.int64),
        "layers.0.u8": torch.randint(0, 255, (9,), generator=g, dtype=torch.uint8),
        "layers.0.i16": torch.randint(-300, 300, (2, 2), generator=g, dtype=torch.int16),
        "layers.0.i32": torch.randint(-(2**20), 2**20, (5,), generator=g, dtype=torch.int32),
    }


def many_small_tensors(n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """``n`` small f32 tensors named ``layers.<i>.weight`` with varied shapes."""
    g = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.weight": torch.randn(1 + i % 5, 1 + i % 3, generator=g) for i in range(n)}


def write_raw_safetensors(
    path: str | os.PathLike,
    header: dict[str, Any] | bytes,
    data: bytes = b"",
    *,
    header_len: int | None = None,
) -> Path:
    """Write ``<u64 len><header><data>`` without any validation (for bad files).

    ``header`` is a dict (dumped as JSON) or raw bytes; ``header_len`` overrides
    the length field to lie about the header size.
    """
    raw = header if isinstance(header, bytes) else json.dumps(header).encode("utf-8")
    length = len(raw) if header_len is None else header_len
    path = Path(path)
    path.write_bytes(struct.pack("<Q", length) + raw + data)
    return path


class DirStorage(Storage):
    """A local directory as a :class:`Storage` (tests only)."""

    def __init__(self, uri: StorageURI | str | os.PathLike) -> None:
        super().__init__(uri if isinstance(uri, StorageURI) else parse_uri(uri))
        self.root = Path(self.uri.prefix)

    def _path(self, name: str) -> Path:
        return self.root / name

    def _info(self, name: str, path: Path) -> ObjectInfo:
        st = path.stat()
        return ObjectInfo(name=name, size=st.st_size, etag=f"{st.st_mtime_ns}-{st.st_size}")

    def list_objects(self) -> list[ObjectInfo]:
        found = [self._info(path.relative_to(self.root).as_posix(), path) for path in self.root.rglob("*") if path.is_file()]
        return sorted(found, key=lambda o: o.name)

    def download(self, obj: ObjectInfo, dest: BinaryIO) -> int:
        data = self._path(obj.name).read_bytes()
        dest.write(data)
        return len(data)

    def read_range(self, name: str, offset: int, length: int) -> bytes:
        try:
            with open(self._path(name), "rb") as f:
                f.seek(offset)
                return f.read(length)
        except FileNotFoundError:
            raise ObjectNotFoundError(f"{self.uri.child(name)} does not exist", key=name) from None

    def stat(self, name: str) -> ObjectInfo:
        path = self._path(name)
        if not path.is_file():
            raise ObjectNotFoundError(f"{self.uri.child(name)} does not exist", key=name)
        return self._info(name, path)


class CountingStorage(DirStorage):
    """A :class:`DirStorage` that records every call, to assert request counts."""

    def __init__(self, uri: StorageURI | str | os.PathLike) -> None:
        super().__init__(uri)
        self._lock = threading.Lock()  # headers are read from a thread pool
        self.reads: list[tuple[str, int, int]] = []
        self.listings = 0
        self.downloads: list[str] = []

    def list_objects(self) -> list[ObjectInfo]:
        with self._lock:
            self.listings += 1
        return super().list_objects()

    def download(self, obj: ObjectInfo, dest: BinaryIO) -> int:
        with self._lock:
            self.downloads.append(obj.name)
        return super().download(obj, dest)

    def read_range(self, name: str, offset: int, length: int) -> bytes:
        with self._lock:
            self.reads.append((name, offset, length))
        return super().read_range(name, offset, length)


def ground_truth(directory: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of an indexed checkpoint, as ``safetensors.torch.load_file`` reads it."""
    from safetensors.torch import load_file

    directory = Path(directory)
    weight_map = json.loads((directory / INDEX_NAME).read_text())["weight_map"]
    truth: dict[str, torch.Tensor] = {}
    for shard in dict.fromkeys(weight_map.values()):
        truth.update(load_file(directory / shard))
    return truth


def tensor_bytes(t: torch.Tensor) -> bytes:
    """A tensor's raw bytes, through uint8: works for bf16 / f8 / bool and for 0-d and empty tensors."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
