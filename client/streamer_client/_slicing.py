"""Slices: the part of a tensor a rank keeps, asked for by the load so that only its bytes move.

A slice is ``(dim, start, stop)`` in the coordinates of the torch tensor the load would yield
(``narrow(dim, start, stop - start)``; for a packed dtype such as ``F4`` its torch elements, two
values each). A list of slices along one dimension is a fused layout: the rank's tensor is the
pieces concatenated along that dimension, in the order given (``torch.cat``). Pieces may repeat or
overlap (replicated heads).

A :class:`Cut` is a slice resolved against a tensor's dtype and shape: the shape it yields, the
byte ranges of the tensor it is made of, in order (:meth:`Cut.runs`), and the smallest run of
whole rows of dimension 0 that holds them (:meth:`Cut.span`), which is what a load reads when it
reads less than the whole tensor. A slice of dimension 0 is one run of bytes; a slice of a later
dimension is one run per index of the dimensions before it, gathered where the bytes are copied
anyway.

One check for both modes: a daemon checks a rank's slices when the rank joins, an in-process load
when it plans, each against the checkpoint's tensors and before any byte is read.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple, Protocol

from ._dtypes import DTYPES
from .errors import ConfigError, SelectionError

if TYPE_CHECKING:
    import numpy as np
    import torch

__all__ = ["Cut", "Slice", "Slices", "cut", "cuts", "kept_bytes", "parse", "take", "to_wire"]

Slice = tuple[int, int, int]
"""``(dim, start, stop)``: what a caller writes for one piece."""

Slices = dict[str, tuple[int, tuple[tuple[int, int], ...]]]
"""Parsed slices: a tensor name to its dimension and its ``(start, stop)`` pieces, in order."""


class _Tensor(Protocol):
    name: str
    dtype: str
    shape: Sequence[int]
    nbytes: int


class Cut(NamedTuple):
    """A slice of one tensor: its dimension and pieces along the tensor's torch ``dims``."""

    dim: int
    pieces: tuple[tuple[int, int], ...]
    dims: tuple[int, ...]  # the whole tensor's torch shape
    itemsize: int  # bytes per torch element
    packed: int = 1  # header values per torch element along the last dimension

    @property
    def shape(self) -> tuple[int, ...]:
        """The torch shape of what the rank receives."""
        return (*self.dims[: self.dim], sum(b - a for a, b in self.pieces), *self.dims[self.dim + 1 :])

    @property
    def header_shape(self) -> tuple[int, ...]:
        """:attr:`shape` counted as a safetensors header counts it (a packed dtype's last dimension in values)."""
        return self._in_values(self.shape)

    @property
    def header_dims(self) -> tuple[int, ...]:
        """:attr:`dims` (the whole tensor's) counted as a safetensors header counts them."""
        return self._in_values(self.dims)

    def _in_values(self, dims: tuple[int, ...]) -> tuple[int, ...]:
        return (*dims[:-1], dims[-1] * self.packed) if self.packed > 1 else dims

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    @property
    def whole(self) -> bool:
        """The slice is the whole tensor."""
        return self.pieces == ((0, self.dims[self.dim]),)

    def _inner(self) -> int:
        """Bytes of one index of :attr:`dim` (the dimensions after it)."""
        return math.prod(self.dims[self.dim + 1 :]) * self.itemsize

    def runs(self) -> tuple[np.ndarray, np.ndarray]:
        """The runs of the tensor's bytes the slice is made of, in the order of its bytes, as
        ``(offsets, sizes)`` (int64 arrays; runs that follow each other merged): one per piece and
        index of the dimensions before :attr:`dim`, so arrays, not lists, for a slice of a later
        dimension of a large tensor."""
        import numpy as np

        inner = self._inner()
        kept = [(a * inner, (b - a) * inner) for a, b in self.pieces if b > a]
        if not kept:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        starts, sizes = (np.array(v, dtype=np.int64) for v in zip(*kept))
        outer = np.arange(math.prod(self.dims[: self.dim]), dtype=np.int64) * (self.dims[self.dim] * inner)
        offsets = (outer[:, None] + starts[None, :]).ravel()
        sizes = np.broadcast_to(sizes, (len(outer), len(sizes))).ravel()
        first = np.concatenate(([0], np.flatnonzero(offsets[1:] != offsets[:-1] + sizes[:-1]) + 1))
        return offsets[first], np.add.reduceat(sizes, first)

    def span(self) -> tuple[int, int]:
        """``(first, stop)``: the rows of dimension 0 that hold every byte of the slice (all of them
        for a slice of a later dimension)."""
        if self.dim:
            return 0, self.dims[0]
        return min(a for a, _ in self.pieces), max(b for _, b in self.pieces)

    def within(self, first: int) -> Cut:
        """This cut of a tensor that holds only rows ``first``.. of dimension 0 (:meth:`span`)."""
        stop = self.span()[1]
        dims = (stop - first, *self.dims[1:])
        pieces = tuple((a - first, b - first) for a, b in self.pieces) if self.dim == 0 else self.pieces
        return self._replace(dims=dims, pieces=pieces)


