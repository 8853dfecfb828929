"""safetensors dtype names and their torch equivalents.

One table for the service (header validation, planning) and the client
(building tensors from bytes). Every dtype the safetensors format defines is
here; a dtype torch cannot represent maps to ``None`` and is refused when a
tensor of it is materialized, not when the header is read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import torch

__all__ = ["DType", "DTYPES", "torch_dtype", "tensor_over", "byte_view"]


class DType(NamedTuple):
    name: str
    bits: int  # per element; sub-byte types (F4, F6) pack several per byte
    torch_name: str | None

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
    DType("F4", 4, None),
    DType("F6_E2M3", 6, None),
    DType("F6_E3M2", 6, None),
]

DTYPES: dict[str, DType] = {d.name: d for d in _TABLE}


def torch_dtype(name: str):
    """The torch dtype for safetensors dtype ``name``; ``TypeError`` if torch lacks it."""
    import torch

    spec = DTYPES.get(name)
    if spec is None or spec.torch_name is None or not hasattr(torch, spec.torch_name):
        raise TypeError(f"safetensors dtype {name!r} has no torch equivalent in torch {torch.__version__}")
    return getattr(torch, spec.torch_name)


def tensor_over(view, dtype: str, shape) -> torch.Tensor:
    """A tensor of safetensors ``dtype``/``shape`` over a uint8 numpy ``view`` (no copy; it holds ``view``)."""
    import torch

    return torch.from_numpy(view).view(torch_dtype(dtype)).reshape(shape)


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s bytes as a flat uint8 tensor (flattened first: a 0-d tensor cannot change dtype size)."""
    import torch

    return tensor.reshape(-1).view(torch.uint8)
