"""The one module that touches Run:ai Model Streamer's native reader.

Run:ai's public Python surface (``SafetensorsStreamer``, ``FileStreamer``)
reads into buffers it owns, so every byte would be copied once more into ours.
Its native layer takes, per byte range, an absolute destination address, which
is what lets storage write straight into our buffers (DESIGN.md 3.1). Those
entry points (``runai_model_streamer.libstreamer.libstreamer``) are not public
API, so:

- they are used here and nowhere else;
- the distributions are pinned to exactly :data:`PINNED_VERSION` (pyproject),
  and ``tests/test_runai_contract.py`` fails loudly when that changes;
- :meth:`NativeReader.start` checks the entry points and their parameter names
  before the first call, and raises :class:`ConfigError` naming what changed
  instead of handing a changed ABI wrong arguments.

Nothing is loaded at import: importing Run:ai's ``libstreamer`` package opens
the shared library, so that import happens in :meth:`NativeReader.start`.

Buffer lifetime (DESIGN.md 6, and ``runai_request``'s docstring): a
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
import functools
import importlib
import importlib.metadata
import inspect
import logging
import math
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from streamer_client.errors import (
    ConfigError,
    ObjectChangedError,
    StorageError,
    StorageUnavailableError,
)

from .settings import Settings
from .uri import Scheme, StorageURI

__all__ = [
    "DISTRIBUTIONS",
    "ENTRY_POINTS",
    "FS_STRATEGY_ENV",
    "PINNED_VERSION",
    "FileReads",
    "NativeReader",
    "RangeResult",
    "ReadRange",
    "ResponseCode",
    "S3Credentials",
    "installed_versions",
    "storage_environment",
    "read_parallelism_in_force",
]

log = logging.getLogger(__name__)

PINNED_VERSION = "0.17.0"
"""The one Run:ai version whose native entry points this module was written against."""

DISTRIBUTIONS = (
    "runai-model-streamer",
    "runai-model-streamer-s3",
    "runai-model-streamer-gcs",
    "runai-model-streamer-azure",
)
"""Every part must be :data:`PINNED_VERSION`: mixed versions put .so files of different builds side by side."""

NATIVE_MODULE = "runai_model_streamer.libstreamer.libstreamer"

ENTRY_POINTS: dict[str, tuple[str, ...]] = {
    "runai_start": (),
    "runai_set_credentials": ("streamer", "s3_credentials"),
    "runai_request": ("streamer", "paths", "num_ranges", "range_offsets", "range_sizes", "range_dsts"),
    "runai_response": ("streamer", "timeout_ms"),
    "runai_response_str": ("response_code",),
    "runai_end": ("streamer",),
}
"""The Python wrappers we call in :data:`NATIVE_MODULE`, with their parameter names at 0.17.0."""

FS_STRATEGY_SYMBOL = "runai_file_streamer_set_fs_strategy"
"""C entry point (exported, versioned RUNAI_FILE_STREAMER_1.0) that 0.17.0 has no Python wrapper for.

``int runai_file_streamer_set_fs_strategy(void *streamer, const char *candidates)``: an ordered,
comma-separated preference list (io_uring_direct, io_uring_buffered, libaio_direct, sync_buffered),
set once per streamer, before its first filesystem submission. We call it instead of writing
``RUNAI_STREAMER_FS_STRATEGY`` into ``os.environ``: it is scoped to our streamer, so nothing
process-wide changes and nothing needs restoring."""

FS_STRATEGY_ENV = "RUNAI_STREAMER_FS_STRATEGY"
"""Run:ai's own variable for the same choice. When the operator sets it, it wins (see ``_apply_fs_strategy``)."""


def storage_environment(settings: Settings) -> dict[str, str]:
    """Our storage retry and timeout settings as the variables Run:ai's S3 reader reads.

    Run:ai owns the tensor reads, and its native S3 client reads these only from the process
    environment (docs/configuration.md, "Retries and timeouts"):

    - ``RUNAI_STREAMER_S3_REQUEST_TIMEOUT_MS`` <- ``storage_read_timeout_s``: a transfer that moves
      (almost) nothing for this long is aborted and retried. Run:ai's own default, 1000 ms, fails
      large reads from slow servers.
    - ``RUNAI_STREAMER_S3_MAX_RETRIES`` <- ``storage_retries``: retries of one ranged GET inside
      the AWS CRT (0 cannot be expressed: the CRT reads 0 as "its default", so it is left unset).
    - ``RUNAI_STREAMER_S3_TIMEOUT`` <- ``storage_retry_deadline_s``: Run:ai's own retries of a failed
      chunk (5xx, 408, 429, transport errors) stop once this many seconds passed since its first try.
    """
    env = {
        "RUNAI_STREAMER_S3_REQUEST_TIMEOUT_MS": str(max(1, round(settings.storage_read_timeout_s * 1000))),
        "RUNAI_STREAMER_S3_TIMEOUT": str(max(1, math.ceil(settings.storage_retry_deadline_s))),
    }
    if settings.storage_retries > 0:
        env["RUNAI_STREAMER_S3_MAX_RETRIES"] = str(settings.storage_retries)
    # Read parallelism (docs/configuration.md, "Read parallelism"): only what the operator set.
    for name, value in _read_parallelism(settings).items():
        if value is not None:
            env[name] = str(value)
    return env


