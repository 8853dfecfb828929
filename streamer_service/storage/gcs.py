"""Google Cloud Storage through google-cloud-storage.

Credentials come from Application Default Credentials; ``STORAGE_EMULATOR_HOST``
points the client at an emulator (and makes it anonymous, as the SDK does).
The version token is the object's generation, which If-Match-style reads use.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import BinaryIO

import requests
from google.api_core import exceptions as gexc
from google.api_core.retry import Retry
from google.auth import exceptions as auth_exc
from google.cloud import storage as gcs
from google.cloud.storage.retry import DEFAULT_RETRY

from ..settings import Settings
from ..uri import StorageURI
from .base import ObjectInfo, Storage
from .errors import Failure, storage_error

_UNAVAILABLE = (
    requests.exceptions.ConnectionError,
    requests.exceptions.Timeout,
    auth_exc.TransportError,
    gexc.RetryError,
    gexc.ServiceUnavailable,
    gexc.GatewayTimeout,
)


class GCSStorage(Storage):
    def __init__(self, uri: StorageURI, settings: Settings) -> None:
        super().__init__(uri)
        self._timeout = (settings.storage_connect_timeout_s, settings.storage_read_timeout_s)
        # The SDK's default retry keeps trying for 120 s; bound it by our settings instead.
        self._retry: Retry = DEFAULT_RETRY.with_timeout(settings.storage_retry_deadline_s)
        try:
            self._client = gcs.Client()
        except auth_exc.DefaultCredentialsError as exc:
            raise storage_error(
                Failure.DENIED, uri=uri.normalized, bucket=uri.bucket, key=None, detail=f"no Google credentials: {exc}"
            ) from None
        self._bucket = self._client.bucket(uri.bucket)

    def _error(self, exc: Exception, key: str | None):
        if isinstance(exc, gexc.NotFound):
            kind = Failure.NO_BUCKET if key is None else Failure.NO_KEY
        elif isinstance(exc, (gexc.Forbidden, gexc.Unauthorized, auth_exc.DefaultCredentialsError, auth_exc.RefreshError)):
            kind = Failure.DENIED
        elif isinstance(exc, gexc.PreconditionFailed):
            kind = Failure.CHANGED
        elif isinstance(exc, _UNAVAILABLE):
            kind = Failure.UNAVAILABLE
        else:
            kind = Failure.OTHER
        detail = getattr(exc, "message", None) or str(exc)
        credentials = self._credentials_source() if kind is Failure.DENIED else ""
        return storage_error(
            kind,
            uri=self.uri.normalized,
            bucket=self.uri.bucket,
            key=key,
            detail=f"{type(exc).__name__}: {detail}",
            credentials=credentials,
        )

    def _credentials_source(self) -> str:
        """The Application Default Credentials the client holds, by kind (and account, where known)."""
        found = getattr(self._client, "_credentials", None)
        kind = type(found).__name__
        if kind == "AnonymousCredentials":
            return "anonymous (STORAGE_EMULATOR_HOST or no Application Default Credentials)"
        account = getattr(found, "service_account_email", None)
        where = f"{type(found).__module__}.{kind}"
        return f"Application Default Credentials, {where}" + (f" for {account}" if account and account != "default" else "")

    def _list_keys(self, prefix: str) -> Iterator[tuple[str, int, str]]:
        try:
            for blob in self._client.list_blobs(self._bucket, prefix=prefix or None, retry=self._retry, timeout=self._timeout):
                yield blob.name, int(blob.size), str(blob.generation)
        except Exception as exc:  # noqa: BLE001 - every SDK failure is mapped, none escapes raw
            raise self._error(exc, None) from None

    def stat(self, name: str) -> ObjectInfo:
        key = self.uri.key_for(name)
        try:
            blob = self._bucket.get_blob(key, retry=self._retry, timeout=self._timeout)
        except Exception as exc:  # noqa: BLE001
            raise self._error(exc, key) from None
        if blob is None:
            raise self._error(gexc.NotFound(f"{key} not found"), key)
        return ObjectInfo(name=name, size=int(blob.size), etag=str(blob.generation))

    def download(self, obj: ObjectInfo, dest: BinaryIO) -> int:
        key = self.uri.key_for(obj.name)
        start = dest.tell()
        try:
            self._bucket.blob(key).download_to_file(
                dest, if_generation_match=int(obj.etag), retry=self._retry, timeout=self._timeout
            )
        except Exception as exc:  # noqa: BLE001
            raise self._error(exc, key) from None
        return dest.tell() - start

    def read_range(self, name: str, offset: int, length: int) -> bytes:
        if length <= 0:
            return b""
        key = self.uri.key_for(name)
        try:
            return self._bucket.blob(key).download_as_bytes(
                start=offset, end=offset + length - 1, retry=self._retry, timeout=self._timeout, checksum=None
            )
        except gexc.RequestRangeNotSatisfiable:
            return b""
        except Exception as exc:  # noqa: BLE001
            raise self._error(exc, key) from None

    def close(self) -> None:
        self._client.close()
