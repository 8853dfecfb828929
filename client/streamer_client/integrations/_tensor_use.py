"""What one rank does with each checkpoint tensor, from the writes a dry run of its
``load_weights`` recorded (:mod:`._dry_run`). Pure functions over small frozen types. A tensor is
(:class:`Use`)

- ``replicated``: the rank uses it whole;
- ``sliced``: the rank uses pieces ``(dim, start, stop)`` of it, along one dim, in torch dimensions.
  One narrow is one piece; a tensor whose parts go to several parts of a fused parameter (a
  checkpoint-fused ``qkv_proj``) has several, ordered as they land in the parameter, adjacent ones
  merged;
- ``skipped``: the model writes nothing of it on this rank (experts of other expert-parallel ranks,
  tensors the model ignores);
- ``unmapped``: anything else (another op on it before the copy: an index, a view of a part, a
  transpose, a chunk; an exception in the dry run; a stand-in the model kept): streamed whole.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

__all__ = [
    "Box",
    "Coords",
    "Landing",
    "Piece",
    "Recording",
    "TensorSpec",
    "TensorUse",
    "Use",
    "cut",
    "merged",
    "use_of",
    "whole",
]

Piece = tuple[int, int, int]
"""``(dim, start, stop)`` of a checkpoint tensor, in torch dimensions."""
Box = tuple[tuple[int, int], ...]
"""``(start, stop)`` per dimension of a parameter."""
Coords = tuple[tuple[tuple[int, int], ...], ...]
"""Per dimension, the segments ``(start, stop)`` of a checkpoint tensor that a stand-in holds, in
order. A stand-in's coords may also hold None: a dim of size 1 that ``unsqueeze`` added."""


class TensorSpec(NamedTuple):
    """A checkpoint tensor as torch will hold it."""

    dtype: torch.dtype
    shape: tuple[int, ...]

    def nbytes(self, pieces: Sequence[Piece] = ()) -> int:
        """Bytes of the tensor, or of its ``pieces``."""
        if not pieces:
            return math.prod(self.shape) * self.dtype.itemsize
        rows = math.prod(self.shape) // self.shape[pieces[0][0]] if self.shape[pieces[0][0]] else 0
        return sum(stop - start for _, start, stop in pieces) * rows * self.dtype.itemsize


class Use(enum.Enum):
    REPLICATED = "replicated"
    SLICED = "sliced"
    SKIPPED = "skipped"
    UNMAPPED = "unmapped"


@dataclass(frozen=True)
class Landing:
    """One write into a model tensor during a dry run."""

    target: str  # the parameter or buffer written
    region: Box | None  # the part of it written; None: not a box of it
    op: str  # copy_, fill_, __setitem__, ...
    source: str | None = None  # the checkpoint tensor written from; None: no checkpoint tensor
    coords: Coords | None = None  # the part of ``source`` written; None: all of it, reshaped
    extra: str = ""  # the op's other arguments (a fill value)


@dataclass(frozen=True)
class TensorUse:
    """What one rank does with one checkpoint tensor."""

    use: Use
    pieces: tuple[Piece, ...] = ()  # Use.SLICED: the pieces, in the order they land
    targets: tuple[str, ...] = ()  # the parameters and buffers it is written into
    reason: str = ""  # Use.UNMAPPED: why


@dataclass(frozen=True)
class Recording:
    """A dry run: each checkpoint tensor's use, and every write in the order it was made."""

    uses: dict[str, TensorUse]
    landings: tuple[Landing, ...]

    def by_target(self) -> dict[str, list[Landing]]:
        out: dict[str, list[Landing]] = {}
        for landing in self.landings:
            out.setdefault(landing.target, []).append(landing)
        return out


def whole(shape) -> Coords:
    return tuple(((0, size),) for size in shape)


def cut(segments: tuple[tuple[int, int], ...], start: int, stop: int) -> tuple[tuple[int, int], ...]:
    """The part ``[start, stop)`` of the concatenation of ``segments``, as segments of the source."""
    out = []
    at = 0
    for first, last in segments:
        size = last - first
        lo, hi = max(start, at), min(stop, at + size)
        if lo < hi:
            out.append((first + lo - at, first + hi - at))
        at += size
    return merged(tuple(out))


def merged(segments: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
    out: list[tuple[int, int]] = []
    for first, last in segments:
        if out and out[-1][1] == first:
            out[-1] = (out[-1][0], last)
        else:
            out.append((first, last))
    return tuple(out)


def use_of(spec: TensorSpec, landings: list[Landing], unmapped: str | None) -> TensorUse:
    """One tensor's use, from its landings in the dry run (and why it is unmapped, if it is)."""
    targets = tuple(dict.fromkeys(landing.target for landing in landings))
    if unmapped is not None:
        return TensorUse(Use.UNMAPPED, targets=targets, reason=unmapped)
    if not landings:
        return TensorUse(Use.SKIPPED)
    full = whole(spec.shape)
    parts = [landing for landing in landings if landing.coords is not None and landing.coords != full]
    if len(parts) < len(landings):  # written whole somewhere: streamed whole
        return TensorUse(Use.REPLICATED, targets=targets)
    dims = {dim for landing in parts for dim, segments in enumerate(landing.coords) if segments != full[dim]}
    if len(dims) > 1:
        return TensorUse(Use.UNMAPPED, targets=targets, reason=f"parts of it cut along dims {sorted(dims)}")
    (dim,) = dims
    order = {target: i for i, target in enumerate(targets)}
    parts.sort(key=lambda landing: (order[landing.target], landing.region or ()))
    pieces: list[tuple[int, int]] = []
    for landing in parts:
        for segment in landing.coords[dim]:
            if segment not in pieces:
                pieces.append(segment)
    spans = sorted(pieces)
    if any(a[1] > b[0] for a, b in zip(spans, spans[1:])):
        return TensorUse(Use.UNMAPPED, targets=targets, reason=f"overlapping parts of it along dim {dim}")
    joined = merged(tuple(pieces))
    if joined == full[dim]:
        return TensorUse(Use.REPLICATED, targets=targets)
    return TensorUse(Use.SLICED, tuple((dim, start, stop) for start, stop in joined), targets)
