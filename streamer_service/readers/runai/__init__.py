"""Run:ai Model Streamer, wrapped in one package (docs/architecture.md): nothing else imports Run:ai.

- :mod:`.environment`: the settings Run:ai reads only from ``os.environ`` (the one place we
  write it), its filesystem strategies, and the credentials its readers need: plain Python,
  imported with the package;
- :mod:`.contract`: the pinned version and the native entry points, checked before first use;
- :mod:`.reader`: :class:`NativeReader`, ranged reads straight into our buffers (a
  :class:`~streamer_service.readers.base.Reader`).

The last two are imported when one of their names is first asked for: a load that Run:ai does not
read (a local directory read through mappings) imports neither, nor anything of Run:ai's.
"""

from __future__ import annotations

from typing import Any

from .environment import (
    BUFFERED_FS_STRATEGY,
    FS_STRATEGY_ENV,
    READ_PARALLELISM_DEFAULTS,
    check_credentials,
    read_parallelism_in_force,
    storage_environment,
)

__all__ = [
    "BUFFERED_FS_STRATEGY",
    "DISTRIBUTIONS",
    "ENTRY_POINTS",
    "FS_STRATEGY_ENV",
    "FS_STRATEGY_SYMBOL",
    "NATIVE_MODULE",
    "PINNED_VERSION",
    "READ_PARALLELISM_DEFAULTS",
    "NativeReader",
    "ResponseCode",
    "check_credentials",
    "installed_versions",
    "read_parallelism_in_force",
    "storage_environment",
]

_CONTRACT = frozenset(
    {"DISTRIBUTIONS", "ENTRY_POINTS", "FS_STRATEGY_SYMBOL", "NATIVE_MODULE", "PINNED_VERSION", "installed_versions"}
)
_READER = frozenset({"NativeReader", "ResponseCode"})


def __getattr__(name: str) -> Any:
    """The names of :mod:`.contract` and :mod:`.reader`, imported on first use."""
    if name in _CONTRACT:
        from . import contract as module
    elif name in _READER:
        from . import reader as module
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(module, name)
    globals()[name] = value
    return value
