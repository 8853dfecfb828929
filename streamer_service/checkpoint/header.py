"""safetensors headers: read with two ranged reads, validate strictly.

A safetensors file is ``<u64 little-endian N><N bytes of JSON><data section>``.
The JSON maps tensor names to ``{"dtype", "shape", "data_offsets"}`` (offsets
relative to the data section) plus an optional ``__metadata__`` str->str map.

Headers come from object storage and are untrusted. Every value is checked
before anything is planned from it, and nothing is ever allocated from a size
the header claims. The rules follow the safetensors crate's own loader
(``SafeTensors::read_metadata`` / ``Metadata::validate``, checked against
safetensors 0.8), so a file we accept is one ``safe_open`` accepts too:

- header length: at most 100,000,000 bytes (the crate's ``MAX_HEADER_SIZE``,
  decimal, not MiB) and within the file; 0 is invalid JSON to the crate;
- the data section is covered exactly: tensors sorted by offset start at 0,
  each begins where the previous ended (a gap or an overlap is the crate's
  ``InvalidOffset``), and the last ends at the end of the file (trailing bytes
  are the crate's ``MetadataIncompleteBuffer``);
- a tensor's byte count is ``numel * bits / 8`` and must be a whole number of
  bytes for sub-byte dtypes (the crate's ``MisalignedSlice``).

We are stricter than the crate in two places, both deliberate: duplicate keys
in the JSON (the crate silently keeps one of them, so two readers could
disagree on which) and unknown keys in a tensor entry (ignored by the crate;
a typo such as ``data_offset`` would otherwise pass as a different file).
"""

from __future__ import annotations

import json
import struct
from typing import TYPE_CHECKING, Any, NamedTuple

from streamer_client._dtypes import DTYPES
from streamer_client.errors import HeaderError

if TYPE_CHECKING:
    from ..storage.base import Storage

__all__ = [
    "HEADER_LEN_BYTES",
    "MAX_HEADER_BYTES",
    "METADATA_KEY",
    "FileHeader",
    "TensorInfo",
    "parse_header",
    "read_header",
]

HEADER_LEN_BYTES = 8
"""The little-endian u64 that precedes the JSON header."""

# The crate's limit is `MAX_HEADER_SIZE = 100_000_000` (decimal): a header of
# 100 MiB (104,857,600 bytes) is refused by safe_open with "header too large",
# so accepting it here would plan a file that no safetensors loader can open.
MAX_HEADER_BYTES = 100_000_000

METADATA_KEY = "__metadata__"

_TENSOR_KEYS = frozenset({"dtype", "shape", "data_offsets"})
_U64_MAX = 2**64 - 1  # the crate counts sizes in usize


class TensorInfo(NamedTuple):
    """Where one tensor's bytes live.

    ``file`` is the object name relative to the checkpoint prefix; ``offset``
    is absolute within that file (``8 + header_len + data_offsets[0]``), so a
    ranged read of ``[offset, offset + nbytes)`` returns exactly the tensor.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: str
    offset: int
    nbytes: int

    @property
    def end(self) -> int:
        return self.offset + self.nbytes

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "file": self.file,
            "offset": self.offset,
            "nbytes": self.nbytes,
        }


class FileHeader(NamedTuple):
    """The validated header of one safetensors file; ``tensors`` sorted by offset."""

    file: str
    file_size: int
    header_len: int
    tensors: tuple[TensorInfo, ...]
    metadata: dict[str, str] | None

    @property
    def data_start(self) -> int:
        """Absolute offset of the data section (where data_offsets count from)."""
        return HEADER_LEN_BYTES + self.header_len


class _Entry(NamedTuple):
    """One tensor entry after type checks, before layout checks."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


# --------------------------------------------------------------------------- reading


def read_header(storage: Storage, file: str, file_size: int) -> FileHeader:
    """Read and validate the header of ``file`` with exactly two ranged reads.

    The first read fetches the 8-byte length, the second exactly the JSON. The
    length is validated before the second read, so a corrupt length never
    turns into a huge request. ``file_size`` comes from the listing.
    """
    location = storage.uri.child(file)
    if file_size < HEADER_LEN_BYTES:
        raise HeaderError(
            f"{location}: file is {file_size} bytes, too small for a safetensors header",
            key=file,
        )
    prefix = storage.read_range(file, 0, HEADER_LEN_BYTES)
    if len(prefix) != HEADER_LEN_BYTES:
        raise HeaderError(
            f"{location}: truncated: read {len(prefix)} of {HEADER_LEN_BYTES} header length bytes",
            key=file,
        )
    (header_len,) = struct.unpack("<Q", prefix)
    _check_header_len(header_len, file_size, location, file)
    header_json = storage.read_range(file, HEADER_LEN_BYTES, header_len)
    if len(header_json) != header_len:
        raise HeaderError(
            f"{location}: truncated: read {len(header_json)} of {header_len} header bytes",
            key=file,
        )
    return parse_header(file, header_json, header_len, file_size, location=location)


