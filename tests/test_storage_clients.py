"""The storage clients a process makes: every S3 client resolves its own credentials and
configuration, and all of them read botocore's service models through one loader (a session's
own loader parses the S3 model again for each client); a local directory's files that cannot be
read are storage errors naming them."""

from __future__ import annotations

import errno
import io

import pytest

from streamer_client.errors import StorageError
from streamer_service.settings import Settings
from streamer_service.storage.local import LocalStorage
from streamer_service.storage.s3 import S3Storage
from streamer_service.uri import parse_uri


def test_s3_clients_share_the_service_models_but_each_resolves_its_own_credentials(monkeypatch):
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "first-key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "first-secret")
    first = S3Storage(parse_uri("s3://bucket-one/model"), Settings())
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "second-key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "second-secret")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-1")
    second = S3Storage(parse_uri("s3://bucket-two/model"), Settings())
    try:
        assert first._session.get_credentials().access_key == "first-key"
        assert second._session.get_credentials().access_key == "second-key"
        assert (first._client.meta.region_name, second._client.meta.region_name) == ("us-east-1", "eu-west-1")
        assert first._session.get_component("data_loader") is second._session.get_component("data_loader")
    finally:
        first.close()
        second.close()


def test_a_local_file_that_cannot_be_read_is_a_storage_error_naming_it(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"x" * 64)
    storage = LocalStorage(parse_uri(str(tmp_path)))
    [listed] = storage.list_objects()
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "model.safetensors").mkdir()  # a directory where the file was listed
    for read in (lambda: storage.download(listed, io.BytesIO()), lambda: storage.read_range("model.safetensors", 0, 8)):
        with pytest.raises(StorageError) as caught:
            read()
        assert type(caught.value) is StorageError and caught.value.key == "model.safetensors"
        assert caught.value.message == f"cannot read {tmp_path}/model.safetensors: Is a directory"


def test_a_local_download_leaves_the_destinations_write_error_to_the_destination(tmp_path):
    (tmp_path / "config.json").write_bytes(b"{}")
    storage = LocalStorage(parse_uri(str(tmp_path)))
    [listed] = storage.list_objects()

    class Full(io.BytesIO):
        def write(self, data) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError) as caught:
        storage.download(listed, Full())
    assert not isinstance(caught.value, StorageError) and caught.value.errno == errno.ENOSPC
