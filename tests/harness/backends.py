"""Storage backends for tests: one object per test, over a local dir or a cloud emulator.

A :class:`Backend` gives a test a fresh bucket/container (or directory) and

- ``uri(prefix)``: the URI the code under test is given;
- ``put/put_tree/get/delete/keys``: fixture setup and checks that talk to the emulator
  DIRECTLY (never through the proxy, so they are not counted and no fault hits them);
- ``env``: the variables the code under test needs, pointing at the counting PROXY;
- ``proxy``: the :class:`~tests.harness.proxy.CountingProxy` (``None`` for local).

The ``*Service`` classes are the session-wide part: one emulator + one proxy + one direct
SDK client each.
"""

from __future__ import annotations

import itertools
import shutil
import socket
import uuid
from pathlib import Path

from .emulators import (
    AZURITE_ACCOUNT,
    AZURITE_KEY,
    HOST,
    EmulatorProcess,
    start_azurite,
    start_fake_gcs,
    start_moto,
)
from .proxy import CountingProxy

__all__ = [
    "Backend",
    "LocalBackend",
    "S3Backend",
    "GcsBackend",
    "AzureBackend",
    "S3Service",
    "GcsService",
    "AzureService",
    "unique_bucket_name",
    "closed_port_url",
    "azurite_connection_string",
]

_counter = itertools.count()


def unique_bucket_name() -> str:
    """Valid for S3, GCS and Azure: lowercase letters/digits/single hyphens, 3-63 chars."""
    return f"st-{next(_counter)}-{uuid.uuid4().hex[:12]}"


# A socket bound but never listening: connecting to its port is refused (RST) at once, and no
# other process can take the port while this test session runs.
_closed_sock: socket.socket | None = None


def closed_port_url() -> str:
    global _closed_sock
    if _closed_sock is None:
        _closed_sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        _closed_sock.bind((HOST, 0))
    return f"http://{HOST}:{_closed_sock.getsockname()[1]}"


def azurite_connection_string(endpoint: str) -> str:
    """Connection string for Azurite's well-known account at ``endpoint`` (``http://host:port``)."""
    return (
        "DefaultEndpointsProtocol=http;"
        f"AccountName={AZURITE_ACCOUNT};AccountKey={AZURITE_KEY};"
        f"BlobEndpoint={endpoint}/{AZURITE_ACCOUNT};"
    )


def _join(prefix: str, rel: str) -> str:
    prefix = prefix.strip("/")
    return f"{prefix}/{rel.lstrip('/')}" if prefix else rel.lstrip("/")


