"""safetensors dtype names and their torch equivalents.

One table for the service (header validation, planning, a daemon's join) and the client (building
tensors from bytes). Every dtype the safetensors format defines is here (safetensors 0.8 writes
22). A dtype torch cannot represent has no torch name and is refused when a load is planned
(:func:`check_loadable`), before any tensor byte is read.

Packed dtypes: ``F4`` is written by safetensors from ``torch.float4_e2m1fn_x2``, which holds two
4-bit values per element: the header's shape counts values (the last dimension doubled), the
torch tensor's counts pairs. :func:`torch_layout` halves the last dimension, so a header shape
whose last dimension is odd has no torch tensor (safetensors' own loader refuses it too).
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Iterable, Sequence
from typing import TYPE_CHECKING, NamedTuple, Protocol

from .errors import CheckpointError

if TYPE_CHECKING:
    import torch

__all__ = [
    "DType",
    "DTYPES",
    "WITH_TORCH_DTYPE",
    "byte_view",
    "check_loadable",
    "tensor_over",
    "torch_dtypes",
    "torch_layout",
    "unloadable",
]


class DType(NamedTuple):
    name: str
    bits: int  # per element; sub-byte types (F4, F6) pack several per byte
    torch_name: str | None  # None: no torch dtype holds it
    packed: int = 1  # header elements per torch element, along the last dimension (F4: 2)

    def nbytes(self, numel: int) -> int:
        """Bytes of ``numel`` elements; ``ValueError`` unless they end on a byte boundary (the
        sub-byte dtypes pack several elements per byte, and a tensor owns whole bytes)."""
        bits = numel * self.bits
        if bits % 8:
            raise ValueError("is not a whole number of bytes (sub-byte dtypes must end on a byte boundary)")
        return bits // 8


_TABLE = [
    DType("BOOL", 8, "bool"),
    DType("U8", 8, "uint8"),
    DType("I8", 8, "int8"),
    DType("F8_E5M2", 8, "float8_e5m2"),
    DType("F8_E5M2FNUZ", 8, "float8_e5m2fnuz"),
    DType("F8_E4M3", 8, "float8_e4m3fn"),
    DType("F8_E4M3FNUZ", 8, "float8_e4m3fnuz"),
    DType("F8_E8M0", 8, "float8_e8m0fnu"),
    DType("I16", 16, "int16"),
    DType("U16", 16, "uint16"),
    DType("F16", 16, "float16"),
    DType("BF16", 16, "bfloat16"),
    DType("I32", 32, "int32"),
    DType("U32", 32, "uint32"),
    DType("F32", 32, "float32"),
    DType("C64", 64, "complex64"),
    DType("F64", 64, "float64"),
    DType("I64", 64, "int64"),
    DType("U64", 64, "uint64"),
    DType("F4", 4, "float4_e2m1fn_x2", packed=2),
    DType("F6_E2M3", 6, None),
    DType("F6_E3M2", 6, None),
]

DTYPES: dict[str, DType] = {d.name: d for d in _TABLE}
WITH_TORCH_DTYPE = frozenset(d.name for d in _TABLE if d.torch_name is not None)
"""The dtypes a torch can have a dtype for (this process's: :func:`torch_dtypes`)."""


class _Tensor(Protocol):
    """What :func:`check_loadable` needs of a tensor (a header's ``TensorInfo``, a daemon's handle)."""

    name: str
    dtype: str
    shape: Sequence[int]


@functools.cache
def torch_dtypes() -> frozenset[str]:
    """The safetensors dtypes this process's torch has a dtype for."""
    import torch

    return frozenset(name for name in WITH_TORCH_DTYPE if hasattr(torch, DTYPES[name].torch_name))


def unloadable(dtype: str, shape: Sequence[int], have: Collection[str], whose: str) -> str | None:
    """Why no torch tensor holds a safetensors tensor of ``dtype``/``shape``, or ``None``.

    ``have``: the safetensors dtypes the torch that would hold it has (:func:`torch_dtypes`);
    ``whose``: that torch, for the message (``torch 2.13.0``, ``rank 3's torch``)."""
    spec = DTYPES.get(dtype)
    if spec is None:
        return f"unknown safetensors dtype {dtype!r}"
    if spec.torch_name is None:
        return f"safetensors dtype {dtype!r} has no torch dtype"
    if dtype not in have:
        return f"safetensors dtype {dtype!r} needs torch.{spec.torch_name}, which {whose} does not have"
    if spec.packed > 1 and (not shape or shape[-1] % spec.packed):
        return (
            f"{dtype} shape {list(shape)}: torch.{spec.torch_name} holds {spec.packed} values per element, "
            f"so the last dimension must be a multiple of {spec.packed}"
        )
    return None


def check_loadable(
    tensors: Iterable[_Tensor], *, uri: str | None = None, have: Collection[str] | None = None, whose: str | None = None
) -> None:
    """``CheckpointError`` naming the first of ``tensors`` (and its dtype) that no torch tensor can
    hold: what a load checks in its plan, before it reads. ``have``/``whose``: the torch that will
    hold them (default: this process's, which imports torch)."""
    if have is None:
        import torch

        have, whose = torch_dtypes(), f"torch {torch.__version__}"
    for t in tensors:
        reason = unloadable(t.dtype, t.shape, have, whose or "its torch")
        if reason is not None:
            raise CheckpointError(f"tensor {t.name!r}: {reason}", uri=uri, key=t.name)


def torch_layout(dtype: str, shape: Sequence[int]) -> tuple[torch.dtype, tuple[int, ...]]:
    """The torch dtype and shape of a safetensors tensor of ``dtype``/``shape`` (a packed dtype's
    last dimension halved); ``CheckpointError`` saying why where torch has none."""
    import torch

    reason = unloadable(dtype, shape, torch_dtypes(), f"torch {torch.__version__}")
    if reason is not None:
        raise CheckpointError(reason)
    spec = DTYPES[dtype]
    dims = tuple(int(d) for d in shape)
    if spec.packed > 1:
        dims = (*dims[:-1], dims[-1] // spec.packed)
    return getattr(torch, spec.torch_name), dims


def tensor_over(view, dtype: str, shape) -> torch.Tensor:
    """A tensor of safetensors ``dtype``/``shape`` over a uint8 numpy ``view`` (no copy; it holds ``view``)."""
    import torch

    torch_type, dims = torch_layout(dtype, shape)
    return torch.from_numpy(view).view(torch_type).reshape(dims)


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s bytes as a flat uint8 tensor (flattened first: a 0-d tensor cannot change dtype size)."""
    import torch

    return tensor.reshape(-1).view(torch.uint8)
