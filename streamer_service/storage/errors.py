"""Turning cloud SDK exceptions into our error tree, one mapping shared by all backends.

Each backend classifies its SDK's exception into a :class:`Failure` kind; this
module turns the kind into the error class with a message naming the URI and key.
"""

from __future__ import annotations

import enum

from streamer_client.errors import (
    ObjectChangedError,
    ObjectNotFoundError,
    StorageAccessDeniedError,
    StorageError,
    StorageUnavailableError,
)


class Failure(enum.Enum):
    NO_BUCKET = "no_bucket"
    NO_KEY = "no_key"
    DENIED = "denied"
    UNAVAILABLE = "unavailable"
    CHANGED = "changed"
    OTHER = "other"


def storage_error(
    kind: Failure, *, uri: str, bucket: str, key: str | None, detail: str, container: bool = False, credentials: str = ""
) -> StorageError:
    """The error to raise for a failed request on ``key`` (None: a listing) of ``uri``.

    ``container``: the storage calls its buckets containers (Azure); ``credentials``: where the
    credentials in use came from, named in an access-denied message.
    """
    what = f"{key!r} of {uri}" if key is not None else uri
    if kind is Failure.NO_BUCKET:
        word = "container" if container else "bucket"
        return ObjectNotFoundError(f"{word} {bucket!r} does not exist ({uri}): {detail}", uri=uri, key=key)
    if kind is Failure.NO_KEY:
        return ObjectNotFoundError(f"object {what} does not exist: {detail}", uri=uri, key=key)
    if kind is Failure.DENIED:
        source = f"credentials: {credentials}; check them" if credentials else "check the credentials for this storage"
        return StorageAccessDeniedError(f"access denied to {what}: {detail} ({source})", uri=uri, key=key)
    if kind is Failure.UNAVAILABLE:
        return StorageUnavailableError(
            f"storage endpoint unreachable or too slow for {what}: {detail} (check the endpoint setting)",
            uri=uri,
            key=key,
        )
    if kind is Failure.CHANGED:
        return ObjectChangedError(f"object {what} changed while it was being read: {detail}", uri=uri, key=key)
    return StorageError(f"storage request for {what} failed: {detail}", uri=uri, key=key)