READ_PARALLELISM_DEFAULTS = {
    "RUNAI_STREAMER_OBJ_CONCURRENCY": "8",
    "RUNAI_STREAMER_S3_TARGET_GBPS": "10",
    "RUNAI_STREAMER_CHUNK_BYTESIZE": "8388608",
}
"""Run:ai 0.17.0's defaults for the read-parallelism variables (object storage), for the report."""


def _read_parallelism(settings: Settings) -> dict[str, int | None]:
    return {
        "RUNAI_STREAMER_OBJ_CONCURRENCY": settings.obj_concurrency,
        "RUNAI_STREAMER_S3_TARGET_GBPS": settings.s3_target_gbps,
        "RUNAI_STREAMER_CHUNK_BYTESIZE": int(settings.read_chunk_size) if settings.read_chunk_size is not None else None,
    }


def read_parallelism_in_force(settings: Settings, environ: Mapping[str, str] = os.environ) -> dict[str, dict[str, str]]:
    """What Run:ai's reader will use for each read-parallelism variable, and where it comes from:
    ``environment`` (the operator set Run:ai's variable: it wins), ``settings`` (ours), or
    ``run:ai default``. Logged at start-up and reported by ``/readyz``. A ``RUNAI_STREAMER_CONCURRENCY``
    the operator set is Run:ai's fallback for the object-storage concurrency, so it is reported too."""
    ours = _read_parallelism(settings)
    report = {}
    for name, default in READ_PARALLELISM_DEFAULTS.items():
        if name in environ:
            report[name] = {"value": environ[name], "source": "environment"}
        elif ours[name] is not None:
            report[name] = {"value": str(ours[name]), "source": "settings"}
        elif name == "RUNAI_STREAMER_OBJ_CONCURRENCY" and "RUNAI_STREAMER_CONCURRENCY" in environ:
            report[name] = {"value": environ["RUNAI_STREAMER_CONCURRENCY"], "source": "environment (RUNAI_STREAMER_CONCURRENCY)"}
        else:
            report[name] = {"value": default, "source": "run:ai default"}
    return report


class _ProcessEnvironment:
    """Run:ai's variables in ``os.environ`` while at least one reader is open, then restored.

    The native S3 client reads its settings from the environment when it is created, so this is
    the one boundary where we write ``os.environ`` (STYLE.md). A variable the operator set wins and
    is left alone. Readers of one process (the daemon's sessions) share one refcount.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 0
        self._added: list[str] = []

    def enter(self, variables: Mapping[str, str]) -> None:
        with self._lock:
            self._users += 1
            for name, value in variables.items():
                if name not in os.environ:
                    os.environ[name] = value
                    self._added.append(name)

    def leave(self) -> None:
        with self._lock:
            self._users -= 1
            if self._users == 0:
                for name in self._added:
                    os.environ.pop(name, None)
                self._added.clear()


_ENVIRONMENT = _ProcessEnvironment()

# runai_response blocks in native code, where Ctrl-C cannot reach it. Polling with a timeout returns
# to Python between waits so signals are handled; a poll that times out costs nothing.
_POLL_MS = 500


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


@dataclass(frozen=True)
class S3Credentials:
    """Explicit S3 credentials for one reader; without them Run:ai's C++ AWS SDK resolves its
    default chain (environment, profile, SSO, IMDS) and reads ``AWS_ENDPOINT_URL`` itself."""

    access_key_id: str | None = None
    secret_access_key: str | None = None
    session_token: str | None = None
    region: str | None = None
    endpoint: str | None = None


@dataclass(frozen=True)
class ReadRange:
    """``nbytes`` from ``offset`` of a file, written to absolute address ``dst``."""

    offset: int
    nbytes: int
    dst: int

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


@dataclass(frozen=True)
class FileReads:
    """The ranges to read from one file: a local path or a full ``s3://``/``gs://``/``az://`` URI."""

    path: str
    ranges: tuple[ReadRange, ...]


