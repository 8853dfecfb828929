"""The interface of a reader: ranged reads of files into our buffers, answered range by range.

The load loop (``load.pipeline``) and the modes above it are typed against :class:`Reader`, never
against an implementation; :func:`~streamer_service.readers.choice.reader_for` picks one for a load.
Two implement it: Run:ai's native reader (:class:`~streamer_service.readers.runai.reader.NativeReader`)
and the mapped reader of local files (:class:`~streamer_service.readers.mapped.MappedReader`).

The contract, for every implementation:

- ``submit`` queues one submission (ranges of one or more files, each written to an absolute
  address) and returns its id at once; ``keepalive`` is whatever owns the destination memory, and
  the reader references it until it is done with that memory (every range answered, or the
  reader closed after a fatal error);
- ``answer`` returns one :class:`RangeResult` per range, the next one to come, or ``None`` when
  none is owed or none came within its ``wait_s`` (so that a caller can do other work meanwhile
  and ask again; ``iter(reader.answer, None)`` is every answer still owed). A storage error is
  reported in :attr:`RangeResult.error` (the caller decides), a fatal one raises ``StorageError``
  and aborts the reader;
- one thread drives a reader; ``close`` waits for every read still landing before releasing buffers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, Protocol

from streamer_client.errors import StorageError

__all__ = ["FileReads", "RangeResult", "ReadRange", "Reader", "ReaderFactory"]


class ReadRange(NamedTuple):
    """``nbytes`` from ``offset`` of a file, written to absolute address ``dst``."""

    offset: int
    nbytes: int
    dst: int

    @property
    def end(self) -> int:
        return self.offset + self.nbytes

    def where(self, path: str) -> str:
        """``path`` and this range, as every read error names them."""
        return f"{path}: bytes [{self.offset}, {self.end})"


class FileReads(NamedTuple):
    """The ranges to read from one file: a local path or a full ``s3://``/``gs://``/``az://`` URI."""

    path: str
    ranges: tuple[ReadRange, ...]


class RangeResult(NamedTuple):
    """The answer for one range: ``error`` is ``None`` on success, else a :class:`StorageError`
    naming the path and byte range. ``submission_done`` is true for a submission's last answer."""

    submission: int
    file_index: int
    range_index: int
    path: str
    range: ReadRange
    submission_done: bool
    error: StorageError | None


class Reader(Protocol):
    """Ranged reads into our buffers (module docstring: the contract). A context manager:
    ``start`` on entry, ``close`` on exit."""

    def __enter__(self) -> Reader: ...

    def __exit__(self, *exc: object) -> None: ...

    def start(self) -> None: ...

    def close(self) -> None: ...

    @property
    def outstanding(self) -> int:
        """Answers still owed, across every submission in flight."""
        ...

    def submit(self, files: Sequence[FileReads], keepalive: Any) -> int: ...

    def answer(self, wait_s: float | None = None) -> RangeResult | None:
        """The next range's answer; ``None`` when none is owed or none came within ``wait_s`` s."""
        ...


class ReaderFactory(Protocol):
    """Makes the reader of one load: a reader class, or anything called the same way."""

    def __call__(self, *, fs_strategy: str | None = None, environment: Mapping[str, str] | None = None) -> Reader: ...
