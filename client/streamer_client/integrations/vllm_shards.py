"""Which part of each checkpoint tensor a vLLM rank keeps, learned from vLLM's own weight loaders.

Under tensor parallelism vLLM hands ``model.load_weights`` full tensors, and each parallel layer's
``weight_loader`` narrows them to the rank's shard as it copies them into its parameter. To ask
storage for that shard alone, the loader must know it before it streams. It learns it from a dry
run: ``model.load_weights`` over stand-ins of the checkpoint's tensors (meta tensors: a dtype and a
shape, no data) under a torch function mode that follows each stand-in through ``narrow``, basic
slicing and the size-1 dims ``FusedMoE`` adds and takes away, and turns every write into the model's
parameters and buffers into a record (:class:`Landing`) instead: nothing is written to the model. Each checkpoint tensor is then (:class:`Use`)

- ``replicated``: the rank uses it whole;
- ``sliced``: the rank uses pieces ``(dim, start, stop)`` of it, along one dim, in torch dimensions.
  One narrow is one piece; a tensor whose parts go to several parts of a fused parameter (a
  checkpoint-fused ``qkv_proj``) has several, ordered as they land in the parameter, adjacent
  ones merged;
- ``skipped``: vLLM writes nothing of it on this rank (experts of other expert-parallel ranks,
  tensors the model ignores);
- ``unmapped``: anything else (another op on it before the copy: an index, a view of a part, a
  transpose, a chunk; an exception in the dry run; a stand-in the model kept): streamed whole.

**Handing vLLM pre-sliced tensors.** A parameter that receives a sliced tensor must not narrow it
again. In vLLM 0.32.0 the loaders that narrow are of three kinds (:func:`handoff_for`):

- a ``BasevLLMParameter`` (the weights of the linear layers, loaded by ``weight_loader_v2``)
  narrows at ``param.tp_rank`` times its shard size (``load_column_parallel_weight``,
  ``load_merged_column_weight``, ``load_qkv_weight``, ``load_row_parallel_weight``); with
  ``tp_rank`` 0 while the rank loads, that narrow takes the whole pre-sliced tensor, as it does for
  vLLM's own replicated (``disable_tp``) layers;
- a plain ``Parameter`` loaded by a linear layer's ``weight_loader`` (biases) skips its narrow
  where the parameter has ``is_sharded_weight`` set, the flag of vLLM's sharded-checkpoint loaders;
- the weight of a ``VocabParallelEmbedding`` / ``ParallelLMHead`` has no such flag: while the rank
  loads it gets a loader that does what vLLM's does after its narrow (the shard's rows into the top
  of the parameter, the padding rows below them zeroed). The last rank's shard of a padded
  vocabulary is clipped to the checkpoint's rows by vLLM itself, so its piece is too.

Nothing is trusted on its kind alone: a second dry run, with stand-ins cut as storage will cut them
and the parameters marked, must write exactly the same parts of the same tensors into every
parameter as the first. A parameter that does not, that has no way to take a pre-sliced tensor, or
that also loads a tensor requested whole as a fallback, gets every one of its tensors whole, and so
does every other parameter those tensors feed; vLLM then narrows them as usual. The marks are taken off
again once the rank has loaded (:meth:`ShardPlan.loading`), so a later ``load_weights`` with full
tensors (a weight update) narrows as vLLM always does.

The dry run itself (:func:`record`) needs no vLLM: it takes any ``load_weights`` callable and the
tensors it may write.
"""

from __future__ import annotations

import contextlib
import enum
import math
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch.overrides import TorchFunctionMode

from ..errors import CheckpointError