@dataclass(frozen=True)
class RangeResult:
    """The answer for one range: ``error`` is ``None`` on success, else a :class:`StorageError`
    naming the path and byte range. ``submission_done`` is true for a submission's last answer."""

    submission: int
    file_index: int
    range_index: int
    path: str
    range: ReadRange
    submission_done: bool
    error: StorageError | None


@dataclass
class _Submission:
    files: tuple[FileReads, ...]
    keepalive: Any  # the destination buffers: referenced until the backend is done with them
    remaining: int


def installed_versions() -> dict[str, str | None]:
    """The installed version of each of :data:`DISTRIBUTIONS` (``None`` when missing)."""
    versions: dict[str, str | None] = {}
    for name in DISTRIBUTIONS:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def _load_native() -> ModuleType:
    """Import Run:ai's native wrapper (this opens libstreamer.so) and check its contract."""
    try:
        module = importlib.import_module(NATIVE_MODULE)
    except (ImportError, OSError) as exc:
        raise ConfigError(
            f"cannot load Run:ai's native reader ({NATIVE_MODULE}): {exc}; "
            f"install runai-model-streamer=={PINNED_VERSION} (all of {', '.join(DISTRIBUTIONS)})"
        ) from exc
    problems = _contract_problems(module)
    if problems:
        raise ConfigError(
            f"Run:ai's native entry points changed ({'; '.join(problems)}); streamer-service needs "
            f"runai-model-streamer=={PINNED_VERSION}, installed: {installed_versions()}"
        )
    _warn_if_version_differs()
    return module


def _contract_problems(module: ModuleType) -> list[str]:
    problems = []
    for name, params in ENTRY_POINTS.items():
        function = getattr(module, name, None)
        if not callable(function):
            problems.append(f"{name} is missing")
            continue
        found = tuple(inspect.signature(function).parameters)
        if found != params:
            problems.append(f"{name}{found} is not {name}{params}")
    library = getattr(getattr(module, "dll", None), "lib", None)
    if library is None or not hasattr(library, FS_STRATEGY_SYMBOL):
        problems.append(f"C symbol {FS_STRATEGY_SYMBOL} is missing")
    return problems


@functools.lru_cache(maxsize=1)
def _warn_if_version_differs() -> None:
    # The entry points matched, so this may work; the contract test is what refuses to pass.
    # Once per process: every stream starts a reader.
    wrong = {name: v for name, v in installed_versions().items() if v != PINNED_VERSION}
    if wrong:
        log.warning("Run:ai distributions not at the pinned %s: %s", PINNED_VERSION, wrong)


class NativeReader:
    """One Run:ai streamer: submit ranged reads into our buffers, then drain their answers.

    Use as a context manager (or :meth:`start` / :meth:`close`). Not thread-safe: Run:ai forbids
    sending requests and reading responses in parallel, so one thread drives a reader.

    ``fs_strategy`` applies to local files only (object storage never consults it): an ordered
    preference list for Run:ai's filesystem engine, or ``None`` for Run:ai's own default. An
    operator's ``RUNAI_STREAMER_FS_STRATEGY`` takes precedence over it.
    """

    def __init__(
        self,
        *,
        s3_credentials: S3Credentials | None = None,
        fs_strategy: str | None = None,
        environment: Mapping[str, str] | None = None,
    ) -> None:
        self._credentials = s3_credentials
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
        native = _load_native()
        _ENVIRONMENT.enter(self._environment)
        try:
            streamer = _call_native(native.runai_start)
        except BaseException:
            _ENVIRONMENT.leave()
            raise
        try:
            if self._credentials is not None:
                _call_native(native.runai_set_credentials, streamer, _to_runai_credentials(self._credentials))
            if self._fs_strategy is not None:
                _apply_fs_strategy(native, streamer, self._fs_strategy)
        except BaseException:
            native.runai_end(streamer)
            _ENVIRONMENT.leave()
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
            _ENVIRONMENT.leave()

    # ------------------------------------------------------------------ requests

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
        _OBJECT_STORE.note(files[0].path)
        return submission

    def responses(self) -> Iterator[RangeResult]:
        """Answers as ranges complete, in completion order, until none is owed.

        A storage error is reported in :attr:`RangeResult.error`; the caller decides. A fatal
        code (UnknownError and anything not a storage error) raises :class:`StorageError` and
        aborts this reader: its submissions' buffers stay referenced until :meth:`close`.
        """
        while self._live:
            raw = self._next_raw()
            yield self._resolve(*raw)

    def _next_raw(self) -> tuple[int, int, int, int, bool]:
        streamer = self._require_started()
        while True:
            try:
                raw = self._native.runai_response(streamer, _POLL_MS)
            except TimeoutError:
                continue
            if raw is None:
                self._abort_all()
                raise StorageError(
                    f"Run:ai reader finished with {self.outstanding} answers still owed"
                )
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
                f"{file.path}: bytes [{read.offset}, {read.end}): {self._describe(code)}; aborting the load",
                uri=file.path,
            )
        if done or submission.remaining == 0:
            # Every range answered Success or a storage error: the backend is done with this memory.
            del self._live[submission_id]
        error = None
        if code != ResponseCode.SUCCESS:
            error = _STORAGE_ERRORS[code](
                f"{file.path}: bytes [{read.offset}, {read.end}): {self._describe(code)}", uri=file.path
            )
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


