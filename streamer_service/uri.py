"""Checkpoint URIs: parse, validate and normalize.

Accepted forms::

    s3://bucket/prefix        gs://bucket/prefix        az://container/prefix
    /abs/or/relative/dir      file:///abs/dir

The normalized form (no trailing slash, no doubled slashes, local paths made
absolute and resolved) is what the metadata cache hashes, so ``s3://b/m/`` and
``s3://b/m`` share one cache dir.
"""

from __future__ import annotations

import enum
import hashlib
import os
import re
from pathlib import Path
from typing import NamedTuple

from streamer_client.errors import InvalidURIError

__all__ = ["Scheme", "StorageURI", "parse_uri"]


class Scheme(str, enum.Enum):
    S3 = "s3"
    GCS = "gs"
    AZURE = "az"
    LOCAL = "file"


# Bucket / container names: what S3, GCS and Azure accept in common, plus '_' (GCS).
# Checked here so a typo fails with our message before any SDK sees it.
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]$")
_CLOUD_RE = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://(?P<rest>.*)$", re.DOTALL)


class StorageURI(NamedTuple):
    """A validated checkpoint location.

    ``bucket`` is the bucket or container ('' for local dirs); ``prefix`` has
    no leading or trailing slash ('' means the whole bucket); for local dirs
    ``prefix`` is the absolute resolved path.
    """

    scheme: Scheme
    bucket: str
    prefix: str
    original: str

    @property
    def normalized(self) -> str:
        if self.scheme is Scheme.LOCAL:
            return self.prefix
        tail = f"/{self.prefix}" if self.prefix else ""
        return f"{self.scheme.value}://{self.bucket}{tail}"

    @property
    def bucket_word(self) -> str:
        """What the storage calls ``bucket``, for messages: Azure's is a container."""
        return bucket_word(self.scheme)

    @property
    def is_local(self) -> bool:
        return self.scheme is Scheme.LOCAL

    @property
    def cache_key(self) -> str:
        """sha256 of the normalized URI: the name of this URI's metadata cache dir."""
        return hashlib.sha256(self.normalized.encode("utf-8")).hexdigest()

    def key_for(self, name: str) -> str:
        """The object key (or local path) of ``name``, relative to the prefix."""
        if self.scheme is Scheme.LOCAL:
            return os.path.join(self.prefix, name)
        return f"{self.prefix}/{name}" if self.prefix else name

    def child(self, name: str) -> str:
        """The full URI of ``name`` under this prefix (what Run:ai is given)."""
        if self.scheme is Scheme.LOCAL:
            return os.path.join(self.prefix, name)
        return f"{self.scheme.value}://{self.bucket}/{self.key_for(name)}"

    def __str__(self) -> str:
        return self.normalized


def bucket_word(scheme: Scheme) -> str:
    return "container" if scheme is Scheme.AZURE else "bucket"


def _has_control(text: str) -> bool:
    return any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in text)


def parse_uri(uri: str | os.PathLike, *, resolve: bool = True) -> StorageURI:
    """Parse ``uri`` or raise :class:`InvalidURIError` naming it and the reason.

    ``resolve=False``: no filesystem call; a local path is made absolute and normalized by its
    text alone (``..`` removed, links not followed, existence not checked).
    """
    if isinstance(uri, os.PathLike):
        uri = os.fspath(uri)
    if not isinstance(uri, str):
        raise InvalidURIError(f"checkpoint URI must be a string, got {type(uri).__name__}: {uri!r}")
    text = uri.strip()
    if not text:
        raise InvalidURIError("checkpoint URI is empty", uri=uri)
    if "\x00" in text or _has_control(text):
        raise InvalidURIError(f"checkpoint URI {uri!r} contains control characters", uri=uri)

    match = _CLOUD_RE.match(text)
    if match is None:
        return _local(text, uri, resolve)
    scheme_text = match.group("scheme").lower()
    rest = match.group("rest")
    if scheme_text == "file":
        if not rest.startswith("/"):
            raise InvalidURIError(f"file URI {uri!r} must hold an absolute path (file:///dir)", uri=uri)
        return _local(rest, uri, resolve)
    try:
        scheme = Scheme(scheme_text)
    except ValueError:
        raise InvalidURIError(
            f"unsupported URI scheme {scheme_text + '://'!r} in {uri!r}: use s3://, gs://, az:// or a local directory",
            uri=uri,
        ) from None
    if scheme is Scheme.LOCAL:  # pragma: no cover - 'file' handled above
        return _local(rest, uri, resolve)
    if "?" in rest or "#" in rest:
        raise InvalidURIError(
            f"checkpoint URI {uri!r} has a query or fragment; give only {bucket_word(scheme)} and prefix", uri=uri
        )
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise InvalidURIError(f"checkpoint URI {uri!r} names no {bucket_word(scheme)}", uri=uri)
    if not bucket.isascii() or not _BUCKET_RE.match(bucket) or ".." in bucket:
        raise InvalidURIError(
            f"invalid {bucket_word(scheme)} name {bucket!r} in {uri!r} (3-222 characters of a-z, 0-9, '.', '-', '_')",
            uri=uri,
        )
    parts = [p for p in prefix.split("/") if p]
    if any(p in (".", "..") for p in parts):
        raise InvalidURIError(f"checkpoint URI {uri!r} contains '.' or '..' path segments", uri=uri)
    if "\\" in prefix:
        raise InvalidURIError(f"checkpoint URI {uri!r} contains a backslash", uri=uri)
    return StorageURI(scheme=scheme, bucket=bucket, prefix="/".join(parts), original=uri)


def _local(path_text: str, uri: str, resolve: bool = True) -> StorageURI:
    path = Path(os.path.expanduser(path_text))
    if not resolve:
        return StorageURI(scheme=Scheme.LOCAL, bucket="", prefix=os.path.normpath(os.path.abspath(path)), original=uri)
    try:
        resolved = path.resolve(strict=True)
    except (FileNotFoundError, NotADirectoryError):
        raise InvalidURIError(
            f"checkpoint directory {uri!r} does not exist (not an s3://, gs:// or az:// URI either)",
            uri=uri,
        ) from None
    except OSError as exc:
        raise InvalidURIError(f"cannot resolve checkpoint directory {uri!r}: {exc.strerror}", uri=uri) from None
    if not resolved.is_dir():
        raise InvalidURIError(f"checkpoint path {uri!r} is not a directory", uri=uri)
    return StorageURI(scheme=Scheme.LOCAL, bucket="", prefix=str(resolved), original=uri)