class Backend:
    """Common API; see the module docstring."""

    name: str
    scheme: str = ""
    bucket: str = ""
    proxy: CountingProxy | None = None
    env: dict[str, str]

    def uri(self, prefix: str) -> str:
        return f"{self.scheme}://{self.bucket}/{prefix.lstrip('/')}"

    def put(self, key: str, data: bytes) -> None:
        raise NotImplementedError

    def put_tree(self, prefix: str, files: dict[str, bytes]) -> None:
        for rel, data in files.items():
            self.put(_join(prefix, rel), data)

    def get(self, key: str) -> bytes:
        raise NotImplementedError

    def delete(self, key: str) -> None:
        raise NotImplementedError

    def keys(self, prefix: str = "") -> list[str]:
        """Sorted keys (relative to the bucket / local root) starting with ``prefix``."""
        raise NotImplementedError

    def unreachable_env(self) -> dict[str, str]:
        """``env`` with the endpoint pointed at a closed 127.0.0.1 port (connection refused)."""
        return {}

    def close(self) -> None:
        """Delete the bucket/container and everything in it (best effort)."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} bucket={self.bucket!r}>"


# --------------------------------------------------------------------------- local


class LocalBackend(Backend):
    name = "local"

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.env = {}

    def uri(self, prefix: str) -> str:
        path = self.root / prefix.strip("/")
        path.mkdir(parents=True, exist_ok=True)
        return str(path)

    def _path(self, key: str) -> Path:
        return self.root / key.lstrip("/")

    def put(self, key: str, data: bytes) -> None:
        p = self._path(key)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)

    def get(self, key: str) -> bytes:
        return self._path(key).read_bytes()

    def delete(self, key: str) -> None:
        self._path(key).unlink()

    def keys(self, prefix: str = "") -> list[str]:
        out = []
        for p in self.root.rglob("*"):
            if p.is_file():
                rel = p.relative_to(self.root).as_posix()
                if rel.startswith(prefix):
                    out.append(rel)
        return sorted(out)

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


# --------------------------------------------------------------------------- services


class _Service:
    """One emulator + the counting proxy in front of it, for the whole session."""

    emulator: EmulatorProcess
    proxy: CountingProxy

    def new_backend(self) -> Backend:
        raise NotImplementedError

    def stop(self) -> None:
        try:
            self.proxy.stop()
        finally:
            self.emulator.stop()

    def _fresh_proxy(self) -> CountingProxy:
        self.proxy.delay_s = 0.0
        self.proxy.fault = None
        self.proxy.reset()
        return self.proxy


class S3Service(_Service):
    def __init__(self, log_dir: Path | None = None) -> None:
        import boto3
        from botocore.config import Config

        self.emulator = start_moto(log_dir=log_dir)
        try:
            self.proxy = CountingProxy(self.emulator.endpoint).start()
            self.client = boto3.client(
                "s3",
                endpoint_url=self.emulator.endpoint,
                region_name="us-east-1",
                aws_access_key_id="testing",
                aws_secret_access_key="testing",
                config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 3}),
            )
        except BaseException:
            self.emulator.stop()
            raise

    def env_for(self, endpoint: str) -> dict[str, str]:
        return {
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
            "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0",
        }

    def new_backend(self) -> S3Backend:
        return S3Backend(self)


class GcsService(_Service):
    def __init__(self, log_dir: Path | None = None) -> None:
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        # The proxy is bound first: fake-gcs-server builds mediaLink (single-object GET) from
        # -external-url and routes XML-API requests only for -public-host, so both name the
        # proxy; the proxy forwards Host unchanged.
        self.proxy = CountingProxy(f"http://{HOST}:1")
        try:
            self.emulator = start_fake_gcs(log_dir=log_dir, public_url=self.proxy.url)
        except BaseException:
            self.proxy.stop()
            raise
        try:
            self.proxy.set_upstream(self.emulator.endpoint)
            self.proxy.start()
            self.client = storage.Client(
                project="test",
                credentials=AnonymousCredentials(),
                client_options={"api_endpoint": self.emulator.endpoint},
            )
        except BaseException:
            self.stop()
            raise

    def env_for(self, endpoint: str) -> dict[str, str]:
        return {
            "STORAGE_EMULATOR_HOST": endpoint,
            "CLOUD_STORAGE_EMULATOR_ENDPOINT": endpoint,
            "GOOGLE_CLOUD_PROJECT": "test",
        }

    def new_backend(self) -> GcsBackend:
        return GcsBackend(self)


class AzureService(_Service):
    def __init__(self, log_dir: Path | None = None) -> None:
        from azure.storage.blob import BlobServiceClient

        self.emulator = start_azurite(log_dir=log_dir)
        try:
            self.proxy = CountingProxy(self.emulator.endpoint).start()
            self.client = BlobServiceClient.from_connection_string(azurite_connection_string(self.emulator.endpoint))
        except BaseException:
            self.emulator.stop()
            raise

    def env_for(self, endpoint: str) -> dict[str, str]:
        return {
            "AZURE_STORAGE_CONNECTION_STRING": azurite_connection_string(endpoint),
            "AZURE_STORAGE_ACCOUNT_NAME": AZURITE_ACCOUNT,
            "AZURE_STORAGE_ACCOUNT_KEY": AZURITE_KEY,
        }

    def new_backend(self) -> AzureBackend:
        return AzureBackend(self)


# --------------------------------------------------------------------------- cloud backends


class _CloudBackend(Backend):
    def __init__(self, service) -> None:
        self.service = service
        self.bucket = unique_bucket_name()
        self._create()
        self.proxy = service._fresh_proxy()
        self.env = service.env_for(self.proxy.url)

    def _create(self) -> None:
        raise NotImplementedError

    def unreachable_env(self) -> dict[str, str]:
        return self.service.env_for(closed_port_url())


class S3Backend(_CloudBackend):
    name = "s3"
    scheme = "s3"

    def _create(self) -> None:
        self.service.client.create_bucket(Bucket=self.bucket)

    def put(self, key: str, data: bytes) -> None:
        self.service.client.put_object(Bucket=self.bucket, Key=key, Body=data)

    def get(self, key: str) -> bytes:
        return self.service.client.get_object(Bucket=self.bucket, Key=key)["Body"].read()

    def delete(self, key: str) -> None:
        self.service.client.delete_object(Bucket=self.bucket, Key=key)

    def keys(self, prefix: str = "") -> list[str]:
        pages = self.service.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
        return sorted(o["Key"] for page in pages for o in page.get("Contents", []))

    def close(self) -> None:
        client = self.service.client
        try:
            keys = self.keys()
            for i in range(0, len(keys), 1000):
                client.delete_objects(
                    Bucket=self.bucket,
                    Delete={"Objects": [{"Key": k} for k in keys[i : i + 1000]], "Quiet": True},
                )
            client.delete_bucket(Bucket=self.bucket)
        except Exception:
            pass


class GcsBackend(_CloudBackend):
    name = "gcs"
    scheme = "gs"

    def _create(self) -> None:
        self._bucket = self.service.client.create_bucket(self.bucket)

    def put(self, key: str, data: bytes) -> None:
        # Objects over 8 MiB go through a resumable upload; its Location header is built from
        # the request's Host, so it stays on the direct endpoint.
        self._bucket.blob(key).upload_from_string(data, content_type="application/octet-stream")

    def get(self, key: str) -> bytes:
        # A blob object never reloaded has no mediaLink: the download uses the direct endpoint.
        return self._bucket.blob(key).download_as_bytes()

    def delete(self, key: str) -> None:
        self._bucket.blob(key).delete()

    def keys(self, prefix: str = "") -> list[str]:
        return sorted(b.name for b in self.service.client.list_blobs(self.bucket, prefix=prefix or None))

    def close(self) -> None:
        try:
            for name in self.keys():
                self._bucket.blob(name).delete()
            self._bucket.delete()
        except Exception:
            pass


class AzureBackend(_CloudBackend):
    name = "azure"
    scheme = "az"

    def _create(self) -> None:
        self._container = self.service.client.create_container(self.bucket)

    def put(self, key: str, data: bytes) -> None:
        self._container.upload_blob(key, data, overwrite=True)

    def get(self, key: str) -> bytes:
        return self._container.download_blob(key).readall()

    def delete(self, key: str) -> None:
        self._container.delete_blob(key)

    def keys(self, prefix: str = "") -> list[str]:
        return sorted(b.name for b in self._container.list_blobs(name_starts_with=prefix or None))

    def close(self) -> None:
        try:
            self._container.delete_container()
        except Exception:
            pass


SERVICES = {"s3": S3Service, "gcs": GcsService, "azure": AzureService}
