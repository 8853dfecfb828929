"""The node's metadata cache: config, tokenizer and remote code of a checkpoint URI.

Layout under the cache root (``STREAMER_CACHE_DIR``)::

    <sha256 of normalized URI>/            the pulled files, as laid out under the prefix
    <sha256 of normalized URI>/.runai_complete   JSON: what was pulled, when, by which launch
    <sha256 of normalized URI>.lock        flock guarding pulls of that URI (beside, not inside;
                                           removed by a pull that cached nothing)
    .tmp-<sha256>-<pid>-<token>/           a pull in progress (removed if its puller died)

Correctness comes from a per-process temp dir renamed into place, with the
marker written last; the lock only keeps concurrent pullers from downloading
twice. A dir without a marker is incomplete and is replaced by the next pull.

Modes: every file is written with the access mode (``access.file_mode``: ``0600``, or ``0640``
with group access) less any bit its source lacks (a local ``0600`` file stays ``0600``), every
dir with ``access.dir_mode``; a cache dir of another mode (pulled under other settings) is
pulled again rather than reused.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import json
import logging
import os
import shutil
import socket
import stat
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path, PurePosixPath
from typing import NamedTuple

from streamer_client._launch import launch_origin, resolve_launch_id
from streamer_client._progress import bar
from streamer_client.errors import (
    CacheError,
    CheckpointError,
    ObjectChangedError,
    ObjectNotFoundError,
    StreamerError,
    UnsafeKeyError,
)

from ..access import dir_mode, file_mode
from ..settings import Settings
from ..storage import ObjectInfo, Storage, open_storage
from ..uri import StorageURI, parse_uri

__all__ = [
    "LOADER_PATTERNS",
    "MARKER",
    "WEIGHT_SUFFIXES",
    "MetadataCache",
    "Marker",
    "is_weight",
    "safe_relative_path",
    "wanted",
    "write_private",
]

log = logging.getLogger(__name__)

MARKER = ".runai_complete"
MARKER_VERSION = 1

# Files that hold weights (streamed, never pulled into the metadata cache).
WEIGHT_SUFFIXES = (
    ".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5", ".msgpack",
    ".tensors", ".onnx", ".onnx_data", ".ot", ".npz", ".pdparams",
)  # fmt: skip


# What loaders read besides weights (not "every file that is not a weight": that would pull
# TensorRT engines, .nemo archives, .npy and .pkl files). Matched against the base name. vLLM pulls
# a model's "*.json", "*.py" and "*.model"; transformers' tokenizers also read vocab and merges
# text, tiktoken files (Kimi, Qwen) and chat templates. STREAMER_METADATA_PATTERNS adds more.
LOADER_PATTERNS = (
    "*.json",  # config, generation config, tokenizer, preprocessor, the safetensors index
    "*.py",  # remote code (trust_remote_code)
    "*.model", "*.spm", "*.tiktoken", "*.vocab", "*.bpe",  # sentencepiece, tiktoken, BPE vocabularies
    "*.txt",  # merges.txt, vocab.txt
    "*.jinja", "*.jinja2",  # chat templates
    "tokenizer*",  # tokenizer files without a suffix
)  # fmt: skip


def is_weight(name: str) -> bool:
    return name.lower().endswith(WEIGHT_SUFFIXES)


def wanted(name: str, extra: Sequence[str] = ()) -> bool:
    """Whether a loader reads ``name`` (a key relative to the prefix): it goes into the metadata cache."""
    base = name.rsplit("/", 1)[-1]
    return not is_weight(name) and base != MARKER and any(fnmatch.fnmatchcase(base, p) for p in (*LOADER_PATTERNS, *extra))


def safe_relative_path(name: str, uri: str) -> PurePosixPath:
    """``name`` as a path that stays inside the cache dir, or :class:`UnsafeKeyError`.

    Keys are untrusted: refuse absolute paths, ``.``/``..`` and empty segments,
    backslashes (a path separator elsewhere), NUL and other control characters.
    """
    reason = None
    if not name:
        reason = "is empty"
    elif "\x00" in name:
        reason = "contains NUL"
    elif any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in name):
        reason = "contains control characters"
    elif "\\" in name:
        reason = "contains a backslash"
    elif name.startswith("/"):
        reason = "is absolute"
    else:
        parts = name.split("/")
        if any(p in ("", ".", "..") for p in parts):
            reason = "has an empty, '.' or '..' segment"
        elif any(len(p.encode()) > 255 for p in parts):
            reason = "has a segment longer than 255 bytes"
    if reason:
        raise UnsafeKeyError(f"refusing object key {name!r} under {uri}: it {reason}", uri=uri, key=name)
    return PurePosixPath(name)


class Marker(NamedTuple):
    """The parsed ``.runai_complete`` of a cache dir."""

    uri: str
    launch_id: str
    files: tuple[ObjectInfo, ...]
    weights: tuple[ObjectInfo, ...]
    pulled_at: str

    @classmethod
    def read(cls, cache_dir: Path) -> Marker | None:
        """The marker, or None when absent or unreadable (an unreadable marker means incomplete)."""
        try:
            data = json.loads((cache_dir / MARKER).read_text(encoding="utf-8"))
            if data.get("version") != MARKER_VERSION:
                return None
            return cls(
                uri=data["uri"],
                launch_id=data["launch_id"],
                files=tuple(ObjectInfo(**f) for f in data["files"]),
                weights=tuple(ObjectInfo(**f) for f in data["weights"]),
                pulled_at=data["pulled_at"],
            )
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def to_json(self) -> dict:
        def objs(items):
            return [{"name": o.name, "size": o.size, "etag": o.etag} for o in items]

        return {
            "version": MARKER_VERSION,
            "uri": self.uri,
            "launch_id": self.launch_id,
            "pulled_at": self.pulled_at,
            "pulled_by": {"host": socket.gethostname(), "pid": os.getpid()},
            "files": objs(self.files),
            "weights": objs(self.weights),
        }


class MetadataCache:
    """Pulls non-weight files of checkpoint URIs into ``settings.cache_dir``."""

    def __init__(self, settings: Settings, *, progress: str = "off") -> None:
        self.settings = settings
        self.progress = progress  # a bar of the files and bytes of each pull (the CLI's)
        self.root = Path(settings.cache_dir)
        self.file_mode = file_mode(settings)
        self.dir_mode = dir_mode(settings)
        self.downloads = 0  # pulls this object performed (0 after a cache hit)

    def dir_for(self, uri: StorageURI) -> Path:
        return self.root / uri.cache_key

    def lock_path(self, uri: StorageURI) -> Path:
        return self.root / f"{uri.cache_key}.lock"

    def pull(self, uri: str | StorageURI, *, force: bool | None = None, launch_id: str | None = None) -> Path:
        """Make the metadata of ``uri`` present locally; return its cache dir.

        With a complete cache this reads one small file and touches no storage.
        ``force`` (default: ``TRTLLM_OBJECT_STORAGE_FORCE_PULL``) re-downloads once per launch.
        """
        return self.pull_marker(uri, force=force, launch_id=launch_id)[0]

    def pull_marker(
        self,
        uri: str | StorageURI,
        *,
        force: bool | None = None,
        launch_id: str | None = None,
        stale: Marker | None = None,
    ) -> tuple[Path, Marker]:
        """:meth:`pull`, also returning the marker (the listing the catalog is built from).

        ``stale``: a marker found inconsistent with the checkpoint (a listing taken while an upload
        was incomplete): pulled again unless another process already replaced it.
        """
        if not isinstance(uri, StorageURI):
            uri = parse_uri(uri)
        force = self.settings.force_pull if force is None else force
        launch = resolve_launch_id(self.settings, launch_id)
        final = self.dir_for(uri)
        if (marker := self._usable(final, force, launch, stale)) is not None:
            return final, marker
        from .lock import FileLock  # only a pull takes the lock: a cache hit does not import it

        try:
            self.root.mkdir(mode=self.dir_mode, parents=True, exist_ok=True)
        except OSError as exc:
            raise CacheError(f"cannot create cache dir {self.root}: {exc.strerror}", uri=uri.normalized) from None
        lock = FileLock(
            self.lock_path(uri),
            timeout_s=self.settings.lock_timeout_s,
            log_interval_s=self.settings.lock_log_interval_s,
            what=uri.normalized,
            mode=self.file_mode,
        )
        with lock:
            # Look again: the process we waited for may have finished the work.
            if (marker := self._usable(final, force, launch, stale)) is not None:
                log.debug("metadata of %s pulled by another process; reusing %s", uri, final)
                return final, marker
            self._sweep(uri)
            try:
                with open_storage(uri, self.settings) as storage:
                    marker = self._pull_locked(uri, storage, final, launch)
            except BaseException:
                if not final.exists():
                    lock.discard()  # nothing of this URI is cached: nothing of it stays beside the cache either
                raise
        self.downloads += 1
        return final, marker

    def _usable(self, final: Path, force: bool, launch: str, stale: Marker | None = None) -> Marker | None:
        marker = Marker.read(final)
        if marker is None or (force and marker.launch_id != launch) or marker == stale:
            return None
        try:
            mode = stat.S_IMODE(final.stat().st_mode)
        except OSError:
            return None
        if mode != self.dir_mode:
            log.info(
                "pulling %s again: its cache dir %s has mode %o, this process writes %o", marker.uri, final, mode, self.dir_mode
            )
            return None
        if force:
            # Forcing is once per launch (DESIGN 4); say so, or a forced pull silently does nothing.
            log.info(
                "forced pull of %s skipped: launch %s (%s) already pulled it at %s; "
                "set STREAMER_LAUNCH_ID to a new value to pull again",
                marker.uri, launch, launch_origin(launch), marker.pulled_at,
            )  # fmt: skip
        return marker

    def _sweep(self, uri: StorageURI) -> None:
        """Remove temp and old dirs of ``uri`` left by dead pullers (we hold the lock: none is live)."""
        for stale in self.root.glob(f".*-{uri.cache_key}-*"):
            if stale.name.startswith((".tmp-", ".old-")):
                log.info("removing %s left by an interrupted pull of %s", stale, uri)
                shutil.rmtree(stale, ignore_errors=True)

    def _pull_locked(self, uri: StorageURI, storage: Storage, final: Path, launch: str) -> Marker:
        started = time.monotonic()
        objects = storage.list_objects()
        if not objects:
            raise self._nothing_under(uri)
        files = [o for o in objects if wanted(o.name, self.settings.metadata_patterns)]
        weights = [o for o in objects if is_weight(o.name)]
        skipped = len(objects) - len(files) - len(weights)
        # Validate every key and size before the first download: a bad key costs no transfer.
        paths = {o.name: safe_relative_path(o.name, uri.normalized) for o in files}
        _refuse_file_dir_clashes(paths, uri)
        self._check_sizes(files, uri)

        token = f"{os.getpid()}-{os.urandom(4).hex()}"  # secrets.token_hex's bytes, without importing hmac
        tmp = self.root / f".tmp-{uri.cache_key}-{token}"
        try:
            self._mkdir(tmp)
            total = 0
            with bar(total=sum(o.size for o in files), desc="pull", mode=self.progress) as shown:
                for i, obj in enumerate(files, 1):
                    written = self._download(storage, obj, tmp / paths[obj.name], uri)
                    total += written
                    shown.set_postfix_str(f"{i}/{len(files)} files", refresh=False)
                    shown.update(written)
            self._swap_in(tmp, final, uri, token)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        marker = Marker(
            uri=uri.normalized,
            launch_id=launch,
            files=tuple(files),
            weights=tuple(weights),
            pulled_at=datetime.now(timezone.utc).isoformat(timespec="milliseconds"),
        )
        self._write_marker(final, marker, uri)
        log.info(
            "pulled %d metadata files (%d bytes) of %s into %s in %.2f s (launch %s; %d files no loader reads left out)",
            len(files), total, uri, final, time.monotonic() - started, launch, skipped,
        )  # fmt: skip
        return marker

    def _nothing_under(self, uri: StorageURI) -> ObjectNotFoundError:
        """``no objects under``, or, when the URI names one object, that it should name its prefix."""
        if not uri.is_local and uri.prefix:
            parent_prefix, _, base = uri.prefix.rpartition("/")
            parent = StorageURI(uri.scheme, uri.bucket, parent_prefix, uri.original)
            try:
                with open_storage(parent, self.settings) as storage:
                    storage.stat(base)
            except StreamerError:
                pass  # not an object either (or not readable): the plain message
            else:
                return ObjectNotFoundError(
                    f"{uri} names one object, not a checkpoint: give the prefix it is under, {parent}",
                    uri=uri.normalized,
                )
        return ObjectNotFoundError(f"no objects under {uri}", uri=uri.normalized)

    def _check_sizes(self, files: Sequence[ObjectInfo], uri: StorageURI) -> None:
        most, total = int(self.settings.metadata_max_file_bytes), int(self.settings.metadata_max_total_bytes)
        for obj in files:
            if obj.size > most:
                raise CheckpointError(
                    f"refusing to pull {obj.name!r} of {uri}: {obj.size} bytes is over the per-file limit of "
                    f"{most} bytes (STREAMER_METADATA_MAX_FILE_BYTES); raise it if a loader needs this file",
                    uri=uri.normalized,
                    key=obj.name,
                )
        if (size := sum(o.size for o in files)) > total:
            largest = max(files, key=lambda o: o.size)
            raise CheckpointError(
                f"refusing to pull the metadata of {uri}: {len(files)} files of {size} bytes are over the limit of "
                f"{total} bytes (STREAMER_METADATA_MAX_TOTAL_BYTES); the largest is {largest.name!r} ({largest.size} bytes)",
                uri=uri.normalized,
                key=largest.name,
            )

    def _mkdir(self, path: Path) -> None:
        """``path`` and its missing parents with the dir mode, whatever the umask."""
        if not path.is_dir():
            self._mkdir(path.parent)
            path.mkdir(mode=self.dir_mode)
            os.chmod(path, self.dir_mode)

    def _download(self, storage: Storage, obj: ObjectInfo, dest: Path, uri: StorageURI) -> int:
        source = storage.permissions(obj)
        mode = self.file_mode if source is None else self.file_mode & source
        try:
            self._mkdir(dest.parent)
            # O_EXCL | O_NOFOLLOW: never write through a link or over another key's file.
            fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
            os.fchmod(fd, mode)  # exactly: the umask may have taken the group's bit
            with os.fdopen(fd, "wb") as out:
                written = storage.download(obj, out)
        except StreamerError:
            raise
        except OSError as exc:
            raise _cache_error(exc, f"cannot write {obj.name!r} of {uri} into {dest.parent}", uri, obj.name) from None
        if written != obj.size:
            raise ObjectChangedError(
                f"object {obj.name!r} of {uri} was {obj.size} bytes when listed but {written} when read",
                uri=uri.normalized,
                key=obj.name,
            )
        return written

    def _swap_in(self, tmp: Path, final: Path, uri: StorageURI, token: str) -> None:
        old = None
        if final.exists():
            # A previous (or forced-over, or incomplete) copy: move it aside, then rename ours in.
            old = self.root / f".old-{uri.cache_key}-{token}"
            os.rename(final, old)
        os.rename(tmp, final)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def _write_marker(self, final: Path, marker: Marker, uri: StorageURI) -> None:
        tmp = final / f"{MARKER}.tmp"
        try:
            write_private(tmp, json.dumps(marker.to_json(), indent=1).encode(), self.file_mode)
            os.rename(tmp, final / MARKER)
        except OSError as exc:
            raise _cache_error(exc, f"cannot write {MARKER} in {final}", uri, MARKER) from None


def write_private(path: Path, data: bytes, mode: int) -> None:
    """A new file of ``mode`` (exactly) holding ``data``; an existing one is replaced."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    with os.fdopen(fd, "wb") as out:
        os.fchmod(out.fileno(), mode)
        out.write(data)


def _refuse_file_dir_clashes(paths: dict[str, PurePosixPath], uri: StorageURI) -> None:
    """``a`` and ``a/b`` cannot both be files: refuse instead of failing half-way."""
    dirs = {str(parent) for path in paths.values() for parent in path.parents if str(parent) != "."}
    for name in paths:
        if name in dirs:
            raise UnsafeKeyError(
                f"refusing object key {name!r} under {uri}: another key uses it as a directory",
                uri=uri.normalized,
                key=name,
            )


def _cache_error(exc: OSError, what: str, uri: StorageURI, key: str) -> CacheError:
    reason = "no space left on the cache filesystem" if exc.errno == errno.ENOSPC else (exc.strerror or str(exc))
    return CacheError(f"{what}: {reason}", uri=uri.normalized, key=key)
