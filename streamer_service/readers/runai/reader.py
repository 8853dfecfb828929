"""Run:ai's native reader: ranged reads straight into our buffers.

Run:ai's public Python surface (``SafetensorsStreamer``, ``FileStreamer``)
reads into buffers it owns, so every byte would be copied once more into ours.
Its native layer takes, per byte range, an absolute destination address, which
is what lets storage write straight into our buffers (docs/architecture.md). Those
entry points are not public API: ``contract`` pins and checks them, and this
module is the only one that calls them. Nothing is loaded at import: importing
Run:ai's ``libstreamer`` package opens the shared library, so that import
happens in :meth:`NativeReader.start`.

Buffer lifetime (docs/architecture.md, and ``runai_request``'s docstring): a
destination is a raw address and keeps nothing alive, and an object-storage
read already sent cannot be cancelled -- ``runai_end`` is what waits for it.
So :class:`NativeReader` holds a reference to every submission's destination
buffers (the ``keepalive`` given to :meth:`NativeReader.submit`) until

- every range of that submission has answered Success or a storage error (the
  backend has then finished with that memory; Run:ai documents a destination
  as reusable at once after a storage error), or else
- ``runai_end`` has returned (:meth:`NativeReader.close`). This is the only
  release for a submission that saw an UnknownError or any other fatal code,
  and for submissions still in flight when a load is abandoned.
"""

from __future__ import annotations

import ctypes
import enum
import time
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import Any

from streamer_client._waits import slice_ms
from streamer_client.errors import (
    ConfigError,
    ObjectChangedError,
    StorageError,
    StorageUnavailableError,
)

from ..base import FileReads, RangeResult
from .contract import FS_STRATEGY_SYMBOL, load_native
from .environment import ENVIRONMENT, OBJECT_STORE

__all__ = ["NativeReader", "ResponseCode"]


class ResponseCode(enum.IntEnum):
    """Run:ai's response codes at 0.17.0 (``runai_response_str`` of each value, abbreviated)."""

    SUCCESS = 0
    FINISHED = 1  # teardown: no further responses
    FILE_ACCESS_ERROR = 2  # missing, unreadable, refused by storage
    END_OF_FILE = 3  # the range runs past the end of a local file
    S3_NOT_SUPPORTED = 4
    GLIBC_PREREQUISITE = 5
    INSUFFICIENT_FD_LIMIT = 6
    INVALID_PARAMETERS = 7
    EMPTY_REQUEST = 8
    BUSY = 9
    CA_FILE_NOT_FOUND = 10
    UNKNOWN_ERROR = 11  # the read may still be outstanding: abort, never reuse the destination
    OBJECT_PLUGIN_LOAD_ERROR = 12
    GCS_NOT_SUPPORTED = 13
    AZURE_NOT_SUPPORTED = 14
    RANGE_SIZE_MISMATCH = 15  # object storage returned fewer/more bytes than asked
    TIMED_OUT = 16
    BACKEND_MIX = 17
    CREDENTIALS_ALREADY_SET = 18
    RETRYABLE_ACCESS_ERROR = 19
    FS_STRATEGY_CONFLICT = 20
    FS_STRATEGY_UNAVAILABLE = 21
    ASYNC_READER_FAILED = 22  # the async engine gave up; the storage itself is healthy


# Per-range codes that come from a completed read: the backend is done with the destination, the
# load can report a clean error. Everything else is fatal (the destination may still be written).
_STORAGE_ERRORS: dict[int, type[StorageError]] = {
    ResponseCode.FILE_ACCESS_ERROR: StorageError,
    # The file or object is shorter than the catalog said: it changed since its header was read.
    ResponseCode.END_OF_FILE: ObjectChangedError,
    ResponseCode.RANGE_SIZE_MISMATCH: ObjectChangedError,
    ResponseCode.RETRYABLE_ACCESS_ERROR: StorageUnavailableError,
    ResponseCode.ASYNC_READER_FAILED: StorageError,
}


