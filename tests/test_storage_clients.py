"""The storage clients a process makes: every S3 client resolves its own credentials and
configuration, and all of them read botocore's service models through one loader (a session's
own loader parses the S3 model again for each client)."""

from __future__ import annotations

from streamer_service.settings import Settings
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