# --------------------------------------------------------------------------- parsing


def parse_header(
    file: str,
    header_json: bytes,
    header_len: int,
    file_size: int,
    *,
    location: str | None = None,
) -> FileHeader:
    """Validate one header and return its tensors with absolute offsets.

    ``file`` becomes ``TensorInfo.file``; ``location`` (default ``file``) is
    how error messages name the file, e.g. its full URI. Every failure is a
    :class:`HeaderError` naming the file and, where one is at fault, the tensor.
    """
    where = location if location is not None else file
    _check_header_len(header_len, file_size, where, file)
    if len(header_json) != header_len:
        raise HeaderError(
            f"{where}: header is {len(header_json)} bytes but its length field says {header_len}",
            key=file,
        )
    top = _decode(header_json, where, file)
    metadata = _parse_metadata(top.pop(METADATA_KEY, None), where, file)
    entries = [_parse_entry(name, value, where, file) for name, value in top.items()]
    data_len = file_size - HEADER_LEN_BYTES - header_len
    entries = _check_layout(entries, data_len, where, file)
    data_start = HEADER_LEN_BYTES + header_len
    tensors = tuple(
        TensorInfo(
            name=e.name,
            dtype=e.dtype,
            shape=e.shape,
            file=file,
            offset=data_start + e.begin,
            nbytes=e.end - e.begin,
        )
        for e in entries
    )
    return FileHeader(file=file, file_size=file_size, header_len=header_len, tensors=tensors, metadata=metadata)


def _check_header_len(header_len: int, file_size: int, where: str, file: str) -> None:
    if header_len == 0:
        raise HeaderError(f"{where}: header length is 0 (no JSON header)", key=file)
    if header_len > MAX_HEADER_BYTES:
        raise HeaderError(
            f"{where}: header length {header_len} exceeds the {MAX_HEADER_BYTES}-byte limit",
            key=file,
        )
    if HEADER_LEN_BYTES + header_len > file_size:
        raise HeaderError(
            f"{where}: header length {header_len} runs past the end of the {file_size}-byte file",
            key=file,
        )


class _DuplicateKey(Exception):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # json.loads keeps the last of duplicate keys silently; a duplicated tensor
    # name means two readers could disagree on where that tensor lives.
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise _DuplicateKey(key)
        result[key] = value
    return result


def _reject_constant(token: str) -> Any:
    # Python's json accepts NaN/Infinity; JSON (and serde_json) do not.
    raise ValueError(f"non-JSON constant {token}")


def _parse_int(token: str) -> int | float:
    # Match serde_json, which the crate uses: "-0" and integers beyond u64
    # parse as floats there and so fail as sizes. Returning floats makes the
    # usual "must be non-negative integers" checks refuse them the same way,
    # and bounds every size below 2**64 (no huge Python ints from a header).
    if token == "-0" or len(token) > 20 or (token[0] != "-" and int(token) > _U64_MAX):
        return float(token)
    return int(token)


def _decode(header_json: bytes, where: str, file: str) -> dict[str, Any]:
    try:
        text = header_json.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise HeaderError(f"{where}: header is not valid UTF-8 ({exc.reason} at byte {exc.start})", key=file) from None
    try:
        top = json.loads(
            text,
            object_pairs_hook=_reject_duplicates,
            parse_constant=_reject_constant,
            parse_int=_parse_int,
        )
    except _DuplicateKey as exc:
        raise HeaderError(f"{where}: header names key {exc.key!r} more than once", key=file) from None
    except RecursionError:
        raise HeaderError(f"{where}: header JSON is nested too deeply", key=file) from None
    except ValueError as exc:  # JSONDecodeError, NaN, int digit limit
        raise HeaderError(f"{where}: header is not valid JSON: {exc}", key=file) from None
    if not isinstance(top, dict):
        raise HeaderError(f"{where}: header JSON must be an object, got {type(top).__name__}", key=file)
    for name in top:
        _check_text(name, where, file, "tensor name")
    return top


def _check_text(text: str, where: str, file: str, what: str) -> None:
    # JSON escapes can smuggle lone surrogates (\ud800) into Python str; such a
    # name cannot be re-encoded for the table, the cache or the client.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise HeaderError(f"{where}: {what} {text!r} is not valid Unicode", key=file) from None