class _Submission:
    __slots__ = ("files", "keepalive", "remaining")

    def __init__(self, files: tuple[FileReads, ...], keepalive: Any, remaining: int) -> None:
        self.files = files
        self.keepalive = keepalive  # the destination buffers: referenced until the backend is done with them
        self.remaining = remaining


class NativeReader:
    """One Run:ai streamer: submit ranged reads into our buffers, then drain their answers
    (a :class:`~streamer_service.readers.base.Reader`).

    Use as a context manager (or :meth:`start` / :meth:`close`). Not thread-safe: Run:ai forbids
    sending requests and reading responses in parallel, so one thread drives a reader.

    ``fs_strategy`` applies to local files only (object storage never consults it): an ordered
    preference list for Run:ai's filesystem engine, or ``None`` for Run:ai's own default (which
    follows ``RUNAI_STREAMER_FS_STRATEGY``). :func:`~streamer_service.readers.choice.fs_strategy_for`
    decides it for a load.
    """

    def __init__(
        self,
        *,
        fs_strategy: str | None = None,
        environment: Mapping[str, str] | None = None,
    ) -> None:
        self._fs_strategy = fs_strategy
        self._environment = dict(environment or {})  # see storage_environment()
        self._native: ModuleType | None = None
        self._streamer: Any = None
        self._live: dict[int, _Submission] = {}
        # Buffers of submissions that hit a fatal code: released only after runai_end returns.
        self._retained: list[Any] = []
        self._aborted = False

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> NativeReader:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        if self._streamer is not None:
            raise RuntimeError("NativeReader already started")
        native = load_native()
        ENVIRONMENT.enter(self._environment)
        try:
            streamer = _call_native(native.runai_start)
        except BaseException:
            ENVIRONMENT.leave()
            raise
        try:
            if self._fs_strategy is not None:
                _apply_fs_strategy(native, streamer, self._fs_strategy)
        except BaseException:
            native.runai_end(streamer)
            ENVIRONMENT.leave()
            raise
        self._native, self._streamer = native, streamer

    def close(self) -> None:
        """``runai_end`` (waits for every read still outstanding), then release every buffer."""
        if self._streamer is None:
            return
        streamer, self._streamer = self._streamer, None
        try:
            self._native.runai_end(streamer)
        finally:
            # Only now, after runai_end has returned, may the destination memory go.
            self._live.clear()
            self._retained.clear()
            ENVIRONMENT.leave()

    # ------------------------------------------------------------------ requests

    @property
    def reusable(self) -> bool:
        """Whether this started reader can serve another load: every range it was sent answered,
        and none fatally (``readers.kept``)."""
        return self._streamer is not None and not self._aborted and not self._live and not self._retained

    @property
    def outstanding(self) -> int:
        """Answers still owed, across every submission in flight."""
        return sum(s.remaining for s in self._live.values())

    def submit(self, files: Sequence[FileReads], keepalive: Any) -> int:
        """Submit one request; return its submission id (non-blocking).

        ``keepalive`` is whatever owns the memory the ranges' ``dst`` addresses point into: it is
        referenced until the backend is done with it (module docstring). Destinations must not
        overlap each other nor those of any submission still in flight. A request with no ranges
        is refused: Run:ai would owe it no answer, so nothing could report it done.
        """
        streamer = self._require_started()
        if self._aborted:
            raise StorageError("Run:ai reader was aborted after a fatal error; start a new one")
        files = tuple(f for f in files if f.ranges)
        if not files:
            raise ValueError("a submission needs at least one range")
        submission = _call_native(
            self._native.runai_request,
            streamer,
            [f.path for f in files],
            [len(f.ranges) for f in files],
            [r.offset for f in files for r in f.ranges],
            [r.nbytes for f in files for r in f.ranges],
            [r.dst for f in files for r in f.ranges],
        )
        self._live[submission] = _Submission(files, keepalive, sum(len(f.ranges) for f in files))
        OBJECT_STORE.note(files[0].path)
        return submission

    def answer(self, wait_s: float | None = None) -> RangeResult | None:
        """The next range's answer, in completion order. ``None`` when none is owed, or when none
        came within ``wait_s`` seconds (``None``: as long as it takes).

        A storage error is reported in :attr:`RangeResult.error`; the caller decides. A fatal
        code (UnknownError and anything not a storage error) raises :class:`StorageError` and
        aborts this reader: its submissions' buffers stay referenced until :meth:`close`.
        """
        if not self._live:
            return None
        raw = self._next_raw(None if wait_s is None else time.monotonic() + wait_s)
        return None if raw is None else self._resolve(*raw)

    def _next_raw(self, deadline: float | None) -> tuple[int, int, int, int, bool] | None:
        """Run:ai's next answer; ``None`` once ``time.monotonic()`` passed ``deadline``."""
        streamer = self._require_started()
        while True:
            try:
                # In slices: runai_response blocks in native code, where Ctrl-C cannot reach it.
                raw = self._native.runai_response(streamer, slice_ms(deadline))
            except TimeoutError:
                if deadline is not None and time.monotonic() >= deadline:
                    return None
                continue
            if raw is None:
                self._abort_all()
                raise StorageError(f"Run:ai reader finished with {self.outstanding} answers still owed")
            return raw

    def _resolve(self, code: int, submission_id: int, file_index: int, range_index: int, done: bool) -> RangeResult:
        submission = self._live.get(submission_id)
        if submission is None:
            self._abort_all()
            raise StorageError(f"Run:ai answered for unknown submission {submission_id}; aborting the load")
        file = submission.files[file_index]
        read = file.ranges[range_index]
        submission.remaining -= 1
        if code != ResponseCode.SUCCESS and code not in _STORAGE_ERRORS:
            self._abort_all()
            raise StorageError(
                f"{read.where(file.path)}: {self._describe(code)}; aborting the load",
                uri=file.path,
            )
        if done or submission.remaining == 0:
            # Every range answered Success or a storage error: the backend is done with this memory.
            del self._live[submission_id]
        error = None
        if code != ResponseCode.SUCCESS:
            error = _STORAGE_ERRORS[code](f"{read.where(file.path)}: {self._describe(code)}", uri=file.path)
        return RangeResult(submission_id, file_index, range_index, file.path, read, done, error)

    def _abort_all(self) -> None:
        # A fatal answer may mean a read is still landing: nothing in flight may be freed or reused
        # before runai_end, and no further submission is accepted.
        self._aborted = True
        self._retained.extend(s.keepalive for s in self._live.values())
        self._live.clear()

    def _describe(self, code: int) -> str:
        text = self._native.runai_response_str(code)
        text = text.decode("utf-8", "replace") if isinstance(text, bytes) else str(text)
        try:
            return f"{text} (Run:ai {ResponseCode(code).name})"
        except ValueError:
            return f"{text} (Run:ai code {code})"

    def _require_started(self) -> Any:
        if self._streamer is None:
            raise RuntimeError("NativeReader is not started")
        return self._streamer

    def __repr__(self) -> str:
        state = "open" if self._streamer is not None else "closed"
        return f"NativeReader({state}, {len(self._live)} submissions, {self.outstanding} answers owed)"


def _call_native(function: Any, *args: Any) -> Any:
    # Run:ai's wrappers report a refused call (bad parameters, plugin not loadable, ...) as
    # ValueError; it is a storage-side failure to us, with Run:ai's own text.
    try:
        return function(*args)
    except ValueError as exc:
        raise StorageError(f"Run:ai {function.__name__} failed: {exc}") from exc


def _apply_fs_strategy(native: ModuleType, streamer: Any, candidates: str) -> None:
    # A fresh prototype bound to the symbol, so the argtypes of Run:ai's shared CDLL stay untouched.
    prototype = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p)
    set_strategy = prototype((FS_STRATEGY_SYMBOL, native.dll.lib))
    code = set_strategy(streamer, candidates.encode("utf-8"))
    if code != ResponseCode.SUCCESS:
        text = native.runai_response_str(code)
        text = text.decode("utf-8", "replace") if isinstance(text, bytes) else str(text)
        raise ConfigError(f"Run:ai refused filesystem strategy {candidates!r}: {text}")
