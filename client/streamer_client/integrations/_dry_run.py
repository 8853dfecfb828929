"""The dry run: a model's ``load_weights`` over stand-ins of the checkpoint's tensors (meta tensors:
a dtype and a shape, no data), under a torch function mode that follows each stand-in through
``narrow``, basic slicing and the size-1 dims vLLM's ``FusedMoE`` adds and takes away, and records
every write into the model's parameters and buffers (:class:`~._tensor_use.Landing`) instead of
making it: nothing is written to the model. Needs no engine: it takes any ``load_weights``
callable and the tensors it may write.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ._tensor_use import Box, Coords, Landing, Piece, Recording, TensorSpec, cut, merged, use_of, whole

__all__ = ["record"]


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
    uses = {name: use_of(spec, landings.get(name, []), run.unmapped.get(name)) for name, spec in tensors.items()}
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
                coords = coords[:dim] + (merged(tuple((start, stop) for _, start, stop in pieces)),) + coords[dim + 1 :]
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
            if op in _RESHAPES and (this.coords is None or this.coords == whole(self.tensors[this.source].shape)):
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
        coords = this.coords[:dim] + (cut(this.coords[dim], start, start + length),) + this.coords[dim + 1 :]
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