__all__ = [
    "Handoff",
    "Landing",
    "Recording",
    "ShardPlan",
    "TensorSpec",
    "TensorUse",
    "Use",
    "check",
    "handoff_for",
    "plan_from",
    "plan_shards",
    "record",
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


# --- the dry run --------------------------------------------------------------------------------


def record(
    load_weights: Callable[[Iterable[tuple[str, torch.Tensor]]], Any],
    targets: Mapping[str, torch.Tensor],
    tensors: Mapping[str, TensorSpec],
    *,
    given: Mapping[str, Sequence[Piece]] | None = None,
) -> Recording:
    """Run ``load_weights`` over stand-ins of ``tensors`` (in their order) and record what it
    writes into ``targets`` (name: tensor; the model's parameters and buffers), writing nothing.

    ``given`` hands those tensors as storage will cut them: their stand-ins hold only their pieces,
    concatenated along the pieces' dim, and the landings still say which part of the checkpoint
    tensor each write came from.

    Where ``load_weights`` raises, what that run wrote is forgotten and the tensors it was handed
    are tried one at a time (a ``load_weights`` may read ahead, so the last one handed over need
    not be the one that failed): each that raises alone is unmapped. The dry run then goes on with
    the tensors not handed over yet.
    """
    given = given or {}
    run = _DryRun(targets, tensors)
    names = list(tensors)
    while names:
        handed, failure = _attempt(load_weights, run, names, tensors, given)
        if failure is None:
            break
        if not handed:  # raised before it took a tensor: none of them can be followed
            for name in names:
                run.unmap(name, failure)
            break
        for name in handed:
            _, failed_alone = _attempt(load_weights, run, [name], tensors, given)
            if failed_alone is not None:
                run.unmap(name, failed_alone)
        names = names[len(handed) :]
    # Freed by reference counting once load_weights returned, unless the model holds on to them
    # (no gc.collect(): in an engine's heap it takes longer than the dry run itself).
    for ref, source in run.made:
        if ref() is not None:
            run.unmap(source, "the model kept the tensor after load_weights")
    landings: dict[str, list[Landing]] = {}
    for landing in run.landings:
        if landing.source is not None:
            landings.setdefault(landing.source, []).append(landing)
    uses = {name: _use(spec, landings.get(name, []), run.unmapped.get(name)) for name, spec in tensors.items()}
    return Recording(uses, tuple(run.landings))


class _Standin(torch.Tensor):
    """A meta tensor standing for part of checkpoint tensor ``source``: ``coords`` (None: all of
    it, reshaped). What happens to it is seen by :class:`_DryRun`, not by this class."""

    __torch_function__ = torch._C._disabled_torch_function_impl
    source: str
    coords: Coords | None

    @staticmethod
    def over(meta: torch.Tensor, source: str, coords: Coords | None, run: _DryRun) -> _Standin:
        standin = torch.Tensor._make_subclass(_Standin, meta)
        standin.source = source
        standin.coords = coords
        run.made.append((weakref.ref(standin), source))
        return standin


def _attempt(load_weights, run: _DryRun, names: list[str], tensors, given) -> tuple[list[str], str | None]:
    """One call of ``load_weights`` over stand-ins of ``names``: the names it was handed, and why it
    failed (None: it did not; where it did, nothing it wrote is kept)."""
    landings, unmapped = len(run.landings), dict(run.unmapped)
    feed = _Feed(names, tensors, given, run)
    try:
        with run:
            load_weights(feed)
        return feed.handed, None
    except Exception as exc:  # noqa: BLE001 (any failure of the dry run means: stream the tensor whole)
        del run.landings[landings:]
        run.unmapped = unmapped
        said = str(exc).strip().splitlines()
        reason = f"the dry run of load_weights raised {type(exc).__name__}" + (f": {said[0]}" if said else "")
        return feed.handed, reason
    finally:
        feed.close()


class _Feed:
    """The ``(name, stand-in)`` pairs one call of ``load_weights`` is handed, and how far it got."""

    def __init__(self, names: list[str], tensors: Mapping[str, TensorSpec], given: Mapping[str, Sequence[Piece]], run: _DryRun):
        self.handed: list[str] = []
        self._items = self._make(names, tensors, given, run)

    def _make(self, names, tensors, given, run) -> Iterator[tuple[str, torch.Tensor]]:
        for name in names:
            spec = tensors[name]
            coords = tuple(((0, size),) for size in spec.shape)
            shape = list(spec.shape)
            pieces = given.get(name)
            if pieces:
                dim = pieces[0][0]
                coords = coords[:dim] + (_merged(tuple((start, stop) for _, start, stop in pieces)),) + coords[dim + 1 :]
                shape[dim] = sum(stop - start for _, start, stop in pieces)
            meta = torch.empty(shape, dtype=spec.dtype, device="meta")
            self.handed.append(name)
            yield name, _Standin.over(meta, name, coords, run)

    def __iter__(self):
        return self

    def __next__(self):
        return next(self._items)

    def close(self) -> None:
        self._items.close()


# Ops that keep every element where it is (and may change its dtype or device): the stand-in
# they return holds the same part of the checkpoint tensor.
_SAME_ELEMENTS = frozenset(
    {"detach", "detach_", "contiguous", "clone", "to", "cpu", "cuda", "float", "half", "bfloat16", "double", "alias", "data"}
)
# Ops that keep the elements but not their places: fine on a whole tensor (a scale read as shape [1]).
_RESHAPES = frozenset({"view", "reshape", "view_as", "reshape_as", "flatten", "squeeze", "unsqueeze"})
# Ops that add or take away dims of size 1: followed where the dims taken away are ones added
# (vLLM's FusedMoE loads one expert as ``loaded_weight.unsqueeze(0).unbind()``).
_UNIT_DIMS = frozenset({"unsqueeze", "squeeze", "unbind"})
# In-place methods that write nothing a later load could see.
_NOT_WRITES = frozenset({"requires_grad_", "share_memory_", "detach_"})


class _DryRun(TorchFunctionMode):
    """Follows stand-ins through ``narrow`` and basic slicing; records writes into targets instead of
    making them; names a checkpoint tensor unmapped when anything else is done with it."""

    def __init__(self, targets: Mapping[str, torch.Tensor], tensors: Mapping[str, TensorSpec]):
        super().__init__()
        self.tensors = tensors
        self.targets: dict[int, tuple[str, torch.Tensor]] = {}
        for name, tensor in targets.items():
            self.targets.setdefault(_storage_key(tensor), (name, tensor))
        self.landings: list[Landing] = []
        self.unmapped: dict[str, str] = {}
        self.made: list[tuple[weakref.ref, str]] = []

    def unmap(self, source: str, reason: str) -> None:
        self.unmapped.setdefault(source, reason)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        op = _op_name(func)
        written = _written(op, args, kwargs)
        if written is not None:
            return self._write(func, op, written, args, kwargs)
        standins = [a for a in _flat(args, kwargs) if isinstance(a, _Standin)]
        if not standins:
            return func(*args, **kwargs)
        this = args[0] if args and isinstance(args[0], _Standin) else None
        if this is not None and len(standins) == 1:
            if op in _SAME_ELEMENTS:
                return _Standin.over(_meta_like(this, args, kwargs, op), this.source, this.coords, self)
            if op == "narrow":
                return self._narrow(this, *_narrow_args(args, kwargs))
            if op == "__getitem__":
                cuts = _basic_index(args[1], this.dim(), this.shape)
                if cuts is not None:
                    out = this
                    for dim, start, stop in cuts:
                        out = self._narrow(out, dim, start, stop - start)
                    return out
            if op in _UNIT_DIMS and this.coords is not None:
                coords = _unit_dims(op, this, args, kwargs)
                if coords is not None:
                    out = func(*args, **kwargs)
                    return _tree_map(out, lambda t: _Standin.over(t, this.source, coords, self))
            if op in _RESHAPES and (this.coords is None or this.coords == _whole(self.tensors[this.source].shape)):
                return _Standin.over(func(*args, **kwargs), this.source, None, self)
        out = func(*args, **kwargs)
        if not _has_tensor(out):
            return out  # a question about the tensor (shape, dtype, dim): answered by the meta tensor
        for standin in standins:
            self.unmap(standin.source, f"{op} on it")
        return _tree_map(out, lambda t: _Standin.over(t, standins[0].source, None, self))

    def _narrow(self, this: _Standin, dim: int, start: int, length: int) -> _Standin:
        dim = dim % this.dim()
        if start < 0:
            start += this.shape[dim]
        out = torch.Tensor.narrow(this, dim, start, length)  # raises where vLLM's would
        if this.coords is None or (this.coords[dim] is None and (start, length) != (0, 1)):
            self.unmap(this.source, "narrow of a reshaped tensor")
            return _Standin.over(out, this.source, None, self)
        if this.coords[dim] is None:
            return _Standin.over(out, this.source, this.coords, self)
        coords = this.coords[:dim] + (_cut(this.coords[dim], start, start + length),) + this.coords[dim + 1 :]
        return _Standin.over(out, this.source, coords, self)

    def _write(self, func, op, written: torch.Tensor, args, kwargs):
        standins = [a for a in _flat(args[1:], kwargs) if isinstance(a, _Standin)]
        if isinstance(written, _Standin):
            self.unmap(written.source, f"{op} into it")
            return written
        found = self.targets.get(_storage_key(written))
        if found is None:
            if not standins:
                return func(*args, **kwargs)
            for standin in standins:
                self.unmap(standin.source, f"{op} into a tensor that is none of the model's parameters or buffers")
            return args[0]
        target, tensor = found
        view = written
        if op == "__setitem__":
            view = written[args[1]]
        elif op == "__set__":  # param.data = ...
            view = None
        region = None if view is None else _region(view, tensor)
        source = standins[0] if standins else None
        coords = None if source is None or source.coords is None else tuple(c for c in source.coords if c is not None)
        copies = op in ("copy_", "__setitem__") and len(standins) == 1
        if source is not None and not copies:
            for standin in standins:
                self.unmap(standin.source, f"{op} into {target}")
        elif source is not None and region is None:
            self.unmap(source.source, f"written to a part of {target} that is not a box of it")
        extra = (
            "" if source is not None else repr([a for a in args[1:] if not isinstance(a, torch.Tensor)] + sorted(kwargs.items()))
        )
        self.landings.append(Landing(target, region, op, None if source is None else source.source, coords, extra))
        return args[0]


def _storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


def _op_name(func) -> str:
    name = getattr(func, "__name__", repr(func))
    if name in ("__get__", "__set__"):  # a property: Tensor.data.__get__ and the like
        owner = getattr(func, "__self__", None)
        prop = getattr(owner, "__name__", "")
        return prop if name == "__get__" and prop else name
    return name


def _written(op: str, args, kwargs) -> torch.Tensor | None:
    """The tensor ``op`` writes into, or None."""
    out = kwargs.get("out")
    if isinstance(out, torch.Tensor):
        return out
    if not args or not isinstance(args[0], torch.Tensor):
        return None
    if op in ("__setitem__", "__set__"):
        return args[0]
    if op.endswith("_") and not op.startswith("_") and op not in _NOT_WRITES:
        return args[0]
    return None


def _flat(args, kwargs) -> Iterator[Any]:
    for value in (*args, *kwargs.values()):
        if isinstance(value, (list, tuple)):
            yield from value
        else:
            yield value


def _has_tensor(value) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    return isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value)


