"""The tensor table of a catalog as text: ``inspect``'s table and JSON lines."""

from __future__ import annotations

import json
from collections.abc import Mapping

from .catalog import Catalog
from .header import TensorInfo

__all__ = ["format_jsonl", "format_table"]


_COLUMNS = ("name", "dtype", "shape", "file", "offset", "nbytes")
_RIGHT_ALIGNED = frozenset({"offset", "nbytes"})


def _printable(text: str) -> str:
    # Names come from untrusted headers: a newline or escape sequence must not
    # forge rows or drive the terminal.
    return text if text.isprintable() else repr(text)


def _row(tensor: TensorInfo) -> dict[str, str]:
    return {
        "name": _printable(tensor.name),
        "dtype": tensor.dtype,
        "shape": "[" + ", ".join(str(d) for d in tensor.shape) + "]",
        "file": _printable(tensor.file),
        "offset": str(tensor.offset),
        "nbytes": str(tensor.nbytes),
    }


def format_table(catalog: Catalog) -> str:
    """A human-readable table of every tensor, in checkpoint order, with a summary line."""
    rows = [dict(zip(_COLUMNS, (c.upper() for c in _COLUMNS)))] + [_row(t) for t in catalog]
    widths = {c: max(len(r[c]) for r in rows) for c in _COLUMNS}

    def line(row: Mapping[str, str]) -> str:
        cells = (row[c].rjust(widths[c]) if c in _RIGHT_ALIGNED else row[c].ljust(widths[c]) for c in _COLUMNS)
        return "  ".join(cells).rstrip()

    summary = (
        f"{len(catalog)} tensors, {catalog.total_bytes} bytes in {len(catalog.files)} files"
        f" ({'index' if catalog.index_used else 'no index'})"
    )
    return "\n".join([line(r) for r in rows] + [summary])


def format_jsonl(catalog: Catalog) -> str:
    """One JSON object per tensor per line (name, dtype, shape, file, offset, nbytes)."""
    return "".join(json.dumps(t.to_json()) + "\n" for t in catalog)
