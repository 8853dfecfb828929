"""The daemon's handles as a rank reads them: grouped by batch, checked against the segment as the
rank mapped it before a byte is read, and the errors that name them.

A handle (``protocol.Handle``) says where a tensor's bytes are: ``nbytes`` at ``offset`` of a
shared-memory segment. The rank does not take it on trust: :func:`check` refuses a handle that
does not name exactly its tensor's bytes, or whose bytes are not all inside the mapping (a
segment file cut short or replaced before the rank mapped it, a handle the daemon got wrong), so
that no delivery path reads outside a mapping, makes a short view, or leaves a tensor partly
unwritten.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

from ._dtypes import DTYPES, DType
from ._protocol import Handle
from .errors import DaemonError

__all__ = ["by_batch", "check", "cut_short"]


def check(h: Handle, size: int) -> None:
    """``h`` must name exactly its tensor's bytes (as many as its dtype and shape take) and lie
    inside its segment's ``size`` bytes as this rank mapped them (a handle of no segment: no
    bytes). Otherwise ``DaemonError`` naming the tensor, the segment and the bounds."""
    problem = None
    spec = DTYPES.get(h.dtype)
    takes = _nbytes(spec, h.shape) if spec is not None else h.nbytes  # a dtype not in the table: refused where it is made
    if h.nbytes < 0 or any(d < 0 for d in h.shape):
        problem = f"{h.nbytes} bytes of shape {list(h.shape)} is not a size"
    elif takes != h.nbytes:
        whole = f"takes {takes}" if takes is not None else "is no whole number of bytes"
        problem = f"{h.nbytes} bytes, but a {h.dtype} tensor of shape {list(h.shape)} {whole}"
    elif h.segment is None and h.nbytes:
        problem = f"{h.nbytes} bytes in no segment"
    elif h.segment is not None and (h.offset < 0 or h.offset + h.nbytes > size):
        problem = (
            f"bytes {h.offset}-{h.offset + h.nbytes} are outside the segment's {size} bytes as this rank mapped it "
            "(its file cut short or replaced, or a handle the daemon got wrong)"
        )
    if problem is not None:
        raise DaemonError(f"shared-memory segment {h.segment}: tensor {h.name!r}: {problem}; nothing of it was read", key=h.name)


def _nbytes(spec: DType, shape: tuple[int, ...]) -> int | None:
    """Bytes of a tensor of dtype ``spec`` and ``shape``; None where they are no whole number."""
    try:
        return spec.nbytes(math.prod(shape))
    except ValueError:
        return None


def cut_short(batch: list[Handle], i: int) -> DaemonError:
    """The error of ``batch[i]``, whose segment was cut short while this rank read it (SIGBUS)."""
    h = batch[i]
    return DaemonError(
        f"shared-memory segment {h.segment}: tensor {h.name!r} (bytes {h.offset}-{h.offset + h.nbytes}) was cut short "
        "while this rank read it: the segment file was truncated or replaced",
        key=h.name,
    )


def by_batch(handles: Iterable[Handle]) -> Iterator[list[Handle]]:
    """``handles`` in runs of one batch each (a reply holds whole batches, in order)."""
    group: list[Handle] = []
    for h in handles:
        if group and h.batch != group[-1].batch:
            yield group
            group = []
        group.append(h)
    if group:
        yield group