def _tree_map(value, fn):
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_tree_map(v, fn) for v in value)
    return value


_DTYPE_METHODS = {"float": torch.float32, "half": torch.float16, "bfloat16": torch.bfloat16, "double": torch.float64}


def _meta_like(this: _Standin, args, kwargs, op: str) -> torch.Tensor:
    """The meta tensor an op that keeps every element returns: ``this``'s shape, maybe another dtype."""
    dtype = _DTYPE_METHODS.get(op, this.dtype)
    if op == "to":
        for value in (*args[1:], *kwargs.values()):
            if isinstance(value, torch.dtype):
                dtype = value
            elif isinstance(value, torch.Tensor):
                dtype = value.dtype
    return torch.empty(this.shape, dtype=dtype, device="meta")


def _unit_dims(op: str, this: _Standin, args, kwargs) -> Coords | None:
    """The coords of what ``op`` (``_UNIT_DIMS``) returns from ``this``, or None where it takes away
    a dim of the checkpoint tensor or splits one."""
    given = args[1] if len(args) > 1 else kwargs.get("dim")
    if op == "unsqueeze":
        dim = int(given) % (this.dim() + 1)
        return this.coords[:dim] + (None,) + this.coords[dim:]
    if op == "unbind":
        dims = [int(0 if given is None else given) % this.dim()]
    elif given is None:  # squeeze(): every dim of size 1
        dims = [d for d in range(this.dim()) if this.shape[d] == 1]
    else:
        dims = [int(d) % this.dim() for d in (given if isinstance(given, (tuple, list)) else [given])]
        dims = [d for d in dims if this.shape[d] == 1]
    if any(this.coords[d] is not None or this.shape[d] != 1 for d in dims):
        return None
    return tuple(c for d, c in enumerate(this.coords) if d not in dims)