def parse(slices: Mapping[str, object] | None) -> Slices | None:
    """``slices`` as :func:`streamer_client.stream` takes them, checked for form (``ConfigError``
    naming the tensor); bounds are checked against the checkpoint by :func:`cuts`."""
    if slices is None:
        return None
    if not isinstance(slices, Mapping):
        raise ConfigError(f"slices must map tensor names to (dim, start, stop) or a list of them, got {type(slices).__name__}")
    parsed: Slices = {}
    for name, spec in slices.items():
        if not isinstance(name, str) or not name:
            raise ConfigError(f"slices: a tensor name must be a non-empty string, got {name!r}")
        pieces = [spec] if _is_piece(spec) else spec
        if not isinstance(pieces, (list, tuple)) or not pieces or not all(isinstance(p, (list, tuple)) for p in pieces):
            raise ConfigError(f"slices[{name!r}]: expected (dim, start, stop) or a non-empty list of them, got {spec!r}")
        dims = set()
        checked = []
        for piece in pieces:
            if not _is_piece(piece):
                raise ConfigError(f"slices[{name!r}]: {piece!r} is not (dim, start, stop) of integers")
            dim, start, stop = (int(v) for v in piece)
            dims.add(dim)
            checked.append((start, stop))
        if len(dims) > 1:
            raise ConfigError(f"slices[{name!r}]: the pieces of one tensor run along one dimension, got dims {sorted(dims)}")
        parsed[name] = (dims.pop(), tuple(checked))
    return parsed


def _is_piece(value: object) -> bool:
    return (
        isinstance(value, (tuple, list))
        and len(value) == 3
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    )


def to_wire(slices: Slices) -> dict[str, list[list[int]]]:
    """Parsed slices as a join request carries them."""
    return {name: [[dim, a, b] for a, b in pieces] for name, (dim, pieces) in slices.items()}


def cut(tensor: _Tensor, dim: int, pieces: Sequence[tuple[int, int]], *, uri: str | None = None) -> Cut:
    """The cut of ``tensor`` (a safetensors dtype and header shape) by ``pieces`` along ``dim``;
    ``SelectionError`` naming the tensor where a bound is outside it."""
    spec = DTYPES.get(tensor.dtype)
    shape = tuple(int(d) for d in tensor.shape)
    if spec is None or spec.torch_name is None or (spec.packed > 1 and (not shape or shape[-1] % spec.packed)):
        raise SelectionError(
            f"tensor {tensor.name!r}: a {tensor.dtype} tensor of shape {list(shape)} cannot be sliced", uri=uri, key=tensor.name
        )
    dims = (*shape[:-1], shape[-1] // spec.packed) if spec.packed > 1 else shape
    where = f"tensor {tensor.name!r} (torch shape {list(dims)})"
    if not 0 <= dim < len(dims):
        raise SelectionError(f"{where}: slice dim {dim} is outside its {len(dims)} dimensions", uri=uri, key=tensor.name)
    for a, b in pieces:
        if not 0 <= a <= b <= dims[dim]:
            raise SelectionError(f"{where}: slice [{a}, {b}) of dim {dim} is outside [0, {dims[dim]}]", uri=uri, key=tensor.name)
    return Cut(dim, tuple(pieces), dims, spec.bits * spec.packed // 8, spec.packed)


def cuts(tensors: Sequence[_Tensor], slices: Slices | None, *, uri: str | None = None) -> dict[str, Cut]:
    """The cuts of ``tensors`` (a load's selection) by ``slices``; ``SelectionError`` naming a
    sliced tensor the selection does not hold, or a bound outside its tensor. A slice that is
    the whole tensor is left out: that tensor is loaded as it is."""
    if not slices:
        return {}
    by_name = {t.name: t for t in tensors}
    found: dict[str, Cut] = {}
    for name, (dim, pieces) in slices.items():
        tensor = by_name.get(name)
        if tensor is None:
            raise SelectionError(f"slices name tensor {name!r}, which this load does not select", uri=uri, key=name)
        c = cut(tensor, dim, pieces, uri=uri)
        if not c.whole:
            found[name] = c
    return found


def kept_bytes(tensors: Sequence[_Tensor], cuts: Mapping[str, Cut]) -> int:
    """The bytes a load of ``tensors`` yields where ``cuts`` cut some of them (``tensors``' own
    ``nbytes`` for the rest)."""
    return sum(cuts[t.name].nbytes if t.name in cuts else t.nbytes for t in tensors)


def take(tensor: torch.Tensor, c: Cut, *, view: bool = False) -> torch.Tensor:
    """``tensor`` (of the cut's whole shape, on any device) cut: a new tensor holding only the
    slice's bytes, or with ``view`` and one piece a view of ``tensor`` (zero-copy, strided along
    a later dimension). Cut on bytes, so a dtype torch cannot copy element-wise (``F4``) cuts too."""
    import torch

    if tuple(tensor.shape) != c.dims:
        raise ValueError(f"a tensor of shape {list(tensor.shape)} is not the {list(c.dims)} this cut was made for")
    if len(c.pieces) == 1 and view:
        a, b = c.pieces[0]
        return tensor.narrow(c.dim, a, b - a)
    if not c.nbytes:
        return torch.empty(c.shape, dtype=tensor.dtype, device=tensor.device)
    last = c.dim == len(c.dims) - 1
    raw = tensor.view(torch.uint8)  # the last dimension counts bytes
    scale = c.itemsize if last else 1
    parts = [raw.narrow(c.dim, a * scale, (b - a) * scale) for a, b in c.pieces]
    out = parts[0].clone(memory_format=torch.contiguous_format) if len(parts) == 1 else torch.cat(parts, dim=c.dim)
    return out.view(tensor.dtype)