def _parse_metadata(value: Any, where: str, file: str) -> dict[str, str] | None:
    # null is what the crate accepts for an absent map (serde Option).
    if value is None:
        return None
    if not isinstance(value, dict):
        raise HeaderError(
            f"{where}: {METADATA_KEY} must be an object of strings, got {type(value).__name__}",
            key=file,
        )
    for key, item in value.items():
        if not isinstance(item, str):
            raise HeaderError(
                f"{where}: {METADATA_KEY}[{key!r}] must be a string, got {type(item).__name__}",
                key=file,
            )
        _check_text(key, where, file, f"{METADATA_KEY} key")
        _check_text(item, where, file, f"{METADATA_KEY}[{key!r}]")
    return dict(value)


def _is_uint(value: Any) -> bool:
    # bool is a subclass of int in Python; JSON true is not a size.
    return type(value) is int and value >= 0


def _parse_entry(name: str, value: Any, where: str, file: str) -> _Entry:
    def fail(reason: str) -> HeaderError:
        return HeaderError(f"{where}: tensor {name!r}: {reason}", key=file)

    if not isinstance(value, dict):
        raise fail(f"entry must be an object, got {type(value).__name__}")
    keys = set(value)
    if keys != _TENSOR_KEYS:
        missing = sorted(_TENSOR_KEYS - keys)
        extra = sorted(keys - _TENSOR_KEYS)
        raise fail(f"entry must have exactly dtype, shape, data_offsets (missing {missing}, unexpected {extra})")

    dtype = value["dtype"]
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise fail(f"unknown dtype {dtype!r}")

    shape = value["shape"]
    if not isinstance(shape, list) or not all(_is_uint(d) for d in shape):
        raise fail(f"shape must be a list of non-negative integers, got {shape!r:.200}")

    offsets = value["data_offsets"]
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_uint(o) for o in offsets)):
        raise fail(f"data_offsets must be two non-negative integers, got {offsets!r:.200}")
    begin, end = offsets
    if begin > end:
        raise fail(f"data_offsets begin {begin} is after end {end}")

    try:
        expected = _nbytes(dtype, shape)
    except ValueError as exc:
        raise fail(f"{dtype} shape {shape!r:.200} {exc}") from None
    if expected != end - begin:
        raise fail(f"{dtype} shape {shape!r:.200} needs {expected} bytes but data_offsets [{begin}, {end}) hold {end - begin}")
    return _Entry(name=name, dtype=dtype, shape=tuple(shape), begin=begin, end=end)


def _nbytes(dtype: str, shape: list[int]) -> int:
    """Bytes of a ``dtype`` tensor of ``shape``; ``ValueError`` saying why there is none.

    Mirrors the crate's ``Metadata::validate``: the element count is folded
    left to right with overflow checks at 64 bits (so ``[2**63, 2**63, 0]``
    overflows although it has no elements), then multiplied by the bit size,
    which for sub-byte dtypes must come to whole bytes.
    """
    numel = 1
    for dim in shape:
        numel *= dim  # dim < 2**64 (see _parse_int), so this stays a small Python int
        if numel > _U64_MAX:
            raise ValueError("overflows a 64-bit element count")
    spec = DTYPES[dtype]
    if numel * spec.bits > _U64_MAX:
        raise ValueError("overflows a 64-bit bit count")
    return spec.nbytes(numel)


def _check_layout(entries: list[_Entry], data_len: int, where: str, file: str) -> list[_Entry]:
    """Sort by offset and require the spans to tile ``[0, data_len)`` exactly."""
    # Name breaks ties so empty tensors sharing an offset keep a stable order.
    ordered = sorted(entries, key=lambda e: (e.begin, e.end, e.name))
    for e in ordered:
        if e.end > data_len:
            raise HeaderError(
                f"{where}: tensor {e.name!r}: data_offsets [{e.begin}, {e.end}) run past the "
                f"end of the {data_len}-byte data section",
                key=file,
            )
    covered = 0
    holder: _Entry | None = None  # the non-empty tensor that ends at `covered`
    for e in ordered:
        if e.begin < covered:
            assert holder is not None
            raise HeaderError(
                f"{where}: tensor {e.name!r} [{e.begin}, {e.end}) overlaps tensor {holder.name!r} [{holder.begin}, {holder.end})",
                key=file,
            )
        if e.begin > covered:
            after = f"after tensor {holder.name!r}" if holder else "at the start of the data section"
            raise HeaderError(
                f"{where}: tensor {e.name!r}: gap of {e.begin - covered} unreferenced bytes "
                f"{after} (the data section must be fully covered)",
                key=file,
            )
        if e.end > covered:
            covered, holder = e.end, e
    if covered != data_len:
        after = f"after tensor {holder.name!r}" if holder else "after the header"
        raise HeaderError(
            f"{where}: {data_len - covered} trailing bytes {after} (the data section must end where the last tensor ends)",
            key=file,
        )
    return ordered