def _narrow_args(args, kwargs) -> tuple[int, int, int]:
    values = list(args[1:]) + [kwargs[k] for k in ("dim", "start", "length") if k in kwargs]
    dim, start, length = (int(v) for v in values)
    return dim, start, length


def _basic_index(index, ndim: int, shape) -> list[tuple[int, int, int]] | None:
    """``(dim, start, stop)`` cuts equal to ``tensor[index]``, or None where the index is not a
    slice of each dim with step 1 (an int drops a dim, None adds one, a tensor gathers)."""
    items = list(index) if isinstance(index, tuple) else [index]
    if items.count(Ellipsis) > 1:
        return None
    if Ellipsis in items:
        at = items.index(Ellipsis)
        items[at : at + 1] = [slice(None)] * (ndim - len(items) + 1)
    if len(items) > ndim or not all(isinstance(item, slice) for item in items):
        return None
    cuts = []
    for dim, item in enumerate(items):
        start, stop, step = item.indices(shape[dim])
        if step != 1:
            return None
        stop = max(start, stop)
        if (start, stop) != (0, shape[dim]):
            cuts.append((dim, start, stop))
    return cuts


def _whole(shape) -> Coords:
    return tuple(((0, size),) for size in shape)


def _cut(segments: tuple[tuple[int, int], ...], start: int, stop: int) -> tuple[tuple[int, int], ...]:
    """The part ``[start, stop)`` of the concatenation of ``segments``, as segments of the source."""
    out = []
    at = 0
    for first, last in segments:
        size = last - first
        lo, hi = max(start, at), min(stop, at + size)
        if lo < hi:
            out.append((first + lo - at, first + hi - at))
        at += size
    return _merged(tuple(out))


