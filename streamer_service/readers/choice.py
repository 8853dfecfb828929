"""Which reader reads a load, and with which filesystem strategy: the rules in one place.

- **Local means buffered.** Run:ai reads a local file through the page cache
  (:data:`~streamer_service.readers.runai.BUFFERED_FS_STRATEGY`): checkpoints are usually read
  from a cache just filled. Object storage never consults a filesystem strategy, so none is set
  for it and Run:ai's state stays untouched.
- **The operator's ``RUNAI_STREAMER_FS_STRATEGY`` wins.** Set, it is a choice made on purpose
  (e.g. direct I/O for a cold NVMe checkpoint larger than RAM): no strategy of ours is applied,
  and local files are read by Run:ai, which follows it, not through mappings.
- **Local files through mappings** (:class:`~streamer_service.readers.mapped.MappedReader`)
  where the native copier is built, ``STREAMER_LOCAL_READER`` is ``mapped`` (the default), the
  operator has not set Run:ai's strategy, and the bytes do not go to memory the caller keeps: an
  in-process CPU load reads with Run:ai straight into the caller's memory (a mapping would not
  be faster there, and would count the checkpoint's pages in the process's RSS while kept).
  A load to a CUDA device for which it is chosen does not use it: the files' mappings are its
  sources, staged straight to the device (``embedded.staged``, :func:`reads_mappings`).
- Everything else: Run:ai's :class:`~streamer_service.readers.runai.reader.NativeReader`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

from ..uri import StorageURI
from .base import Reader, ReaderFactory
from .runai import BUFFERED_FS_STRATEGY, FS_STRATEGY_ENV

__all__ = [
    "fs_strategy_for", "local_reader_in_force", "open_reader", "operator_fs_strategy", "reader_for", "reads_mappings",
]  # fmt: skip


def operator_fs_strategy() -> str | None:
    """``RUNAI_STREAMER_FS_STRATEGY`` where the operator set it, else None."""
    return os.environ.get(FS_STRATEGY_ENV) or None


def fs_strategy_for(uri: StorageURI) -> str | None:
    """The filesystem strategy a reader of ``uri`` is given: buffered for a local directory, unless
    the operator chose Run:ai's own; None (Run:ai's state untouched) for object storage."""
    if not uri.is_local or operator_fs_strategy():
        return None
    return BUFFERED_FS_STRATEGY


def local_reader_in_force(local_reader: str = "mapped") -> str:
    """How local directories are read, and why where it is not the setting: for the daemon's
    start-up log and ``/readyz``, so that a copier that did not build is not a silent slowdown."""
    if local_reader != "mapped":
        return "runai (STREAMER_LOCAL_READER=runai)"
    from . import mapped  # each reader is imported where it is chosen: a load imports only its own

    if not mapped.available():
        return "runai (the native copier is not built: reinstall streamer-service with a C compiler)"
    if operator_fs_strategy():
        return f"runai ({FS_STRATEGY_ENV} is set)"
    return "mapped"


def reader_for(uri: StorageURI, local_reader: str = "mapped", *, into_callers_memory: bool = False) -> ReaderFactory:
    """The reader of a load of ``uri`` (``local_reader``: the setting ``STREAMER_LOCAL_READER``;
    ``into_callers_memory``: the bytes land in memory handed to the caller, an in-process CPU load)."""
    if uri.is_local and not into_callers_memory and local_reader_in_force(local_reader) == "mapped":
        from .mapped import MappedReader

        return MappedReader
    from .runai.reader import NativeReader

    return NativeReader


def reads_mappings(factory: ReaderFactory) -> bool:
    """Whether ``factory`` is the mapped reader's: a device load it would read copies straight
    from the files' mappings instead (``embedded.staged``)."""
    mapped = sys.modules.get(f"{__package__}.mapped")  # imported wherever the mapped reader was chosen
    return mapped is not None and factory is mapped.MappedReader


def open_reader(uri: StorageURI, factory: ReaderFactory, environment: Mapping[str, str] | None = None) -> Reader:
    """A reader of ``uri`` from ``factory``, with the filesystem strategy :func:`fs_strategy_for`
    gives and Run:ai's storage ``environment`` (``runai.storage_environment``); not started."""
    return factory(fs_strategy=fs_strategy_for(uri), environment=environment)
