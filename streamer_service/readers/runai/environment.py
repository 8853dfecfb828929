"""Run:ai's settings that only the process environment can carry: the one boundary where we
write ``os.environ``, and what Run:ai will read from it.

Run:ai's native S3 client reads its retry, timeout and parallelism settings from the environment
when it is created; :class:`ProcessEnvironment` sets ours there while a reader is open and
restores the environment after, leaving what the operator set alone.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Mapping

from streamer_client.errors import ConfigError

from ...settings import Settings
from ...sizing import ReadParallelism, in_flight_bytes, slot_bytes
from ...uri import Scheme, StorageURI

__all__ = [
    "BUFFERED_FS_STRATEGY",
    "ENVIRONMENT",
    "OBJECT_STORE",
    "FS_STRATEGY_ENV",
    "READ_PARALLELISM_DEFAULTS",
    "ProcessEnvironment",
    "check_credentials",
    "read_parallelism_in_force",
    "storage_environment",
]

FS_STRATEGY_ENV = "RUNAI_STREAMER_FS_STRATEGY"
"""Run:ai's own variable for its filesystem strategy. When the operator sets it, it wins
(``readers.choice.fs_strategy_for``)."""

# Run:ai 0.17.0 defaults to "io_uring_direct,libaio_direct,sync_buffered": O_DIRECT, which bypasses
# the page cache. Checkpoints are usually read from a cache that was just filled (a download, a
# previous load, a local NVMe copy), so buffered reads win:
# they copy out of the page cache where O_DIRECT reads the device again.
#
# Not io_uring_buffered, although it faulted fresh buffers in faster: after a load through
# it, a large write of the same process to a pipe was cut short (8 of 30 runs printed a truncated
# 2 MB line to a subprocess pipe with exit code 0; 0 of 30 with sync_buffered). Losing a user's
# output silently is not a price for speed. tests/test_engine.py::test_process_output_survives_a_load
# guards it. Which loads ask for it, and that RUNAI_STREAMER_FS_STRATEGY wins when the operator set
# it, is decided in one place: readers/choice.py.
BUFFERED_FS_STRATEGY = "sync_buffered"


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
    # Read parallelism (docs/configuration.md, "Read parallelism"): our settings, else what the
    # NIC rate asks for; Run:ai's fallback RUNAI_STREAMER_CONCURRENCY, set by the operator, wins
    # over what the rate asks for.
    for name, got in _ours(settings).items():
        if got is None:
            continue
        if got[1] != "settings" and name == "RUNAI_STREAMER_OBJ_CONCURRENCY" and "RUNAI_STREAMER_CONCURRENCY" in os.environ:
            continue
        env[name] = str(got[0])
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


def _for_target(settings: Settings) -> dict[str, int | None]:
    """What ``target_gbps`` asks of Run:ai (``sizing.ReadParallelism``); ``None`` where that is
    Run:ai's own default (the chunk size, which Run:ai applies to local files too, stays its own)."""
    wanted = ReadParallelism.for_rate(settings.target_gbps)
    return {
        "RUNAI_STREAMER_OBJ_CONCURRENCY": wanted.obj_concurrency,
        "RUNAI_STREAMER_S3_TARGET_GBPS": wanted.s3_target_gbps,
        "RUNAI_STREAMER_CHUNK_BYTESIZE": None
        if str(wanted.chunk_bytes) == READ_PARALLELISM_DEFAULTS["RUNAI_STREAMER_CHUNK_BYTESIZE"]
        else wanted.chunk_bytes,
    }


def _ours(settings: Settings) -> dict[str, tuple[int, str] | None]:
    """Each variable's value from our settings and its source: a setting of its own wins over
    ``target_gbps``."""
    own, derived = _read_parallelism(settings), _for_target(settings)
    target = f"target_gbps={settings.target_gbps}"
    return {
        name: (own[name], "settings") if own[name] is not None else (derived[name], target) if derived[name] is not None else None
        for name in own
    }


def read_parallelism_in_force(settings: Settings, environ: Mapping[str, str] = os.environ) -> dict[str, dict[str, str]]:
    """What Run:ai's reader will use for each read-parallelism variable, and where it comes from:
    ``environment`` (the operator set Run:ai's variable: it wins), ``settings`` (ours),
    ``target_gbps=N`` (derived from the NIC rate), or ``run:ai default``. Logged at start-up and
    reported by ``/readyz``, with the bytes a load keeps in flight. A ``RUNAI_STREAMER_CONCURRENCY``
    the operator set is Run:ai's fallback for the object-storage concurrency, so it is reported too."""
    ours = _ours(settings)
    report = {}
    for name, default in READ_PARALLELISM_DEFAULTS.items():
        if name in environ:
            report[name] = {"value": environ[name], "source": "environment"}
        elif name == "RUNAI_STREAMER_OBJ_CONCURRENCY" and "RUNAI_STREAMER_CONCURRENCY" in environ and ours[name][1] != "settings":
            report[name] = {"value": environ["RUNAI_STREAMER_CONCURRENCY"], "source": "environment (RUNAI_STREAMER_CONCURRENCY)"}
        elif ours[name] is not None:
            report[name] = {"value": str(ours[name][0]), "source": ours[name][1]}
        else:
            report[name] = {"value": default, "source": "run:ai default"}
    slot = slot_bytes(int(settings.shm_budget), int(settings.slot_size))
    report["bytes_in_flight"] = {
        "value": str(in_flight_bytes(settings.target_gbps, slot, int(settings.shm_budget))),
        "source": f"target_gbps={settings.target_gbps}",
    }
    return report


class ProcessEnvironment:
    """Run:ai's variables in ``os.environ`` while at least one reader is open, then restored.

    The native S3 client reads its settings from the environment when it is created, so this is
    the one boundary where we write ``os.environ``. A variable the operator set wins and
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


ENVIRONMENT = ProcessEnvironment()


class ObjectStoreInUse:
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


OBJECT_STORE = ObjectStoreInUse()


def check_credentials(uri: StorageURI, settings: Settings) -> None:
    """Refuse, before any read, a configuration Run:ai's reader cannot use: a second object store in
    this process (:class:`ObjectStoreInUse`), or Azure without an account name.

    Run:ai's Azure reader reads ``AZURE_STORAGE_ACCOUNT_NAME`` (with a key, a SAS token or
    workload identity) and ignores ``AZURE_STORAGE_CONNECTION_STRING``: with only a connection
    string every range would fail with "invalid parameters" after the listing succeeded.
    """
    OBJECT_STORE.check(uri)
    if uri.scheme is Scheme.AZURE and not settings.azure_storage_account_name:
        raise ConfigError(
            f"streaming {uri} needs AZURE_STORAGE_ACCOUNT_NAME (with AZURE_STORAGE_ACCOUNT_KEY, "
            "AZURE_STORAGE_SAS_TOKEN or workload identity): Run:ai's Azure reader ignores "
            "AZURE_STORAGE_CONNECTION_STRING",
            uri=uri.normalized,
        )
