"""A local directory as a checkpoint store (the embedded default; no cloud)."""

from __future__ import annotations

import os
import stat as stat_mod
from typing import BinaryIO

from streamer_client.errors import ObjectChangedError, ObjectNotFoundError, StorageAccessDeniedError

from ..settings import Settings
from ..uri import StorageURI
from .base import ObjectInfo, Storage

_CHUNK = 8 * 1024 * 1024


def _version(st: os.stat_result) -> str:
    return f"{st.st_mtime_ns:x}-{st.st_size:x}"


class LocalStorage(Storage):
    """Files under a directory. Symlinks to regular files are followed: a Hugging Face cache
    snapshot is a tree of symlinks into ``blobs/``."""

    def __init__(self, uri: StorageURI, settings: Settings | None = None) -> None:
        super().__init__(uri)
        self.root = uri.prefix

    def _path(self, name: str) -> str:
        return os.path.join(self.root, *name.split("/"))

    def list_objects(self) -> list[ObjectInfo]:
        if not os.path.isdir(self.root):
            raise ObjectNotFoundError(f"checkpoint directory {self.root} does not exist", uri=self.root)
        found: list[ObjectInfo] = []
        for dirpath, dirnames, filenames in os.walk(self.root, onerror=self._walk_error):
            dirnames.sort()
            for filename in filenames:
                path = os.path.join(dirpath, filename)
                try:
                    st = os.stat(path)
                except FileNotFoundError:  # dangling symlink: not an object
                    continue
                if not stat_mod.S_ISREG(st.st_mode):
                    continue
                name = os.path.relpath(path, self.root).replace(os.sep, "/")
                found.append(ObjectInfo(name=name, size=st.st_size, etag=_version(st)))
        found.sort(key=lambda o: o.name)
        return found

    def _walk_error(self, exc: OSError) -> None:
        if isinstance(exc, PermissionError):
            raise StorageAccessDeniedError(f"cannot read {exc.filename}: permission denied", uri=self.root)
        raise exc

    def stat(self, name: str) -> ObjectInfo:
        try:
            st = os.stat(self._path(name))
        except FileNotFoundError:
            raise ObjectNotFoundError(f"{self.uri.child(name)} does not exist", uri=self.root, key=name) from None
        return ObjectInfo(name=name, size=st.st_size, etag=_version(st))

    def download(self, obj: ObjectInfo, dest: BinaryIO) -> int:
        path = self._path(obj.name)
        try:
            with open(path, "rb") as src:
                if _version(os.fstat(src.fileno())) != obj.etag:
                    raise ObjectChangedError(f"{path} changed since it was listed", uri=self.root, key=obj.name)
                written = 0
                while chunk := src.read(_CHUNK):
                    dest.write(chunk)
                    written += len(chunk)
        except FileNotFoundError:
            raise ObjectNotFoundError(f"{path} disappeared during the pull", uri=self.root, key=obj.name) from None
        except PermissionError:
            raise StorageAccessDeniedError(f"cannot read {path}: permission denied", uri=self.root, key=obj.name) from None
        return written

    def read_range(self, name: str, offset: int, length: int) -> bytes:
        path = self._path(name)
        try:
            with open(path, "rb") as src:
                return os.pread(src.fileno(), length, offset)
        except FileNotFoundError:
            raise ObjectNotFoundError(f"{path} does not exist", uri=self.root, key=name) from None
