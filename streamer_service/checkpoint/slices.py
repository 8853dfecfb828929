"""A load's slices over the checkpoint's tensors: what is read of a sliced tensor, and what is
left to cut once it is read (:mod:`streamer_client._slicing` defines slices and cuts)."""

from __future__ import annotations

from collections.abc import Sequence

from streamer_client._slicing import Cut

from .header import TensorInfo

__all__ = ["sliced"]


def sliced(tensors: Sequence[TensorInfo], cuts: dict[str, Cut]) -> tuple[list[TensorInfo], dict[str, Cut]]:
    """``tensors`` with each one ``cuts`` names narrowed to the rows of dimension 0 that hold its
    slice (:meth:`Cut.span`: only those bytes are read), and the cut of each narrowed tensor that
    still needs one (a slice of a later dimension, or a fused slice's pieces)."""
    narrowed: list[TensorInfo] = []
    within: dict[str, Cut] = {}
    for t in tensors:
        c = cuts.get(t.name)
        if c is None:
            narrowed.append(t)
            continue
        first, _ = c.span()
        inner = c.within(first)
        row = t.nbytes // c.dims[0] if c.dims[0] else 0
        narrowed.append(t._replace(shape=inner.header_dims, offset=t.offset + first * row, nbytes=inner.dims[0] * row))
        if not inner.whole:
            within[t.name] = inner
    return narrowed, within
