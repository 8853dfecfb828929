"""Amazon S3 and S3-compatible stores through botocore (boto3's client library).

The endpoint comes from boto3's own configuration (``AWS_ENDPOINT_URL``,
``AWS_ENDPOINT_URL_S3``, profiles), credentials from its standard chain.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from typing import BinaryIO, TypeVar

import botocore.exceptions as bexc
import botocore.loaders
import botocore.session
from botocore.config import Config

from ..settings import Settings
from ..uri import StorageURI
from .base import ObjectInfo, Storage
from .errors import Failure, storage_error

_CHUNK = 8 * 1024 * 1024
_NO_KEY = {"NoSuchKey", "404", "NotFound"}
_DENIED = {"AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "AllAccessDisabled"}
_BUSY = {"SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout", "503", "500"}
_UNAVAILABLE = (
    bexc.EndpointConnectionError,
    bexc.ConnectTimeoutError,
    bexc.ReadTimeoutError,
    bexc.ConnectionClosedError,
    bexc.ProxyConnectionError,
    bexc.ResponseStreamingError,
    bexc.IncompleteReadError,
)
# A response body cut short (connection reset, fewer bytes than Content-Length, a read timeout
# mid-body). botocore retries a request only until its headers arrive; these come later, from
# reading the body, so _body_retries retries them.
_BODY_ERRORS = (
    bexc.ResponseStreamingError,
    bexc.IncompleteReadError,
    bexc.ReadTimeoutError,
    bexc.ConnectionClosedError,
)
_T = TypeVar("_T")
# botocore's credential provider ``method`` names, as an operator would look for them.
_CREDENTIAL_METHODS = {
    "env": "environment variables AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY",
    "shared-credentials-file": "the shared credentials file (AWS_SHARED_CREDENTIALS_FILE, ~/.aws/credentials)",
    "config-file": "the AWS config file (AWS_CONFIG_FILE, ~/.aws/config)",
    "assume-role": "an assumed role from the AWS config file",
    "assume-role-with-web-identity": "a web identity token (AWS_WEB_IDENTITY_TOKEN_FILE, e.g. EKS IRSA)",
    "container-role": "the container credentials endpoint (ECS, EKS Pod Identity)",
    "iam-role": "the EC2 instance role (instance metadata)",
    "sso": "AWS SSO (the AWS config file)",
}


@functools.cache
def _models() -> botocore.loaders.Loader:
    return botocore.loaders.create_loader()


def _session() -> botocore.session.Session:
    """A session of its own (credentials and configuration resolved afresh, as boto3's default
    session resolves them) that reads service models through the process's one loader: a session's
    own loader parses the S3 model again for every client made."""
    session = botocore.session.get_session()
    session.register_component("data_loader", _models())
    return session


def prepare() -> None:
    """Make and drop a client with placeholder credentials and region: loads what every client of
    this process shares (botocore's client modules, the S3 model and endpoint rules, through the
    process's one loader) without a credential lookup or a request."""
    _session().create_client("s3", region_name="us-east-1", aws_access_key_id="prepare", aws_secret_access_key="prepare").close()


class S3Storage(Storage):
    def __init__(self, uri: StorageURI, settings: Settings) -> None:
        super().__init__(uri)
        config = Config(
            retries={"max_attempts": settings.storage_retries + 1, "mode": "standard"},
            connect_timeout=settings.storage_connect_timeout_s,
            read_timeout=settings.storage_read_timeout_s,
            s3={"addressing_style": settings.s3_addressing_style},
        )
        self._session = _session()
        self._client = self._session.create_client("s3", config=config)
        self._bucket = uri.bucket
        self._retries = settings.storage_retries

    def _body_retries(self, request: Callable[[], _T]) -> _T:
        """``request()`` (one GET and the read of its body), again after a body error."""
        for attempt in range(self._retries):
            try:
                return request()
            except _BODY_ERRORS:
                time.sleep(min(0.05 * 2**attempt, 1.0))
        return request()

    def _error(self, exc: Exception, key: str | None):
        if isinstance(exc, bexc.NoCredentialsError):
            kind, detail = Failure.DENIED, "no AWS credentials found"
        elif isinstance(exc, _UNAVAILABLE):
            kind, detail = Failure.UNAVAILABLE, str(exc)
        elif isinstance(exc, bexc.ClientError):
            code = str(exc.response.get("Error", {}).get("Code", ""))
            detail = f"{code}: {exc.response.get('Error', {}).get('Message', '')}".strip(": ")
            if code == "NoSuchBucket":
                kind = Failure.NO_BUCKET
            elif code in _NO_KEY:
                kind = Failure.NO_KEY
            elif code in _BUSY or exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) >= 500:
                kind = Failure.UNAVAILABLE  # still failing after botocore's retries
            elif code in _DENIED:
                kind = Failure.DENIED
            elif code in {"PreconditionFailed", "412"}:
                kind = Failure.CHANGED
            else:
                kind = Failure.OTHER
        else:
            kind, detail = Failure.OTHER, f"{type(exc).__name__}: {exc}"
        credentials = self._credentials_source() if kind is Failure.DENIED else ""
        return storage_error(kind, uri=self.uri.normalized, bucket=self._bucket, key=key, detail=detail, credentials=credentials)

    def _credentials_source(self) -> str:
        """Where boto3 found the credentials it signed with (botocore's provider ``method``)."""
        try:
            found = self._session.get_credentials()
        except bexc.BotoCoreError:
            found = None
        if found is None:
            return "none found (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, a web identity or an instance role)"
        return _CREDENTIAL_METHODS.get(found.method, f"botocore provider {found.method!r}")

    def _list_keys(self, prefix: str) -> Iterator[tuple[str, int, str]]:
        try:
            pages = self._client.get_paginator("list_objects_v2").paginate(Bucket=self._bucket, Prefix=prefix)
            for page in pages:
                for item in page.get("Contents", []):
                    yield item["Key"], int(item["Size"]), item["ETag"].strip('"')
        except (bexc.BotoCoreError, bexc.ClientError) as exc:
            raise self._error(exc, None) from None

    def stat(self, name: str) -> ObjectInfo:
        key = self.uri.key_for(name)
        try:
            head = self._client.head_object(Bucket=self._bucket, Key=key)
        except (bexc.BotoCoreError, bexc.ClientError) as exc:
            raise self._error(exc, key) from None
        return ObjectInfo(name=name, size=int(head["ContentLength"]), etag=head["ETag"].strip('"'))

    def download(self, obj: ObjectInfo, dest: BinaryIO) -> int:
        key = self.uri.key_for(obj.name)
        start = dest.tell()

        def attempt() -> int:
            dest.seek(start)
            dest.truncate()  # a retry starts the file over
            written = 0
            # If-Match: an object replaced after the listing fails with 412 instead of mixing versions.
            body = self._client.get_object(Bucket=self._bucket, Key=key, IfMatch=f'"{obj.etag}"')["Body"]
            for chunk in body.iter_chunks(_CHUNK):
                dest.write(chunk)
                written += len(chunk)
            return written

        try:
            return self._body_retries(attempt)
        except (bexc.BotoCoreError, bexc.ClientError) as exc:
            raise self._error(exc, key) from None

    def read_range(self, name: str, offset: int, length: int) -> bytes:
        if length <= 0:
            return b""
        key = self.uri.key_for(name)
        try:
            ranged = f"bytes={offset}-{offset + length - 1}"
            return self._body_retries(lambda: self._client.get_object(Bucket=self._bucket, Key=key, Range=ranged)["Body"].read())
        except bexc.ClientError as exc:
            if exc.response.get("Error", {}).get("Code") == "InvalidRange":
                return b""
            raise self._error(exc, key) from None
        except bexc.BotoCoreError as exc:
            raise self._error(exc, key) from None

    def close(self) -> None:
        self._client.close()
