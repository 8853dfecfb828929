import os

import pytest

from streamer_client._protocol import error_body
from streamer_client.errors import InvalidURIError, ObjectNotFoundError
from streamer_service.uri import Scheme, parse_uri


@pytest.mark.parametrize(
    "text, scheme, bucket, prefix, normalized",
    [
        ("s3://bucket/models/llama", Scheme.S3, "bucket", "models/llama", "s3://bucket/models/llama"),
        ("s3://bucket/models/llama/", Scheme.S3, "bucket", "models/llama", "s3://bucket/models/llama"),
        ("S3://bucket//models///llama", Scheme.S3, "bucket", "models/llama", "s3://bucket/models/llama"),
        ("gs://my_bucket.x/p", Scheme.GCS, "my_bucket.x", "p", "gs://my_bucket.x/p"),
        ("az://container", Scheme.AZURE, "container", "", "az://container"),
        ("az://container/", Scheme.AZURE, "container", "", "az://container"),
        ("s3://bucket/modèle/ü", Scheme.S3, "bucket", "modèle/ü", "s3://bucket/modèle/ü"),
    ],
)
def test_cloud_uris_normalize(text, scheme, bucket, prefix, normalized):
    uri = parse_uri(text)
    assert (uri.scheme, uri.bucket, uri.prefix, uri.normalized) == (scheme, bucket, prefix, normalized)


def test_equivalent_spellings_share_a_cache_key():
    assert parse_uri("s3://b1x/m/").cache_key == parse_uri("s3://b1x/m").cache_key
    assert parse_uri("s3://b1x/m").cache_key != parse_uri("gs://b1x/m").cache_key
    assert len(parse_uri("s3://b1x/m").cache_key) == 64


def test_local_dirs_resolve(tmp_path, monkeypatch):
    (tmp_path / "model").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "model")
    monkeypatch.chdir(tmp_path)
    for text in ("model", str(tmp_path / "model") + "/", "link", f"file://{tmp_path}/model"):
        uri = parse_uri(text)
        assert uri.scheme is Scheme.LOCAL
        assert uri.normalized == str((tmp_path / "model").resolve())
    assert parse_uri(tmp_path / "model").child("a/b.json") == os.path.join(str(tmp_path / "model"), "a/b.json")


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "empty"),
        ("hdfs://namenode/x", "unsupported URI scheme 'hdfs://' in 'hdfs://namenode/x'"),
        ("http://host/x", "unsupported URI scheme 'http://'"),
        ("s3://", "names no bucket"),
        ("s3:///prefix", "names no bucket"),
        ("s3://Bucket/x", "invalid bucket name 'Bucket'"),
        ("s3://bücket/x", "invalid bucket name 'bücket'"),
        ("az://", "names no container"),  # Azure calls its buckets containers
        ("az://Container/x", "invalid container name 'Container'"),
        ("az://c/x?sv=1", "give only container and prefix"),
        ("s3://b/x?versionId=3", "query or fragment"),
        ("s3://bucket/x#frag", "query or fragment"),
        ("s3://bucket/a/../b", "'..' path segments"),
        ("s3://bucket/a\\b", "backslash"),
        ("s3://bucket/a\x00b", "control characters"),
        ("file://relative/path", "absolute path"),
        ("/definitely/not/here", "does not exist"),
    ],
)
def test_bad_uris_name_themselves(text, message):
    with pytest.raises(InvalidURIError) as info:
        parse_uri(text)
    assert message in str(info.value)
    if text and "\x00" not in text:
        assert repr(text) in str(info.value) or text in str(info.value) or message.startswith("names no ")


def test_local_file_is_not_a_directory(tmp_path):
    f = tmp_path / "config.json"
    f.write_text("{}")
    with pytest.raises(InvalidURIError, match="is not a directory"):
        parse_uri(str(f))


def test_non_string_uri():
    with pytest.raises(InvalidURIError, match="must be a string"):
        parse_uri(42)


def test_an_error_given_a_parsed_uri_names_it_as_text():
    uri = parse_uri("s3://bucket/models/llama")
    error = ObjectNotFoundError("gone", uri=uri, key="model.safetensors")
    assert error.uri == "s3://bucket/models/llama"
    assert (
        error_body(type(error).__name__, error.message, uri=error.uri, key=error.key)["error"]["uri"]
        == "s3://bucket/models/llama"
    )
