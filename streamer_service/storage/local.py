"""A local directory as a checkpoint store (the embedded default; no cloud)."""

from __future__ import annotations

import os
import stat as stat_mod
from typing import BinaryIO

from streamer_client.errors import (
    InvalidURIError,
    ObjectChangedError,
    ObjectNotFoundError,
    StorageAccessDeniedError,
    StorageError,
)

from ..settings import Settings
from ..uri import Scheme, StorageURI, parse_uri
from .base import ObjectInfo, Storage

_CHUNK = 8 * 1024 * 1024


def _version(st: os.stat_result) -> str:
    return f"{st.st_mtime_ns:x}-{st.st_size:x}"


class LocalStorage(Storage):
    """Files under a directory. Symlinks to regular files are followed: a Hugging Face cache
    snapshot is a tree of symlinks into ``blobs/``.

    With ``--allow`` prefixes (``settings.allow``), every path is resolved before it is used and
    one that leaves them (a symlinked file or directory pointing elsewhere) is refused, naming the
    entry: the prefix check on the URI alone let a symlink in an allowed dir make the daemon copy
    any file it can read into the shared cache. Opened files are checked by the path
    the kernel opened, so a link swapped after the check is caught too.
    """

    def __init__(self, uri: StorageURI, settings: Settings | None = None) -> None:
        super().__init__(uri)
        self.root = uri.prefix
        self._fence = _fence(settings)

    def _path(self, name: str) -> str:
        return os.path.join(self.root, *name.split("/"))

    def _inside(self, real: str) -> bool:
        return self._fence is None or any(real == top or real.startswith(top.rstrip("/") + "/") for top in self._fence)

    def _refuse(self, name: str) -> StorageAccessDeniedError:
        return StorageAccessDeniedError(
            f"refusing {name!r} under {self.root}: it resolves outside every --allow prefix "
            "(a symlink or '..' leading out of them)",
            uri=self.root,
            key=name,
        )

    def _check(self, name: str, path: str) -> None:
        if self._fence is not None and not self._inside(os.path.realpath(path)):
            raise self._refuse(name)

    def _check_open(self, name: str, fd: int) -> None:
        """The file behind ``fd`` (what the kernel opened, after every link) is inside the fence."""
        if self._fence is not None:
            try:
                real = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                real = os.path.realpath(self._path(name))
            if not self._inside(real):
                raise self._refuse(name)

    def list_objects(self) -> list[ObjectInfo]:
        if not os.path.isdir(self.root):
            raise ObjectNotFoundError(f"checkpoint directory {self.root} does not exist", uri=self.root)
        found: list[ObjectInfo] = []
        for dirpath, dirnames, filenames in os.walk(self.root, onerror=self._walk_error):
            dirnames.sort()
            for dirname in dirnames:  # os.walk does not descend into linked dirs; refuse the escaping ones
                link = os.path.join(dirpath, dirname)
                if os.path.islink(link):
                    self._check(os.path.relpath(link, self.root).replace(os.sep, "/"), link)
            for filename in sorted(filenames):  # the first bad entry named is the same each time
                path = os.path.join(dirpath, filename)
                name = os.path.relpath(path, self.root).replace(os.sep, "/")
                try:
                    st = os.stat(path)
                except (FileNotFoundError, NotADirectoryError):  # dangling symlink: not an object
                    continue
                except OSError as exc:  # a symlink loop, a file this user cannot reach
                    raise self._unreadable(name, exc) from None
                self._check(name, path)
                if not stat_mod.S_ISREG(st.st_mode):
                    continue
                found.append(ObjectInfo(name=name, size=st.st_size, etag=_version(st)))
        found.sort(key=lambda o: o.name)
        return found

    def _unreadable(self, name: str, exc: OSError) -> StorageError:
        """``name`` (``""``: the directory itself) cannot be read."""
        path, key = (self._path(name), name) if name else (self.root, None)
        if isinstance(exc, PermissionError):
            return StorageAccessDeniedError(f"cannot read {path}: permission denied", uri=self.root, key=key)
        return StorageError(f"cannot read {path}: {exc.strerror or exc}", uri=self.root, key=key)

    def _walk_error(self, exc: OSError) -> None:
        """A directory of the walk that cannot be listed: named like an unreadable file. One
        removed (or replaced by a file) while the walk went on holds no object, like a dangling link."""
        where = os.fsdecode(exc.filename) if exc.filename is not None else self.root
        if os.path.normpath(where) == os.path.normpath(self.root):
            if isinstance(exc, FileNotFoundError):
                raise ObjectNotFoundError(f"checkpoint directory {self.root} does not exist", uri=self.root)
            raise self._unreadable("", exc)
        if isinstance(exc, (FileNotFoundError, NotADirectoryError)):
            return
        raise self._unreadable(os.path.relpath(where, self.root).replace(os.sep, "/"), exc)

    def stat(self, name: str) -> ObjectInfo:
        path = self._path(name)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise ObjectNotFoundError(f"{self.uri.child(name)} does not exist", uri=self.root, key=name) from None
        except OSError as exc:
            raise self._unreadable(name, exc) from None
        self._check(name, path)
        return ObjectInfo(name=name, size=st.st_size, etag=_version(st))

    def download(self, obj: ObjectInfo, dest: BinaryIO) -> int:
        """Copy ``obj`` into ``dest``. An error reading the source names the object; one writing
        ``dest`` (the cache's) is raised as it is, for the cache to name."""
        path = self._path(obj.name)
        with self._open(obj.name, "disappeared during the pull") as src:
            if _version(os.fstat(src.fileno())) != obj.etag:
                raise ObjectChangedError(f"{path} changed since it was listed", uri=self.root, key=obj.name)
            written = 0
            while chunk := self._read(obj.name, src):
                dest.write(chunk)
                written += len(chunk)
        return written

    def permissions(self, obj: ObjectInfo) -> int | None:
        try:
            return stat_mod.S_IMODE(os.stat(self._path(obj.name)).st_mode)
        except FileNotFoundError:
            raise ObjectNotFoundError(
                f"{self._path(obj.name)} disappeared during the pull", uri=self.root, key=obj.name
            ) from None
        except OSError as exc:
            raise self._unreadable(obj.name, exc) from None

    def read_range(self, name: str, offset: int, length: int) -> bytes:
        with self._open(name, "does not exist") as src:
            try:
                return os.pread(src.fileno(), length, offset)
            except OSError as exc:
                raise self._unreadable(name, exc) from None

    def _open(self, name: str, gone: str) -> BinaryIO:
        """``name`` opened for reading, inside the fence; ``ObjectNotFoundError`` ("<path> <gone>")
        where it is missing, and the error of an unreadable file for any other failure."""
        path = self._path(name)
        try:
            src = open(path, "rb")  # returned open: the caller closes it
        except FileNotFoundError:
            raise ObjectNotFoundError(f"{path} {gone}", uri=self.root, key=name) from None
        except OSError as exc:  # a directory where a file was listed, a symlink loop, a refusal
            raise self._unreadable(name, exc) from None
        try:
            self._check_open(name, src.fileno())
        except BaseException:
            src.close()
            raise
        return src

    def _read(self, name: str, src: BinaryIO) -> bytes:
        try:
            return src.read(_CHUNK)
        except OSError as exc:
            raise self._unreadable(name, exc) from None


def _fence(settings: Settings | None) -> list[str] | None:
    """The resolved local ``--allow`` prefixes every opened path must stay under; None: no fence."""
    if settings is None or not settings.allow:
        return None
    tops = []
    for prefix in settings.allow:
        try:
            parsed = parse_uri(prefix)
        except InvalidURIError:
            continue  # a local prefix that does not exist holds nothing to read
        if parsed.scheme is Scheme.LOCAL:
            tops.append(parsed.prefix)
    return tops
