"""safetensors header reading and validation (streamer_service.checkpoint.header)."""

from __future__ import annotations

import json
import math
import struct
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from checkpoints import (
    CountingStorage,
    DirStorage,
    mixed_tensors,
    write_raw_safetensors,
)
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save, save_file

from streamer_client._dtypes import DTYPES
from streamer_client.errors import HeaderError
from streamer_service.checkpoint import header as header_module
from streamer_service.checkpoint.header import (
    MAX_HEADER_BYTES,
    FileHeader,
    TensorInfo,
    parse_header,
    read_header,
)

FILE = "bad-shard.safetensors"


def f32(begin: int, end: int, shape: list[int] | None = None) -> dict[str, Any]:
    return {"dtype": "F32", "shape": shape if shape is not None else [(end - begin) // 4], "data_offsets": [begin, end]}


def parse_bytes(blob: bytes, file: str = FILE) -> FileHeader:
    """parse_header over an in-memory file, as read_header would call it."""
    (n,) = struct.unpack("<Q", blob[:8])
    return parse_header(file, blob[8 : 8 + n], n, len(blob))


def parse_path(path: Path) -> FileHeader:
    return read_header(DirStorage(path.parent), path.name, path.stat().st_size)


def raw(header: dict[str, Any] | bytes, data: bytes = b"") -> bytes:
    hb = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(hb)) + hb + data


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def test_public_names() -> None:
    assert set(header_module.__all__) == {
        "HEADER_LEN_BYTES",
        "MAX_HEADER_BYTES",
        "METADATA_KEY",
        "FileHeader",
        "TensorInfo",
        "parse_header",
        "read_header",
    }
    assert all(hasattr(header_module, name) for name in header_module.__all__)


# ------------------------------------------------------------------- valid files


def test_mixed_dtypes_offsets_slice_exact_tensor_bytes(tmp_path: Path) -> None:
    tensors = mixed_tensors(seed=1)
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    header = parse_path(path)
    blob = path.read_bytes()

    assert header.file == "model.safetensors"
    assert header.file_size == len(blob)
    assert header.metadata == {"format": "pt"}
    assert header.data_start == 8 + struct.unpack("<Q", blob[:8])[0]
    assert {t.name for t in header.tensors} == set(tensors)
    offsets = [t.offset for t in header.tensors]
    assert offsets == sorted(offsets)
    with safe_open(str(path), framework="pt") as st_file:
        for info in header.tensors:
            assert info.file == "model.safetensors"
            expected = st_file.get_tensor(info.name)
            assert info.shape == tuple(expected.shape)
            assert info.dtype == st_file.get_slice(info.name).get_dtype()
            assert info.nbytes == expected.numel() * expected.element_size()
            chunk = blob[info.offset : info.offset + info.nbytes]
            assert chunk == tensor_bytes(expected) == tensor_bytes(tensors[info.name])
    # The data section is exactly tiled: nothing before, between or after.
    assert header.tensors[0].offset == header.data_start
    assert max(t.end for t in header.tensors) == len(blob)


def test_f8_variants_and_bool_round_trip(tmp_path: Path) -> None:
    tensors = {
        "e4m3": (torch.randn(7, 3) * 4).to(torch.float8_e4m3fn),
        "e5m2": (torch.randn(5) * 100).to(torch.float8_e5m2),
        "flag": torch.tensor([True, False, True]),
    }
    path = tmp_path / "f8.safetensors"
    save_file(tensors, str(path))
    header = parse_path(path)
    blob = path.read_bytes()
    by_name = {t.name: t for t in header.tensors}
    assert by_name["e4m3"].dtype == "F8_E4M3"
    assert by_name["e5m2"].dtype == "F8_E5M2"
    assert by_name["flag"].dtype == "BOOL"
    for name, t in tensors.items():
        info = by_name[name]
        assert blob[info.offset : info.end] == tensor_bytes(t)
    assert header.metadata is None


def test_zero_d_and_empty_tensors(tmp_path: Path) -> None:
    path = tmp_path / "edge.safetensors"
    save_file({"scalar": torch.tensor(2.5), "empty": torch.empty(0, 4), "x": torch.arange(3.0)}, str(path))
    by_name = {t.name: t for t in parse_path(path).tensors}
    assert by_name["scalar"].shape == () and by_name["scalar"].nbytes == 4
    assert by_name["empty"].shape == (0, 4) and by_name["empty"].nbytes == 0
    assert path.read_bytes()[by_name["scalar"].offset : by_name["scalar"].end] == struct.pack("<f", 2.5)


def test_empty_checkpoint_has_no_tensors(tmp_path: Path) -> None:
    path = tmp_path / "none.safetensors"
    save_file({}, str(path))
    header = parse_path(path)
    assert header.tensors == ()


def test_sub_byte_dtypes_on_byte_boundaries() -> None:
    header = parse_bytes(
        raw(
            {
                "f4": {"dtype": "F4", "shape": [2, 3], "data_offsets": [0, 3]},
                "f6": {"dtype": "F6_E2M3", "shape": [4], "data_offsets": [3, 6]},
            },
            b"\x01" * 6,
        )
    )
    assert [(t.name, t.nbytes) for t in header.tensors] == [("f4", 3), ("f6", 3)]


def test_header_padding_whitespace_is_accepted() -> None:
    # safetensors pads its header with spaces to an 8-byte multiple.
    hb = json.dumps({"a": f32(0, 4)}).encode() + b"   \n\t"
    header = parse_bytes(raw(hb, b"\0" * 4))
    assert header.tensors[0].offset == 8 + len(hb)


def test_metadata_null_is_no_metadata() -> None:
    assert parse_bytes(raw({"__metadata__": None, "a": f32(0, 4)}, b"\0" * 4)).metadata is None


def test_tensor_info_to_json() -> None:
    info = TensorInfo(name="w", dtype="BF16", shape=(2, 3), file="m.safetensors", offset=80, nbytes=12)
    assert info.to_json() == {"name": "w", "dtype": "BF16", "shape": [2, 3], "file": "m.safetensors", "offset": 80, "nbytes": 12}
    assert json.loads(json.dumps(info.to_json()))["shape"] == [2, 3]


# ------------------------------------------------------------------- bad headers

# (id, header dict or bytes, data bytes, words the message must contain, tensor the message must name)
BAD_HEADERS = [
    ("invalid-utf8", b'{"a\xff": 1}', b"", "UTF-8", None),
    ("invalid-json", b'{"a": {"dtype": ', b"", "not valid JSON", None),
    ("nan-constant", b'{"__metadata__": {"x": NaN}}', b"", "not valid JSON", None),
    ("bom", b"\xef\xbb\xbf{}", b"", "not valid JSON", None),
    ("trailing-nul-padding", b"{}\0\0", b"", "not valid JSON", None),
    ("deep-nesting", b"[" * 100_000 + b"]" * 100_000, b"", "JSON", None),
    (
        "huge-int-literal",
        b'{"a": {"dtype": "F32", "shape": [' + b"9" * 5000 + b'], "data_offsets": [0, 4]}}',
        b"\0" * 4,
        "shape",
        "a",
    ),
    ("top-level-list", b"[1, 2]", b"", "must be an object", None),
    ("top-level-string", b'"x"', b"", "must be an object", None),
    ("metadata-not-map", {"__metadata__": "v1"}, b"", "__metadata__", None),
    ("metadata-int-value", {"__metadata__": {"format": 1}}, b"", "__metadata__['format']", None),
    ("metadata-list", {"__metadata__": ["a"]}, b"", "__metadata__", None),
    ("entry-not-object", {"w": [0, 4]}, b"\0" * 4, "entry must be an object", "w"),
    ("entry-missing-key", {"w": {"dtype": "F32", "shape": [1]}}, b"\0" * 4, "data_offsets", "w"),
    ("entry-extra-key", {"w": {**f32(0, 4), "offset": 0}}, b"\0" * 4, "unexpected ['offset']", "w"),
    ("unknown-dtype", {"w": {"dtype": "F128", "shape": [1], "data_offsets": [0, 16]}}, b"\0" * 16, "unknown dtype 'F128'", "w"),
    ("dtype-lowercase", {"w": {"dtype": "f32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4, "unknown dtype", "w"),
    ("dtype-not-string", {"w": {"dtype": 4, "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4, "unknown dtype", "w"),
    ("shape-not-list", {"w": {"dtype": "F32", "shape": 1, "data_offsets": [0, 4]}}, b"\0" * 4, "shape", "w"),
    ("shape-negative", {"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4, "shape", "w"),
    ("shape-bool", {"w": {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}}, b"\0" * 4, "shape", "w"),
    ("shape-float", {"w": {"dtype": "F32", "shape": [1.0], "data_offsets": [0, 4]}}, b"\0" * 4, "shape", "w"),
    ("shape-minus-zero", b'{"w": {"dtype": "F32", "shape": [-0, 1], "data_offsets": [0, 0]}}', b"", "shape", "w"),
    (
        "shape-beyond-u64",
        b'{"w": {"dtype": "F32", "shape": [0, 18446744073709551616], "data_offsets": [0, 0]}}',
        b"",
        "shape",
        "w",
    ),
    ("shape-overflow", {"w": {"dtype": "F32", "shape": [2**63, 2**63, 0], "data_offsets": [0, 0]}}, b"", "overflows", "w"),
    (
        "shape-hostile-dims",
        {"w": {"dtype": "F32", "shape": [2**63] * 10_000, "data_offsets": [0, 4]}},
        b"\0" * 4,
        "overflows",
        "w",
    ),
    ("offsets-three", {"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4, 8]}}, b"\0" * 8, "data_offsets", "w"),
    ("offsets-negative", {"w": {"dtype": "F32", "shape": [1], "data_offsets": [-4, 0]}}, b"", "data_offsets", "w"),
    ("offsets-bool", {"w": {"dtype": "BOOL", "shape": [1], "data_offsets": [False, True]}}, b"\0", "data_offsets", "w"),
    ("offsets-reversed", {"w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}, b"\0" * 4, "begin 4 is after end 0", "w"),
    ("size-mismatch", {"w": f32(0, 4, shape=[2])}, b"\0" * 4, "needs 8 bytes", "w"),
    ("size-mismatch-bf16", {"w": {"dtype": "BF16", "shape": [3], "data_offsets": [0, 4]}}, b"\0" * 4, "needs 6 bytes", "w"),
    (
        "sub-byte-misaligned",
        {"w": {"dtype": "F4", "shape": [3], "data_offsets": [0, 2]}},
        b"\0" * 2,
        "whole number of bytes",
        "w",
    ),
    ("out-of-bounds", {"w": f32(0, 8)}, b"\0" * 4, "run past the end", "w"),
    ("out-of-bounds-huge", {"w": f32(2**63, 2**63 + 4)}, b"\0" * 4, "run past the end", "w"),
    ("overlap", {"a": f32(0, 8), "b": f32(4, 8)}, b"\0" * 8, "overlaps tensor 'a'", "b"),
    ("overlap-identical", {"a": f32(0, 4), "b": f32(0, 4)}, b"\0" * 4, "overlaps", "a"),
    ("gap-between", {"a": f32(0, 4), "b": f32(8, 12)}, b"\0" * 12, "gap of 4", "b"),
    ("data-not-at-zero", {"a": f32(4, 8)}, b"\0" * 8, "start of the data section", "a"),
    ("trailing-bytes", {"a": f32(0, 4)}, b"\0" * 5, "1 trailing bytes after tensor 'a'", "a"),
    ("trailing-bytes-no-tensors", {}, b"\0", "1 trailing bytes", None),
    (
        "duplicate-tensor",
        b'{"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}',
        b"\0" * 4,
        "more than once",
        "w",
    ),
    ("duplicate-metadata-key", b'{"__metadata__": {"k": "1", "k": "2"}}', b"", "more than once", None),
    (
        "lone-surrogate-name",
        b'{"\\ud800": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}',
        b"\0" * 4,
        "not valid Unicode",
        None,
    ),
]


@pytest.mark.parametrize(
    "header, data, words, tensor",
    [case[1:] for case in BAD_HEADERS],
    ids=[case[0] for case in BAD_HEADERS],
)
def test_bad_header_is_refused_naming_file_and_tensor(header, data, words, tensor) -> None:
    with pytest.raises(HeaderError) as info:
        parse_bytes(raw(header, data))
    message = str(info.value)
    assert FILE in message
    assert words in message
    if tensor is not None:
        assert repr(tensor) in message
    assert info.value.key == FILE


def test_header_length_zero() -> None:
    with pytest.raises(HeaderError, match=rf"{FILE}: header length is 0"):
        parse_header(FILE, b"", 0, 100)


def test_header_length_beyond_file() -> None:
    hb = b'{"a": 1}'
    with pytest.raises(HeaderError, match=rf"{FILE}: header length 40 runs past the end of the 16-byte file"):
        parse_header(FILE, hb, 40, 8 + len(hb))


def test_header_length_above_cap() -> None:
    with pytest.raises(HeaderError, match=rf"{FILE}: header length {MAX_HEADER_BYTES + 1} exceeds"):
        parse_header(FILE, b"{}", MAX_HEADER_BYTES + 1, 2 * MAX_HEADER_BYTES)


def test_header_bytes_disagree_with_length() -> None:
    with pytest.raises(HeaderError, match=FILE):
        parse_header(FILE, b"{}", 3, 100)


def test_cap_matches_safetensors(tmp_path: Path) -> None:
    # The crate's MAX_HEADER_SIZE is 100_000_000 (decimal); one byte more is refused by both.
    assert MAX_HEADER_BYTES == 100_000_000
    path = write_raw_safetensors(tmp_path / "big.safetensors", b"{}", b"", header_len=MAX_HEADER_BYTES + 1)
    with open(path, "r+b") as f:  # sparse file long enough to hold the claimed header
        f.truncate(8 + MAX_HEADER_BYTES + 1)
    with pytest.raises(Exception, match="too large"):
        safe_open(str(path), framework="pt")
    with pytest.raises(HeaderError, match="exceeds"):
        parse_path(path)


# ------------------------------------------------------------------- read_header


def test_read_header_makes_exactly_two_range_reads(tmp_path: Path) -> None:
    save_file(mixed_tensors(seed=2), str(tmp_path / "m.safetensors"))
    size = (tmp_path / "m.safetensors").stat().st_size
    storage = CountingStorage(tmp_path)
    header = read_header(storage, "m.safetensors", size)
    assert storage.reads == [("m.safetensors", 0, 8), ("m.safetensors", 8, header.header_len)]


def test_read_header_names_full_location(tmp_path: Path) -> None:
    write_raw_safetensors(tmp_path / "x.safetensors", {"w": f32(0, 8)}, b"\0" * 4)
    storage = DirStorage(tmp_path)
    with pytest.raises(HeaderError) as info:
        read_header(storage, "x.safetensors", (tmp_path / "x.safetensors").stat().st_size)
    assert str(info.value).startswith(storage.uri.child("x.safetensors"))
    assert "'w'" in str(info.value)


def test_read_header_refuses_bad_length_before_second_read(tmp_path: Path) -> None:
    write_raw_safetensors(tmp_path / "x.safetensors", b"{}", header_len=2**63)
    storage = CountingStorage(tmp_path)
    with pytest.raises(HeaderError, match="x.safetensors: header length 9223372036854775808 exceeds"):
        read_header(storage, "x.safetensors", 10)
    assert storage.reads == [("x.safetensors", 0, 8)]


def test_read_header_truncated_length(tmp_path: Path) -> None:
    (tmp_path / "x.safetensors").write_bytes(b"\x02\0\0")
    # The listing claimed more bytes than the read returns (object replaced, or a short read).
    with pytest.raises(HeaderError, match="x.safetensors: truncated: read 3 of 8"):
        read_header(DirStorage(tmp_path), "x.safetensors", 64)


def test_read_header_truncated_json(tmp_path: Path) -> None:
    blob = raw({"w": f32(0, 4)}, b"\0" * 4)
    (tmp_path / "x.safetensors").write_bytes(blob[:20])
    with pytest.raises(HeaderError, match="x.safetensors: truncated: read 12 of"):
        read_header(DirStorage(tmp_path), "x.safetensors", len(blob))


def test_read_header_file_smaller_than_length_field(tmp_path: Path) -> None:
    (tmp_path / "x.safetensors").write_bytes(b"\0" * 4)
    storage = CountingStorage(tmp_path)
    with pytest.raises(HeaderError, match="x.safetensors: file is 4 bytes"):
        read_header(storage, "x.safetensors", 4)
    assert storage.reads == []


# -------------------------------------------------------- agreement with safetensors


def safetensors_accepts(blob: bytes) -> bool:
    with tempfile.NamedTemporaryFile(suffix=".safetensors") as f:
        f.write(blob)
        f.flush()
        try:
            with safe_open(f.name, framework="pt"):
                return True
        except Exception:
            return False


LAYOUT_CASES = [
    ("valid", raw({"a": f32(0, 4)}, b"\0" * 4)),
    ("gap-start", raw({"a": f32(4, 8)}, b"\0" * 8)),
    ("gap-middle", raw({"a": f32(0, 4), "b": f32(8, 12)}, b"\0" * 12)),
    ("trailing", raw({"a": f32(0, 4)}, b"\0" * 5)),
    ("overlap", raw({"a": f32(0, 4), "b": f32(2, 6)}, b"\0" * 6)),
    ("empty", raw({}, b"")),
    ("empty-trailing", raw({}, b"x")),
    ("empties-share-offset", raw({"a": f32(0, 4), "e1": f32(4, 4, [0]), "e2": f32(4, 4, [0, 3])}, b"\0" * 4)),
    ("empty-inside-tensor", raw({"a": f32(0, 4), "e": f32(2, 2, [0])}, b"\0" * 4)),
    ("f4-odd", raw({"a": {"dtype": "F4", "shape": [3], "data_offsets": [0, 2]}}, b"\0\0")),
    ("f4-even", raw({"a": {"dtype": "F4", "shape": [4], "data_offsets": [0, 2]}}, b"\0\0")),
    ("metadata-null", raw({"__metadata__": None, "a": f32(0, 4)}, b"\0" * 4)),
    ("leading-space", raw(b' {"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}', b"\0" * 4)),
    ("overflow-zero", raw({"a": {"dtype": "F32", "shape": [2**63, 2**63, 0], "data_offsets": [0, 0]}})),
    ("minus-zero", raw(b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [-0, 4]}}', b"\0" * 4)),
]


@pytest.mark.parametrize("blob", [c[1] for c in LAYOUT_CASES], ids=[c[0] for c in LAYOUT_CASES])
def test_layout_rules_agree_with_safetensors(blob: bytes) -> None:
    try:
        parse_bytes(blob)
        ours = True
    except HeaderError:
        ours = False
    assert ours == safetensors_accepts(blob)


@pytest.mark.parametrize(
    "blob",
    [
        raw(
            b'{"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}',
            b"\0" * 4,
        ),
        raw({"w": {**f32(0, 4), "extra": 1}}, b"\0" * 4),
    ],
    ids=["duplicate-key", "extra-key"],
)
def test_deliberately_stricter_than_safetensors(blob: bytes) -> None:
    assert safetensors_accepts(blob)
    with pytest.raises(HeaderError):
        parse_bytes(blob)


# ------------------------------------------------------------------- property test


def _base_files() -> list[bytes]:
    g = torch.Generator().manual_seed(7)
    small = {"a": torch.randn(2, 3, generator=g), "b": torch.ones(4, dtype=torch.bfloat16), "e": torch.empty(0, 2)}
    return [save(mixed_tensors(seed=3), metadata={"format": "pt"}), save(small)]


BASES = _base_files()

json_leaves = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**65), max_value=2**65)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
    | st.sampled_from(sorted(DTYPES))
)
json_values = st.recursive(
    json_leaves,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=8,
)
small_ints = st.integers(min_value=-3, max_value=2**64 + 3) | st.integers(min_value=-64, max_value=64)


def _split(blob: bytes) -> tuple[bytes, bytes]:
    (n,) = struct.unpack("<Q", blob[:8])
    return blob[8 : 8 + n], blob[8 + n :]


def _mutate_bytes(draw, header: bytes) -> bytes:
    kind = draw(st.sampled_from(["flip", "truncate", "insert", "delete"]))
    out = bytearray(header)
    if kind == "flip":
        for pos in draw(st.lists(st.integers(0, len(out) - 1), min_size=1, max_size=4)):
            # Mostly digits: they keep the JSON well-formed, so the damage reaches
            # names, shapes and offsets rather than stopping at the JSON parser.
            out[pos] = draw(st.sampled_from(b"0123456789") | st.integers(0, 255))
    elif kind == "truncate":
        del out[draw(st.integers(0, len(out))) :]
    elif kind == "insert":
        pos = draw(st.integers(0, len(out)))
        junk = draw(
            st.binary(min_size=1, max_size=6) | st.sampled_from([b"-", b"0", b",", b'"', b"{", b"}", b"[", b"]", b"1e3", b" "])
        )
        out[pos:pos] = junk
    else:
        start = draw(st.integers(0, len(out) - 1))
        del out[start : start + draw(st.integers(1, 8))]
    return bytes(out)


def _mutate_json(draw, header: bytes) -> bytes:
    doc = json.loads(header)
    names = [k for k in doc if k != "__metadata__"]
    kind = draw(st.sampled_from(["field", "offsets", "shape", "dtype", "drop", "add", "metadata", "rename"]))
    name = draw(st.sampled_from(names))
    entry = doc[name]
    if kind == "field":
        entry[draw(st.sampled_from(["dtype", "shape", "data_offsets", "extra"]))] = draw(json_values)
    elif kind == "offsets":
        entry["data_offsets"] = [o + draw(st.integers(-8, 8)) for o in entry["data_offsets"]]
        if draw(st.booleans()):
            entry["data_offsets"][draw(st.integers(0, 1))] = draw(small_ints)
    elif kind == "shape":
        if entry["shape"] and draw(st.booleans()):
            entry["shape"][draw(st.integers(0, len(entry["shape"]) - 1))] = draw(small_ints)
        else:
            entry["shape"] = draw(st.lists(small_ints, max_size=4))
    elif kind == "dtype":
        entry["dtype"] = draw(st.sampled_from(sorted(DTYPES)) | st.text(max_size=4))
    elif kind == "drop":
        del doc[name]
    elif kind == "rename":  # usually still valid: exercises the success path
        doc[draw(st.text(max_size=6))] = doc.pop(name)
    elif kind == "add":
        doc[draw(st.text(max_size=4))] = draw(json_values)
    else:
        doc["__metadata__"] = draw(json_values)
    return json.dumps(doc).encode("utf-8", "surrogatepass")


@st.composite
def mutated_files(draw) -> tuple[bytes, int]:
    """(header bytes, file size) from a valid file with one random kind of damage."""
    header, data = _split(draw(st.sampled_from(BASES)))
    if draw(st.booleans()):
        header = _mutate_bytes(draw, header)
    else:
        header = _mutate_json(draw, header)
    # Mostly the original data length: a size change alone is a "trailing bytes" or
    # "past the end" case and would hide what the header damage does.
    data_len = max(0, len(data) + draw(st.sampled_from([0] * 8 + [-1, 1, -4, 4, -len(data)])))
    return header, 8 + len(header) + data_len


def _check_invariants(header: FileHeader) -> None:
    covered = header.data_start
    for t in header.tensors:
        spec = DTYPES[t.dtype]
        assert all(type(d) is int and d >= 0 for d in t.shape)
        assert t.nbytes == spec.nbytes(math.prod(t.shape))
        assert header.data_start <= t.offset and t.end <= header.file_size
        assert t.offset == covered or (t.nbytes == 0 and t.offset <= covered)
        covered = max(covered, t.end)
    assert covered == header.file_size
    assert [t.offset for t in header.tensors] == sorted(t.offset for t in header.tensors)


def _accepted(case: tuple[bytes, int]):
    """The parsed header when the parser accepts ``case`` (its invariants checked); None when it
    refuses it, which must be a HeaderError naming the file."""
    header_json, file_size = case
    try:
        parsed = parse_header(FILE, header_json, len(header_json), file_size)
    except HeaderError as exc:
        assert FILE in str(exc)
        return None
    _check_invariants(parsed)
    return parsed


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated_files())
def test_mutated_headers_only_raise_header_error(case: tuple[bytes, int]) -> None:
    header_json, file_size = case
    parsed = _accepted(case)
    if parsed is None:
        return
    # Whatever we accept, safetensors itself must open too.
    data = bytes(file_size - 8 - len(header_json))
    assert safetensors_accepts(struct.pack("<Q", len(header_json)) + header_json + data)


# The header-and-selection fuzz: every byte of damage a header can carry, then a selection drawn
# from the tensors it declares mixed with junk. The only outcomes allowed are a HeaderError naming
# the file, a SelectionError, or a plan whose ranges cover exactly the selected tensors' bytes.
# 10,000 cases of byte damage in the default run; 100,000 of every kind of damage under -m soak.

# Strategies built once: building them per example (from the drawn names) costs more than the test.
_COUNT = st.integers(-1, 6)  # -1: select=None
_KIND = st.integers(0, 3)
_PICK = st.integers(0, 2**16)
_JUNK = st.text(max_size=6)
_SLOT = st.sampled_from([64, 256, 4096])


def _draw_selection(data, names: list[str]) -> list[str] | None:
    """None, or up to 6 entries: tensor names, name prefixes ending in '.', or junk."""
    count = data.draw(_COUNT)
    if count < 0:
        return None
    prefixes = sorted({n[:i] for n in names for i in range(1, len(n)) if n[i - 1] == "."})
    out = []
    for _ in range(count):
        kind = data.draw(_KIND)
        if kind == 0 or not names:
            out.append(data.draw(_JUNK))
        elif kind == 1 and prefixes:
            out.append(prefixes[data.draw(_PICK) % len(prefixes)])
        else:
            out.append(names[data.draw(_PICK) % len(names)])
    return out


def _fuzz_case(case: tuple[bytes, int], data) -> None:
    from streamer_client.errors import SelectionError
    from streamer_service.checkpoint.plan import build_plan, select

    parsed = _accepted(case)
    if parsed is None:
        return
    names = [t.name for t in parsed.tensors]
    chosen = _draw_selection(data, names)
    try:
        picked = select(parsed.tensors, chosen)
    except SelectionError as exc:
        assert chosen is not None and (exc.key is None or exc.key in chosen or str(exc.key) in map(str, chosen))
        return
    assert [t.name for t in picked] == [n for n in names if n in {t.name for t in picked}]  # checkpoint order
    if chosen is not None:
        assert all(any(t.name == e or t.name.startswith(e) for e in chosen) for t in picked)
    plan = build_plan(picked, slot_size=data.draw(_SLOT))
    covered = sorted((r.offset, r.offset + r.nbytes) for b in plan.batches for r in b.ranges)
    wanted = sorted((t.offset, t.end) for t in picked if t.nbytes)
    merged: list[list[int]] = []
    for start, end in wanted:
        if merged and merged[-1][1] == start:
            merged[-1][1] = end
        else:
            merged.append([start, end])
    # Ranges may coalesce neighbours or split an oversized tensor into parts; their union is the tensors'.
    union: list[list[int]] = []
    for start, end in covered:
        if union and union[-1][1] == start:
            union[-1][1] = end
        else:
            union.append([start, end])
    assert union == merged


@st.composite
def byte_damaged_files(draw) -> tuple[bytes, int]:
    """(header bytes, file size): the cheaper half of :func:`mutated_files`, damage to raw bytes."""
    header, data = _split(draw(st.sampled_from(BASES)))
    if draw(st.integers(0, 3)):  # a quarter of the files stay whole: selections get a valid header
        header = _mutate_bytes(draw, header)
    return header, 8 + len(header) + len(data)


@settings(max_examples=10_000, deadline=None, suppress_health_check=list(HealthCheck), phases=[Phase.generate])
@given(byte_damaged_files(), st.data())
def test_fuzz_headers_and_selections_10k(case: tuple[bytes, int], data) -> None:
    _fuzz_case(case, data)


@pytest.mark.soak
@pytest.mark.timeout(3600)
@settings(max_examples=100_000, deadline=None, suppress_health_check=list(HealthCheck))
@given(mutated_files(), st.data())
def test_fuzz_headers_and_selections_100k(case: tuple[bytes, int], data) -> None:
    _fuzz_case(case, data)
