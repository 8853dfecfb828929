"""What a checkpoint error says: the upload hint only where a listing of object storage could
explain it; a tensor in two shards follows the index, once said in the log."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from checkpoints import make_sharded_checkpoint, many_small_tensors, write_raw_safetensors
from safetensors.torch import save_file

import streamer_client
from streamer_client.errors import CheckpointError, HeaderError
from streamer_service.checkpoint.catalog import INDEX_NAME
from streamer_service.checkpoint.open import open_checkpoint
from streamer_service.settings import get_settings

HINT = "(listed just now; if an upload is still in progress, load again once it has finished)"


def _open(uri):
    return open_checkpoint(uri, get_settings())


def _upload(backend, tmp_path, files: dict[str, bytes]) -> str:
    backend.put_tree("m", files)
    return backend.uri("m")


def _two_of_three_shards(tmp_path) -> dict[str, bytes]:
    src = tmp_path / "three"
    shards = make_sharded_checkpoint(src, many_small_tensors(9), n_shards=3)
    return {p.name: p.read_bytes() for p in src.iterdir() if p.name != shards[2]}


@pytest.mark.parametrize("backend", ["s3"], indirect=True)
def test_the_upload_hint_only_where_an_object_storage_listing_could_be_stale(backend, tmp_path):
    files = _two_of_three_shards(tmp_path)
    local = tmp_path / "local"
    local.mkdir()
    for name, data in files.items():
        (local / name).write_bytes(data)
    for uri, hinted in ((_upload(backend, tmp_path, files), True), (str(local), False)):
        with pytest.raises(CheckpointError) as info:
            _open(uri)
        assert "names shard 'model-00003-of-00003.safetensors', which does not exist" in info.value.message
        # A local dir is read as it is: nothing in it is listed late.
        assert str(info.value).endswith(HINT) is hinted, str(info.value)


def _duplicate_json_key(tmp_path) -> dict[str, bytes]:
    header = b'{"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}'
    return {"model.safetensors": write_raw_safetensors(tmp_path / "dup.safetensors", header, b"\0" * 4).read_bytes()}


def _overlapping_offsets(tmp_path) -> dict[str, bytes]:
    header = {
        "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
    }
    return {"model.safetensors": write_raw_safetensors(tmp_path / "overlap.safetensors", header, b"\0" * 12).read_bytes()}


def _index_duplicate_key(tmp_path) -> dict[str, bytes]:
    save_file({"a": torch.ones(1)}, str(tmp_path / "s.safetensors"))
    index = b'{"weight_map": {"a": "s.safetensors", "a": "t.safetensors"}}'
    return {"s.safetensors": (tmp_path / "s.safetensors").read_bytes(), INDEX_NAME: index}


def _in_two_shards_without_index(tmp_path) -> dict[str, bytes]:
    save_file({"x": torch.ones(2)}, str(tmp_path / "a-1.safetensors"))
    save_file({"x": torch.zeros(2)}, str(tmp_path / "a-2.safetensors"))
    return {f"a-{i}.safetensors": (tmp_path / f"a-{i}.safetensors").read_bytes() for i in (1, 2)}


@pytest.mark.parametrize("backend", ["s3"], indirect=True)
@pytest.mark.parametrize(
    "files, error, words",
    [
        (_duplicate_json_key, HeaderError, "header names key 'w' more than once"),
        (_overlapping_offsets, HeaderError, "overlap"),
        (_index_duplicate_key, CheckpointError, "names 'a' more than once"),
        (_in_two_shards_without_index, HeaderError, "tensor 'x' is in both 'a-1.safetensors' and 'a-2.safetensors'"),
    ],
    ids=["duplicate-json-key", "overlapping-offsets", "index-duplicate-key", "in-two-shards-without-index"],
)
def test_what_one_objects_bytes_say_carries_no_upload_hint(backend, tmp_path, files, error, words):
    uri = _upload(backend, tmp_path, files(tmp_path))
    with pytest.raises(error) as info:
        _open(uri)
    assert words in str(info.value)
    assert "upload is still in progress" not in str(info.value) and "listed just now" not in str(info.value)


def test_a_tensor_in_two_shards_is_taken_from_the_shard_the_index_names_and_said_once(tmp_path, caplog):
    src = tmp_path / "m"
    src.mkdir()
    save_file({"x": torch.full((2,), 1.0), "y": torch.ones(3)}, str(src / "s1.safetensors"))
    save_file({"x": torch.full((2,), 2.0), "z": torch.ones(1)}, str(src / "s2.safetensors"))
    index = {"weight_map": {"x": "s2.safetensors", "y": "s1.safetensors", "z": "s2.safetensors"}}
    (src / INDEX_NAME).write_text(json.dumps(index))
    with caplog.at_level(logging.INFO, logger="streamer_service"):
        first = _open(str(src))
        _open(str(src))  # the cached catalog: nothing said again
        got = streamer_client.load_state_dict(str(src))
    assert sorted((t.name, t.file) for t in first.catalog) == [
        ("x", "s2.safetensors"),
        ("y", "s1.safetensors"),
        ("z", "s2.safetensors"),
    ]
    assert torch.equal(got["x"], torch.full((2,), 2.0)) and set(got) == {"x", "y", "z"}
    said = [r.getMessage() for r in caplog.records if "more than one shard" in r.getMessage()]
    assert said == [
        f"{src}: 1 tensor(s) are in more than one shard; following {INDEX_NAME}, which names the shard to load "
        "each from (e.g. 'x' from 's2.safetensors', not 's1.safetensors')"
    ]