def _merged(segments: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
    out: list[tuple[int, int]] = []
    for first, last in segments:
        if out and out[-1][1] == first:
            out[-1] = (out[-1][0], last)
        else:
            out.append((first, last))
    return tuple(out)


def _region(view: torch.Tensor, base: torch.Tensor) -> Box | None:
    """The box of ``base`` that ``view`` (a tensor over its storage) is, or None. A view may have
    fewer dims than ``base`` (``param.data[expert]``): a dim it lacks is one row of the box."""
    if view.dim() > base.dim():
        return None
    offset = view.storage_offset() - base.storage_offset()
    if offset < 0:
        return None
    starts = [0] * base.dim()
    for dim in sorted(range(base.dim()), key=lambda d: -base.stride(d)):
        if base.stride(dim) > 0 and base.size(dim) > 1:
            starts[dim], offset = divmod(offset, base.stride(dim))
    if offset != 0:
        return None
    sizes = [1] * base.dim()
    dim = 0
    for v in range(view.dim()):
        while dim < base.dim() and view.size(v) > 1 and view.stride(v) != base.stride(dim):
            dim += 1
        if dim == base.dim():
            return None
        sizes[dim] = view.size(v)
        dim += 1
    box = tuple((start, start + size) for start, size in zip(starts, sizes))
    if any(stop > base.size(d) for d, (_, stop) in enumerate(box)):
        return None
    return box


def _use(spec: TensorSpec, landings: list[Landing], unmapped: str | None) -> TensorUse:
    """One tensor's use, from its landings in the dry run (and why it is unmapped, if it is)."""
    targets = tuple(dict.fromkeys(landing.target for landing in landings))
    if unmapped is not None:
        return TensorUse(Use.UNMAPPED, targets=targets, reason=unmapped)
    if not landings:
        return TensorUse(Use.SKIPPED)
    whole = _whole(spec.shape)
    parts = [landing for landing in landings if landing.coords is not None and landing.coords != whole]
    if len(parts) < len(landings):  # written whole somewhere: streamed whole
        return TensorUse(Use.REPLICATED, targets=targets)
    dims = {dim for landing in parts for dim, segments in enumerate(landing.coords) if segments != whole[dim]}
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
    merged = _merged(tuple(pieces))
    if merged == whole[dim]:
        return TensorUse(Use.REPLICATED, targets=targets)
    return TensorUse(Use.SLICED, tuple((dim, start, stop) for start, stop in merged), targets)


# --- the plan -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Handoff:
    """How one parameter takes a pre-sliced tensor: ``attr`` set to ``value`` while the rank loads."""

    how: str
    attr: str
    value: Any

    @contextlib.contextmanager
    def applied(self, param: torch.Tensor) -> Iterator[None]:
        had = self.attr in vars(param)
        before = vars(param).get(self.attr)
        setattr(param, self.attr, self.value)
        try:
            yield
        finally:
            if had:
                setattr(param, self.attr, before)
            else:
                delattr(param, self.attr)


@dataclass(frozen=True)
class ShardPlan:
    """One rank's request: which tensors, which of them in pieces, and which parameters take them so."""

    tensors: Mapping[str, TensorSpec]
    uses: Mapping[str, TensorUse]  # the first dry run's
    slices: dict[str, tuple[Piece, ...]]  # requested in pieces
    whole: dict[str, str] = field(default_factory=dict)  # requested whole: why ("" where used whole)
    marked: dict[str, Handoff] = field(default_factory=dict)  # parameter: how it takes its pieces

    @property
    def select(self) -> list[str]:
        """The names to request, in checkpoint order (the skipped ones are not)."""
        return [name for name in self.tensors if name in self.slices or name in self.whole]

    def slices_argument(self) -> dict[str, Piece | list[Piece]]:
        """``slices=`` for :func:`streamer_client.stream`: one piece as a tuple, several as a list."""
        return {name: pieces[0] if len(pieces) == 1 else list(pieces) for name, pieces in self.slices.items()}

    @property
    def fallbacks(self) -> dict[str, str]:
        """Tensors requested whole though the rank keeps less of them (or did not say what): why."""
        return {name: why for name, why in self.whole.items() if why}

    def requested_bytes(self) -> int:
        return sum(self.tensors[name].nbytes(self.slices.get(name, ())) for name in self.select)

    @contextlib.contextmanager
    def loading(self, model: torch.nn.Module) -> Iterator[None]:
        """The marked parameters take pre-sliced tensors inside this block, and narrow as before after it."""
        params = dict(model.named_parameters())
        with contextlib.ExitStack() as stack:
            for name, handoff in self.marked.items():
                stack.enter_context(handoff.applied(params[name]))
            yield

    def summary(self) -> str:
        counts = {use: 0 for use in Use}
        for use in self.uses.values():
            counts[use.use] += 1
        fallbacks = self.fallbacks
        text = (
            f"{len(self.slices)} tensors in pieces, {len(self.whole) - len(fallbacks)} whole, "
            f"{counts[Use.SKIPPED]} not loaded on this rank, {len(fallbacks)} whole as a fallback; "
            f"{self.requested_bytes()} of {sum(spec.nbytes() for spec in self.tensors.values())} bytes"
        )
        if fallbacks:
            text += "; whole: " + "; ".join(f"{name} ({why})" for name, why in fallbacks.items())
        return text


def plan_from(
    first: Recording,
    tensors: Mapping[str, TensorSpec],
    handoffs: Mapping[str, Handoff],
    failed: Mapping[str, str] | None = None,
) -> ShardPlan:
    """The plan a first dry run allows: a tensor goes in pieces only where every parameter it
    feeds can take pieces (``handoffs``), did not fail the check (``failed``: parameter: why) and
    loads no tensor that goes whole."""
    failed = failed or {}
    sources: dict[str, list[str]] = {}
    for landing in first.landings:
        if landing.source is not None and landing.source not in sources.setdefault(landing.target, []):
            sources[landing.target].append(landing.source)
    whole = {
        name: (use.reason if use.use is Use.UNMAPPED else "")
        for name, use in first.uses.items()
        if use.use in (Use.REPLICATED, Use.UNMAPPED)
    }
    sliced = {name for name, use in first.uses.items() if use.use is Use.SLICED}
    changed = True
    while changed:
        changed = False
        for target, names in sources.items():
            cut = [name for name in names if name in sliced]
            if not cut:
                continue
            why = None
            if target not in handoffs:
                why = f"{target} has no way to take a pre-sliced tensor"
            elif target in failed:
                why = failed[target]
            else:
                loose = next((name for name in names if whole.get(name)), None)
                if loose is not None:
                    why = f"{target} also loads {loose}, which goes whole"
            if why is not None:
                for name in cut:
                    sliced.discard(name)
                    whole[name] = why
                changed = True
    marked = {target: handoffs[target] for target, names in sources.items() if any(name in sliced for name in names)}
    return ShardPlan(
        tensors=dict(tensors),
        uses=first.uses,
        slices={name: first.uses[name].pieces for name in tensors if name in sliced},
        whole={name: whole[name] for name in tensors if name in whole},
        marked=marked,
    )


def check(first: Recording, second: Recording, plan: ShardPlan) -> dict[str, str]:
    """The parameters a second dry run (the plan's request, the plan's marks) wrote otherwise than
    the first: parameter: why."""
    failed = {}
    for name, use in second.uses.items():
        if use.use is Use.UNMAPPED and first.uses[name].use is not Use.UNMAPPED:
            how = "in pieces" if name in plan.slices else "whole"
            for target in first.uses[name].targets:
                failed.setdefault(target, f"{target}: {use.reason} (for {name}, {how})")
    a, b = first.by_target(), second.by_target()
    for target in a.keys() | b.keys():
        if a.get(target, []) != b.get(target, []):
            failed.setdefault(target, f"{target} took its pieces otherwise than the full load takes its shard")
    return failed


def plan_shards(
    model: torch.nn.Module,
    tensors: Mapping[str, TensorSpec],
    *,
    handoff: Callable[[torch.nn.Parameter], Handoff | None] | None = None,
    rounds: int = 4,
) -> ShardPlan:
    """This rank's plan for ``model`` (built, with its parallel layout) and the checkpoint's
    ``tensors`` (name: spec, in checkpoint order): two or more dry runs of ``model.load_weights``.

    ``handoff(param)`` says how a parameter takes pre-sliced tensors (default: :func:`handoff_for`,
    vLLM's layers). The plan returned is one whose last dry run wrote every parameter exactly as the
    first did; where no such plan is found in ``rounds``, every tensor the rank loads goes whole.
    """
    handoff = handoff or handoff_for
    params = dict(model.named_parameters())
    targets = {**params, **dict(model.named_buffers())}
    first = record(model.load_weights, targets, tensors)
    handoffs = {}
    for name in first.by_target():
        found = handoff(params[name]) if name in params else None
        if found is not None:
            handoffs[name] = found
    failed: dict[str, str] = {}
    for _ in range(rounds):
        plan = plan_from(first, tensors, handoffs, failed)
        if not plan.marked:
            return plan
        requested = {name: tensors[name] for name in plan.select}
        with plan.loading(model):
            second = record(model.load_weights, targets, requested, given=plan.slices)
        more = check(first, second, plan)
        if not more:
            return plan
        if not set(more) - set(plan.marked):
            failed.update(more)
            continue
        break  # a parameter nobody marked changed: the plan's request itself is not what vLLM loads
    why = "no plan whose check wrote every parameter as vLLM's own loader does"
    return ShardPlan(
        tensors=dict(tensors),
        uses=first.uses,
        slices={},
        whole={
            name: (why if use.use is Use.SLICED else use.reason) for name, use in first.uses.items() if use.use is not Use.SKIPPED
        },
    )


# --- vLLM's layers ------------------------------------------------------------------------------


def handoff_for(param: torch.nn.Parameter) -> Handoff | None:
    """How ``param`` of a vLLM 0.32.0 model takes a pre-sliced tensor, or None (see the module's
    docstring); checked by a dry run before it is used."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
    from vllm.model_executor.parameter import BasevLLMParameter

    if isinstance(param, BasevLLMParameter):
        return Handoff("tp_rank 0 while loading", "tp_rank", 0)
    loader = getattr(param, "weight_loader", None)
    layer = getattr(loader, "__self__", None)
    if isinstance(layer, LinearBase) and getattr(loader, "__name__", "") == "weight_loader":
        return Handoff("is_sharded_weight", "is_sharded_weight", True)
    if (
        isinstance(layer, VocabParallelEmbedding)
        and getattr(param, "output_dim", None) == 0
        and getattr(param, "packed_dim", None) is None
    ):
        return Handoff("vocabulary rows loader", "weight_loader", _vocab_rows_loader(layer))
    return None


def _vocab_rows_loader(layer) -> Callable[[torch.nn.Parameter, torch.Tensor], None]:
    """What ``VocabParallelEmbedding.weight_loader`` does with the rows it narrowed to: copied into
    the top of the parameter, the padding rows below them zeroed."""

    def load_vocab_rows(param: torch.nn.Parameter, loaded_weight: torch.Tensor) -> None:
        indices = layer.shard_indices
        rows = indices.org_vocab_end_index - indices.org_vocab_start_index
        if loaded_weight.shape[0] != rows:
            raise CheckpointError(
                f"{layer.__class__.__name__} {getattr(layer, 'prefix', '') or ''}: a pre-sliced vocabulary shard of "
                f"{loaded_weight.shape[0]} rows where this rank keeps {rows} (rows {indices.org_vocab_start_index} to "
                f"{indices.org_vocab_end_index} of the checkpoint)"
            )
        param[: loaded_weight.shape[0]].data.copy_(loaded_weight)
        param[loaded_weight.shape[0] :].data.fill_(0)

    return load_vocab_rows
