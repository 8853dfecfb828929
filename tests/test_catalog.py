"""The tensor table of a checkpoint (streamer_service.checkpoint.catalog)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from checkpoints import (
    INDEX_NAME,
    CountingStorage,
    DirStorage,
    make_sharded_checkpoint,
    many_small_tensors,
    mixed_tensors,
    shard_name,
    write_raw_safetensors,
)
from safetensors import safe_open
from safetensors.torch import save_file

from streamer_client.errors import CheckpointError, HeaderError, ObjectNotFoundError
from streamer_service.checkpoint import catalog as catalog_module
from streamer_service.checkpoint.catalog import (
    Catalog,
    build_catalog,
    shard_group,
)
from streamer_service.checkpoint.tensor_table import format_jsonl, format_table
from streamer_service.settings import Settings
from streamer_service.storage import open_storage
from streamer_service.storage.base import ObjectInfo
from streamer_service.uri import parse_uri


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def write_index(directory: Path, weight_map: dict[str, str]) -> None:
    (directory / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))


def assert_bytes_match(directory: Path, catalog: Catalog, tensors: dict[str, torch.Tensor]) -> None:
    blobs = {f.name: (directory / f.name).read_bytes() for f in catalog.files}
    for info in catalog:
        assert blobs[info.file][info.offset : info.end] == tensor_bytes(tensors[info.name]), info.name


def test_public_names() -> None:
    expected = {"INDEX_NAME", "Catalog", "build_catalog", "shard_group"}
    assert set(catalog_module.__all__) == expected
    assert all(hasattr(catalog_module, name) for name in expected)


# ------------------------------------------------------------------- with an index


def test_index_and_shards(tmp_path: Path) -> None:
    tensors = mixed_tensors(seed=5)
    shards = make_sharded_checkpoint(tmp_path, tensors, n_shards=3)
    (tmp_path / "config.json").write_text("{}")
    catalog = build_catalog(DirStorage(tmp_path))

    assert catalog.index_used
    assert catalog.index is not None and catalog.index.name == INDEX_NAME
    assert set(catalog.by_name) == set(tensors)
    assert len(catalog) == len(tensors)
    assert sorted(f.name for f in catalog.files) == shards
    assert {t.file for t in catalog} == set(shards)
    assert_bytes_match(tmp_path, catalog, tensors)
    for info in catalog:
        with safe_open(str(tmp_path / info.file), framework="pt") as f:
            assert info.name in f.keys()
    assert catalog.total_bytes == sum(t.numel() * t.element_size() for t in tensors.values())


def test_checkpoint_order_follows_index_first_appearance_then_offset(tmp_path: Path) -> None:
    save_file({"z.first": torch.ones(3), "a.second": torch.ones(5)}, str(tmp_path / "b.safetensors"))
    save_file({"m.third": torch.ones(2), "b.fourth": torch.ones(7)}, str(tmp_path / "a.safetensors"))
    # The index names a tensor of b.safetensors first, so b comes before a despite its name.
    write_index(
        tmp_path,
        {
            "a.second": "b.safetensors",
            "b.fourth": "a.safetensors",
            "m.third": "a.safetensors",
            "z.first": "b.safetensors",
        },
    )

    catalog = build_catalog(DirStorage(tmp_path))

    assert [f.name for f in catalog.files] == ["b.safetensors", "a.safetensors"]
    assert [t.file for t in catalog] == ["b.safetensors"] * 2 + ["a.safetensors"] * 2
    # Within a file, offset order (save_file lays same-dtype tensors out by name).
    assert [t.name for t in catalog] == ["a.second", "z.first", "b.fourth", "m.third"]
    for file in ("a.safetensors", "b.safetensors"):
        offsets = [t.offset for t in catalog if t.file == file]
        assert offsets == sorted(offsets)


def test_index_wins_over_competing_files(tmp_path: Path) -> None:
    tensors = many_small_tensors(6)
    make_sharded_checkpoint(tmp_path, tensors, n_shards=2)
    save_file({"other": torch.ones(2)}, str(tmp_path / "consolidated.safetensors"))
    save_file(tensors, str(tmp_path / "model.safetensors"))
    storage = CountingStorage(tmp_path)

    catalog = build_catalog(storage)

    assert catalog.index_used
    assert [f.name for f in catalog.files] == [shard_name(1, 2), shard_name(2, 2)]
    assert {name for name, _, _ in storage.reads} == {shard_name(1, 2), shard_name(2, 2)}
    assert_bytes_match(tmp_path, catalog, tensors)


def test_index_names_missing_tensor(tmp_path: Path) -> None:
    make_sharded_checkpoint(tmp_path, many_small_tensors(4), n_shards=2)
    weight_map = json.loads((tmp_path / INDEX_NAME).read_text())["weight_map"]
    weight_map["ghost.weight"] = shard_name(2, 2)
    write_index(tmp_path, weight_map)
    with pytest.raises(CheckpointError) as info:
        build_catalog(DirStorage(tmp_path))
    assert "'ghost.weight'" in str(info.value)
    assert shard_name(2, 2) in str(info.value)


def test_index_maps_tensor_to_wrong_shard(tmp_path: Path) -> None:
    make_sharded_checkpoint(tmp_path, many_small_tensors(4), n_shards=2)
    weight_map = json.loads((tmp_path / INDEX_NAME).read_text())["weight_map"]
    weight_map["layers.0.weight"] = shard_name(2, 2)  # really in shard 1
    write_index(tmp_path, weight_map)
    with pytest.raises(CheckpointError, match=r"'layers\.0\.weight'.*model-00002-of-00002"):
        build_catalog(DirStorage(tmp_path))


def test_tensor_missing_from_index_is_refused(tmp_path: Path) -> None:
    make_sharded_checkpoint(tmp_path, many_small_tensors(4), n_shards=2)
    weight_map = json.loads((tmp_path / INDEX_NAME).read_text())["weight_map"]
    del weight_map["layers.3.weight"]
    write_index(tmp_path, weight_map)
    with pytest.raises(CheckpointError) as info:
        build_catalog(DirStorage(tmp_path))
    assert "'layers.3.weight'" in str(info.value)
    assert shard_name(2, 2) in str(info.value)
    assert "not in" in str(info.value)


def test_missing_shard_file(tmp_path: Path) -> None:
    make_sharded_checkpoint(tmp_path, many_small_tensors(6), n_shards=3)
    (tmp_path / shard_name(2, 3)).unlink()
    with pytest.raises(CheckpointError) as info:
        build_catalog(DirStorage(tmp_path))
    assert shard_name(2, 3) in str(info.value)
    assert info.value.key == shard_name(2, 3)


def test_duplicate_tensor_across_shards_with_index(tmp_path: Path) -> None:
    save_file({"x": torch.ones(2), "y": torch.ones(3)}, str(tmp_path / "s1.safetensors"))
    save_file({"x": torch.zeros(2), "z": torch.ones(1)}, str(tmp_path / "s2.safetensors"))
    write_index(tmp_path, {"x": "s1.safetensors", "y": "s1.safetensors", "z": "s2.safetensors"})
    catalog = build_catalog(DirStorage(tmp_path))  # the index says where x is: the copy in s2 is left out
    assert sorted((t.name, t.file) for t in catalog) == [
        ("x", "s1.safetensors"),
        ("y", "s1.safetensors"),
        ("z", "s2.safetensors"),
    ]


@pytest.mark.parametrize(
    "content, words",
    [
        (b"{not json", "not valid JSON"),
        (b'{"metadata": {}}', "no weight_map"),
        (b'{"weight_map": {"a": 1}}', "no weight_map"),
        (b'{"weight_map": {}}', "empty weight_map"),
        (b'{"weight_map": {"a": "s.safetensors", "a": "t.safetensors"}}', "more than once"),
        (b"\xff\xfe", "not valid JSON"),
    ],
)
def test_bad_index(tmp_path: Path, content: bytes, words: str) -> None:
    save_file({"a": torch.ones(1)}, str(tmp_path / "s.safetensors"))
    (tmp_path / INDEX_NAME).write_bytes(content)
    with pytest.raises(CheckpointError) as info:
        build_catalog(DirStorage(tmp_path))
    assert INDEX_NAME in str(info.value)
    assert words in str(info.value)


# ---------------------------------------------------------------- without an index


def test_single_file_without_index(tmp_path: Path) -> None:
    tensors = mixed_tensors(seed=6)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "tokenizer.json").write_text("{}")
    catalog = build_catalog(DirStorage(tmp_path))
    assert not catalog.index_used and catalog.index is None
    assert [f.name for f in catalog.files] == ["model.safetensors"]
    assert set(catalog.by_name) == set(tensors)
    offsets = [t.offset for t in catalog]
    assert offsets == sorted(offsets)
    assert_bytes_match(tmp_path, catalog, tensors)


def test_shard_set_without_index_in_name_order(tmp_path: Path) -> None:
    tensors = many_small_tensors(9)
    make_sharded_checkpoint(tmp_path, tensors, n_shards=3, with_index=False)
    catalog = build_catalog(DirStorage(tmp_path))
    assert not catalog.index_used
    assert [f.name for f in catalog.files] == [shard_name(i, 3) for i in (1, 2, 3)]
    # Shards were written in dict order, so checkpoint order is the dict order.
    assert [t.name for t in catalog] == list(tensors)
    assert_bytes_match(tmp_path, catalog, tensors)


def test_subdirectories_are_ignored_without_index(tmp_path: Path) -> None:
    save_file({"a": torch.ones(2)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "original").mkdir()
    save_file({"b": torch.ones(2)}, str(tmp_path / "original" / "consolidated.safetensors"))
    catalog = build_catalog(DirStorage(tmp_path))
    assert [f.name for f in catalog.files] == ["model.safetensors"]


@pytest.mark.parametrize(
    "names",
    [
        ["model.safetensors", shard_name(1, 2), shard_name(2, 2)],
        ["consolidated.safetensors", shard_name(1, 1)],
        ["consolidated.00.safetensors", "consolidated.01.safetensors", "model.safetensors"],
        [shard_name(1, 2), shard_name(2, 2), shard_name(1, 3), shard_name(2, 3), shard_name(3, 3)],
        ["model.safetensors", "adapter_model.safetensors"],
    ],
    ids=["single-vs-sharded", "consolidated-vs-sharded", "numbered-vs-single", "two-shard-counts", "adapter"],
)
def test_competing_shard_sets_without_index(tmp_path: Path, names: list[str]) -> None:
    for i, name in enumerate(names):
        save_file({f"t{i}": torch.ones(1)}, str(tmp_path / name))
    with pytest.raises(CheckpointError) as info:
        build_catalog(DirStorage(tmp_path))
    message = str(info.value)
    assert "competing" in message
    assert str(tmp_path) in message
    for name in names:
        assert name in message


def test_competing_sets_are_fine_with_index(tmp_path: Path) -> None:
    tensors = many_small_tensors(4)
    make_sharded_checkpoint(tmp_path, tensors, n_shards=2)
    save_file({"x": torch.ones(1)}, str(tmp_path / "model.safetensors"))
    catalog = build_catalog(DirStorage(tmp_path))
    assert catalog.index_used and set(catalog.by_name) == set(tensors)


def test_incomplete_shard_set_without_index(tmp_path: Path) -> None:
    make_sharded_checkpoint(tmp_path, many_small_tensors(6), n_shards=3, with_index=False)
    (tmp_path / shard_name(2, 3)).unlink()
    with pytest.raises(CheckpointError, match=r"incomplete: missing model-00002-of-00003\.safetensors"):
        build_catalog(DirStorage(tmp_path))


def test_duplicate_tensor_across_files_without_index(tmp_path: Path) -> None:
    save_file({"w": torch.ones(2), "a": torch.ones(1)}, str(tmp_path / "consolidated.00.safetensors"))
    save_file({"b": torch.ones(1), "w": torch.ones(2)}, str(tmp_path / "consolidated.01.safetensors"))
    with pytest.raises(CheckpointError) as info:
        build_catalog(DirStorage(tmp_path))
    message = str(info.value)
    assert "'w'" in message
    assert "consolidated.00.safetensors" in message and "consolidated.01.safetensors" in message


def test_no_safetensors_at_all(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"\0" * 8)
    storage = DirStorage(tmp_path)
    with pytest.raises(ObjectNotFoundError) as info:
        build_catalog(storage)
    assert storage.uri.normalized in str(info.value)
    assert info.value.uri == storage.uri.normalized


def test_corrupt_shard_header_names_file(tmp_path: Path) -> None:
    make_sharded_checkpoint(tmp_path, many_small_tensors(4), n_shards=2, with_index=False)
    write_raw_safetensors(
        tmp_path / shard_name(2, 2), {"layers.2.weight": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4
    )
    with pytest.raises(HeaderError) as info:
        build_catalog(DirStorage(tmp_path))
    assert shard_name(2, 2) in str(info.value) and "'layers.2.weight'" in str(info.value)


# ------------------------------------------------------------------- requests made


def test_exactly_two_range_reads_per_file(tmp_path: Path) -> None:
    make_sharded_checkpoint(tmp_path, many_small_tensors(40), n_shards=8)
    storage = CountingStorage(tmp_path)
    catalog = build_catalog(storage)
    per_file = Counter(name for name, _, _ in storage.reads)
    assert per_file == {f.name: 2 for f in catalog.files}
    sizes = {f.name: f.size for f in catalog.files}
    for name, offset, length in storage.reads:
        assert (offset, length) == (0, 8) or offset == 8
        assert offset + length < sizes[name]  # never the whole file
    assert storage.downloads == [INDEX_NAME]
    assert storage.listings == 1


def test_given_listing_is_used_not_relisted(tmp_path: Path) -> None:
    make_sharded_checkpoint(tmp_path, many_small_tensors(4), n_shards=2)
    storage = CountingStorage(tmp_path)
    objects = DirStorage(tmp_path).list_objects()
    catalog = build_catalog(storage, objects)
    assert storage.listings == 0
    assert list(catalog.files) == [o for o in objects if o.name.endswith(".safetensors")]


def test_thread_pool_order_is_deterministic(tmp_path: Path) -> None:
    tensors = many_small_tensors(60)
    make_sharded_checkpoint(tmp_path, tensors, n_shards=12)
    first = build_catalog(DirStorage(tmp_path), max_workers=8)
    serial = build_catalog(DirStorage(tmp_path), max_workers=1)
    assert first == serial
    # HF writes the index with sorted keys, so "layers.10" (shard 3) precedes "layers.2"
    # (shard 2): first appearance in the index, not shard number, decides file order.
    weight_map = json.loads((tmp_path / INDEX_NAME).read_text())["weight_map"]
    assert [f.name for f in first.files] == list(dict.fromkeys(weight_map.values()))
    assert [f.name for f in first.files][:3] == [shard_name(1, 12), shard_name(3, 12), shard_name(4, 12)]


# ---------------------------------------------------------------- caching, output


def test_json_round_trip(tmp_path: Path) -> None:
    make_sharded_checkpoint(tmp_path, mixed_tensors(seed=8), n_shards=2)
    catalog = build_catalog(DirStorage(tmp_path))
    restored = Catalog.from_json(json.loads(json.dumps(catalog.to_json())))
    assert restored == catalog
    assert restored.tensors == catalog.tensors
    assert dict(restored.by_name) == dict(catalog.by_name)
    assert restored.index_used and restored.index == catalog.index
    assert all(isinstance(t.shape, tuple) for t in restored)


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d.pop("tensors"),
        lambda d: d.update(format=99),
        lambda d: d["tensors"][0].update(offset="8"),
        lambda d: d["tensors"][0].update(shape=[True]),
        lambda d: d["files"][0].update(size=None),
        lambda d: d["tensors"].append(d["tensors"][0]),
    ],
    ids=["no-tensors", "format", "offset-str", "shape-bool", "size-none", "duplicate"],
)
def test_from_json_refuses_malformed_cache(tmp_path: Path, mutate) -> None:
    save_file(mixed_tensors(seed=9), str(tmp_path / "model.safetensors"))
    data = build_catalog(DirStorage(tmp_path)).to_json()
    mutate(data)
    with pytest.raises(CheckpointError):
        Catalog.from_json(data)


def test_fingerprint() -> None:
    objects = [
        ObjectInfo("model-00001-of-00002.safetensors", 100, "e1"),
        ObjectInfo("model-00002-of-00002.safetensors", 200, "e2"),
        ObjectInfo(INDEX_NAME, 50, "e3"),
        ObjectInfo("config.json", 10, "e4"),
    ]
    key = Catalog.fingerprint(objects)
    assert key == Catalog.fingerprint(list(reversed(objects)))
    assert len(key) == 64 and int(key, 16) >= 0
    # Non-weight files do not invalidate the catalog...
    assert key == Catalog.fingerprint(objects[:3] + [ObjectInfo("config.json", 11, "e5")])
    # ...a changed shard, size or index does.
    assert key != Catalog.fingerprint([objects[0]._replace(etag="new")] + objects[1:])
    assert key != Catalog.fingerprint([objects[1]._replace(size=201)] + objects[:1] + objects[2:])
    assert key != Catalog.fingerprint(objects[:2] + objects[3:])


def test_format_table(tmp_path: Path) -> None:
    save_file(
        {"embed.weight": torch.ones(4, 2, dtype=torch.bfloat16), "bad\nname": torch.ones(1)}, str(tmp_path / "model.safetensors")
    )
    catalog = build_catalog(DirStorage(tmp_path))
    lines = format_table(catalog).splitlines()
    assert lines[0].split() == ["NAME", "DTYPE", "SHAPE", "FILE", "OFFSET", "NBYTES"]
    assert len(lines) == 1 + len(catalog) + 1  # header, rows, summary
    row = next(line for line in lines if line.startswith("embed.weight"))
    info = catalog["embed.weight"]
    assert row.split() == ["embed.weight", "BF16", "[4,", "2]", "model.safetensors", str(info.offset), "16"]
    assert any("'bad\\nname'" in line for line in lines)  # a newline in a name cannot forge a row
    assert lines[-1].startswith("2 tensors, 20 bytes in 1 files")


def test_format_jsonl(tmp_path: Path) -> None:
    tensors = mixed_tensors(seed=10)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    catalog = build_catalog(DirStorage(tmp_path))
    lines = format_jsonl(catalog).splitlines()
    assert [json.loads(line) for line in lines] == [t.to_json() for t in catalog]
    assert list(json.loads(lines[0])) == ["name", "dtype", "shape", "file", "offset", "nbytes"]


@pytest.mark.parametrize(
    "name, group",
    [
        ("model-00001-of-00003.safetensors", "model-*-of-00003.safetensors"),
        ("model-00003-of-00003.safetensors", "model-*-of-00003.safetensors"),
        ("model.safetensors", "model.safetensors"),
        ("consolidated.00.safetensors", "consolidated.*.safetensors"),
        ("consolidated.safetensors", "consolidated.safetensors"),
    ],
)
def test_shard_group(name: str, group: str) -> None:
    assert shard_group(name) == group


# ------------------------------------------------------------------- real backends


def test_catalog_on_every_backend(backend, tmp_path: Path) -> None:
    # The same checkpoint through each real backend (local files and the cloud
    # emulators) must give the same table, and its offsets must slice the stored bytes.
    source = tmp_path / "source"
    tensors = mixed_tensors(seed=11)
    make_sharded_checkpoint(source, tensors, n_shards=3)
    backend.put_tree("ckpt", {p.name: p.read_bytes() for p in source.iterdir()})
    expected = build_catalog(DirStorage(source))

    with open_storage(parse_uri(backend.uri("ckpt")), Settings()) as storage:
        catalog = build_catalog(storage)

    assert catalog.tensors == expected.tensors
    assert [(f.name, f.size) for f in catalog.files] == [(f.name, f.size) for f in expected.files]
    assert catalog.index_used
    blobs = {f.name: (source / f.name).read_bytes() for f in catalog.files}
    for info in catalog:
        assert blobs[info.file][info.offset : info.end] == tensor_bytes(tensors[info.name])
