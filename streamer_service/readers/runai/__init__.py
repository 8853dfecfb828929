"""Run:ai Model Streamer, wrapped in one package (docs/architecture.md): nothing else imports Run:ai.

- :mod:`.contract`: the pinned version and the native entry points, checked before first use;
- :mod:`.reader`: :class:`NativeReader`, ranged reads straight into our buffers (a
  :class:`~streamer_service.readers.base.Reader`);
- :mod:`.environment`: the settings Run:ai reads only from ``os.environ`` (the one place we
  write it), and the credentials its readers need.
"""

from __future__ import annotations

from .contract import DISTRIBUTIONS, ENTRY_POINTS, FS_STRATEGY_SYMBOL, NATIVE_MODULE, PINNED_VERSION, installed_versions
from .environment import (
    FS_STRATEGY_ENV,
    READ_PARALLELISM_DEFAULTS,
    check_credentials,
    read_parallelism_in_force,
    storage_environment,
)
from .reader import BUFFERED_FS_STRATEGY, NativeReader, ResponseCode

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
