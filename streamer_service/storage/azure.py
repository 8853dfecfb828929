"""Azure Blob Storage through azure-storage-blob.

``az://container/prefix``. The storage account is not part of the URI; it comes
from ``AZURE_STORAGE_CONNECTION_STRING``, or from ``AZURE_STORAGE_ACCOUNT_NAME``
with ``AZURE_STORAGE_ACCOUNT_KEY`` or ``AZURE_STORAGE_SAS_TOKEN`` (the variables
Run:ai's Azure reader reads too). See docs/configuration.md.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import BinaryIO

from azure.core import MatchConditions
from azure.core import exceptions as aexc
from azure.storage.blob import BlobServiceClient, ExponentialRetry

from streamer_client.errors import ConfigError

from ..settings import Settings
from ..uri import StorageURI
from .base import ObjectInfo, Storage
from .errors import Failure, storage_error


class AzureStorage(Storage):
    def __init__(self, uri: StorageURI, settings: Settings) -> None:
        super().__init__(uri)
        options = dict(
            # The SDK's default first backoff is 15 s; a node waiting on a pod start wants seconds.
            retry_policy=ExponentialRetry(initial_backoff=0.5, increment_base=2, retry_total=settings.storage_retries),
            connection_timeout=settings.storage_connect_timeout_s,
            read_timeout=settings.storage_read_timeout_s,
        )
        self._settings = settings
        self._service = _service_client(uri, settings, options)
        self._container = self._service.get_container_client(uri.bucket)

    def _error(self, exc: Exception, key: str | None):
        code = getattr(exc, "error_code", None)
        status = getattr(exc, "status_code", None)
        if isinstance(exc, aexc.ResourceNotFoundError) or status == 404:
            kind = Failure.NO_BUCKET if (key is None or code == "ContainerNotFound") else Failure.NO_KEY
        elif isinstance(exc, aexc.ClientAuthenticationError) or status in (401, 403):
            kind = Failure.DENIED
        elif isinstance(exc, aexc.ResourceModifiedError) or status == 412:
            kind = Failure.CHANGED
        elif isinstance(exc, (aexc.ServiceRequestError, aexc.ServiceResponseError)):
            kind = Failure.UNAVAILABLE
        else:
            kind = Failure.OTHER
        detail = f"{type(exc).__name__}: {code or ''} {str(exc).splitlines()[0] if str(exc) else ''}".strip()
        credentials = _credentials_source(self._settings) if kind is Failure.DENIED else ""
        return storage_error(
            kind, uri=self.uri.normalized, bucket=self.uri.bucket, key=key, detail=detail, container=True, credentials=credentials
        )

    def _list_keys(self, prefix: str) -> Iterator[tuple[str, int, str]]:
        try:
            for blob in self._container.list_blobs(name_starts_with=prefix or None):
                yield blob.name, int(blob.size), blob.etag.strip('"')
        except aexc.AzureError as exc:
            raise self._error(exc, None) from None

    def stat(self, name: str) -> ObjectInfo:
        key = self.uri.key_for(name)
        try:
            props = self._container.get_blob_client(key).get_blob_properties()
        except aexc.AzureError as exc:
            raise self._error(exc, key) from None
        return ObjectInfo(name=name, size=int(props.size), etag=props.etag.strip('"'))

    def download(self, obj: ObjectInfo, dest: BinaryIO) -> int:
        key = self.uri.key_for(obj.name)
        try:
            stream = self._container.download_blob(key, etag=f'"{obj.etag}"', match_condition=MatchConditions.IfNotModified)
            return stream.readinto(dest)
        except aexc.AzureError as exc:
            raise self._error(exc, key) from None

    def read_range(self, name: str, offset: int, length: int) -> bytes:
        if length <= 0:
            return b""
        key = self.uri.key_for(name)
        try:
            return self._container.download_blob(key, offset=offset, length=length).readall()
        except aexc.HttpResponseError as exc:
            if exc.status_code == 416:
                return b""
            raise self._error(exc, key) from None
        except aexc.AzureError as exc:
            raise self._error(exc, key) from None

    def close(self) -> None:
        self._service.close()


def _credentials_source(settings: Settings) -> str:
    if settings.azure_storage_connection_string is not None:
        return "AZURE_STORAGE_CONNECTION_STRING"
    if settings.azure_storage_account_key is not None:
        return "AZURE_STORAGE_ACCOUNT_NAME with AZURE_STORAGE_ACCOUNT_KEY"
    if settings.azure_storage_sas_token is not None:
        return "AZURE_STORAGE_ACCOUNT_NAME with AZURE_STORAGE_SAS_TOKEN"
    return "AZURE_STORAGE_ACCOUNT_NAME without a key or SAS token (anonymous)"


def _service_client(uri: StorageURI, settings: Settings, options: dict) -> BlobServiceClient:
    conn = settings.azure_storage_connection_string
    try:
        if conn is not None:
            return BlobServiceClient.from_connection_string(conn.get_secret_value(), **options)
    except ValueError as exc:
        raise ConfigError(f"AZURE_STORAGE_CONNECTION_STRING is malformed ({exc}); needed for {uri}", uri=uri.normalized) from None
    account = settings.azure_storage_account_name
    if not account:
        raise ConfigError(
            f"no Azure storage account for {uri}: set AZURE_STORAGE_CONNECTION_STRING or "
            "AZURE_STORAGE_ACCOUNT_NAME (with AZURE_STORAGE_ACCOUNT_KEY or AZURE_STORAGE_SAS_TOKEN)",
            uri=uri.normalized,
        )
    # Same meaning as Run:ai's reader: the suffix includes "blob." and may carry a port.
    url = f"https://{account}.{settings.azure_storage_endpoint_suffix}"
    credential = None
    if settings.azure_storage_account_key is not None:
        credential = {"account_name": account, "account_key": settings.azure_storage_account_key.get_secret_value()}
    elif settings.azure_storage_sas_token is not None:
        credential = settings.azure_storage_sas_token.get_secret_value()
    return BlobServiceClient(url, credential=credential, **options)
