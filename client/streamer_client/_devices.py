"""Target devices: 'cpu' and 'cuda[:N]', checked before anything is read."""

from __future__ import annotations

import contextlib

import torch

from .errors import ConfigError

__all__ = ["device_context", "resolve_device"]


def resolve_device(device: str | torch.device) -> torch.device:
    try:
        target = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise ConfigError(f"unusable device {device!r}: {exc}") from None
    if target.type == "cpu":
        return target
    if target.type != "cuda":
        raise ConfigError(f"device {device!r}: only 'cpu' and 'cuda[:N]' are supported")
    if not torch.cuda.is_available():
        raise ConfigError(
            f"device {device!r} requested but CUDA is not available (torch {torch.__version__}, "
            f"built with CUDA {torch.version.cuda})"
        )
    index = torch.cuda.current_device() if target.index is None else target.index
    if index >= torch.cuda.device_count():
        raise ConfigError(f"device {device!r}: only {torch.cuda.device_count()} CUDA devices are visible")
    return torch.device("cuda", index)


def device_context(device: torch.device | None) -> contextlib.AbstractContextManager:
    """``device`` made current for CUDA runtime calls on this thread (``cudaHostRegister`` on a
    worker thread, say): ``torch.cuda.device(device)`` for a CUDA device; nothing for ``None``
    (the current device) or any other device."""
    if device is None or getattr(device, "type", None) != "cuda":
        return contextlib.nullcontext()
    return torch.cuda.device(device)