def _to_runai_credentials(credentials: S3Credentials) -> Any:
    from runai_model_streamer.s3_utils.s3_utils import S3Credentials as RunaiS3Credentials

    return RunaiS3Credentials(
        access_key_id=credentials.access_key_id,
        secret_access_key=credentials.secret_access_key,
        session_token=credentials.session_token,
        region_name=credentials.region,
        endpoint=credentials.endpoint,
    )


def _apply_fs_strategy(native: ModuleType, streamer: Any, candidates: str) -> None:
    # Run:ai reads its own variable when the strategy is not set explicitly. An operator who set it
    # chose on purpose (e.g. direct I/O for a cold NVMe checkpoint larger than RAM): respect that.
    if os.environ.get(FS_STRATEGY_ENV):
        log.debug("%s is set; leaving Run:ai's filesystem strategy to it", FS_STRATEGY_ENV)
        return
    # A fresh prototype bound to the symbol, so the argtypes of Run:ai's shared CDLL stay untouched.
    prototype = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p)
    set_strategy = prototype((FS_STRATEGY_SYMBOL, native.dll.lib))
    code = set_strategy(streamer, candidates.encode("utf-8"))
    if code != ResponseCode.SUCCESS:
        text = native.runai_response_str(code)
        text = text.decode("utf-8", "replace") if isinstance(text, bytes) else str(text)
        raise ConfigError(f"Run:ai refused filesystem strategy {candidates!r}: {text}")


class _ObjectStoreInUse:
    """The object store Run:ai has read from in this process: 0.17.0 keeps per-process state per
    store, and a load from a second one fails every range with FILE_ACCESS_ERROR (measured here,
    S3 then GCS and GCS then S3, in-process and in one daemon: tests/test_client.py)."""

    def __init__(self) -> None:
        self.scheme: str | None = None

    def note(self, path: str) -> None:
        scheme, sep, _ = path.partition("://")
        if sep and self.scheme is None:
            self.scheme = scheme

    def check(self, uri: StorageURI) -> None:
        if uri.is_local or self.scheme in (None, uri.scheme.value):
            return
        raise ConfigError(
            f"cannot stream {uri}: this process already streamed from {self.scheme}:// and Run:ai 0.17.0 "
            f"keeps per-process state per object store, so every {uri.scheme.value}:// read would fail; "
            "run one daemon (or rank process) per object store",
            uri=uri.normalized,
        )


_OBJECT_STORE = _ObjectStoreInUse()


def check_credentials(uri: StorageURI, settings: Settings) -> None:
    """Refuse, before any read, a configuration Run:ai's reader cannot use: a second object store in
    this process (:class:`_ObjectStoreInUse`), or Azure without an account name.

    Run:ai's Azure reader reads ``AZURE_STORAGE_ACCOUNT_NAME`` (with a key, a SAS token or
    workload identity) and ignores ``AZURE_STORAGE_CONNECTION_STRING``: with only a connection
    string every range would fail with "invalid parameters" after the listing succeeded.
    """
    _OBJECT_STORE.check(uri)
    if uri.scheme is Scheme.AZURE and not settings.azure_storage_account_name:
        raise ConfigError(
            f"streaming {uri} needs AZURE_STORAGE_ACCOUNT_NAME (with AZURE_STORAGE_ACCOUNT_KEY, "
            "AZURE_STORAGE_SAS_TOKEN or workload identity): Run:ai's Azure reader ignores "
            "AZURE_STORAGE_CONNECTION_STRING",
            uri=uri.normalized,
        )
