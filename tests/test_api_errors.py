"""Every refusal of the daemon's HTTP API is the documented ``{"error": {...}}`` body, those of
FastAPI itself included, on a real daemon's unix socket."""

from __future__ import annotations

import pytest


def _error(r) -> dict:
    body = r.json()
    assert set(body) == {"error"}, body  # not FastAPI's {"detail": ...}
    assert set(body["error"]) == {"type", "message", "uri", "key"}, body
    return body["error"]


@pytest.fixture
def api(daemon):
    d = daemon()
    with d.client() as c:
        yield c
    assert d.healthy()


def test_no_such_path_is_404_in_our_error_body(api):
    r = api.get("/v1/nope")
    assert r.status_code == 404
    error = _error(r)
    assert error["type"] == "ConfigError" and error["message"].startswith("GET /v1/nope: no such path")


def test_a_method_not_allowed_is_405_naming_the_allowed_one(api):
    r = api.post("/healthz", json={})
    assert r.status_code == 405
    assert r.headers["allow"] == "GET"
    assert _error(r)["message"] == "POST /healthz: method not allowed (allowed: GET)"


def test_a_body_fastapi_cannot_parse_is_400_in_our_error_body(api):
    r = api.post("/v1/metadata", content=b'{"uri": "\xff"}', headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert _error(r)["message"] == "POST /v1/metadata: There was an error parsing the body"


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_json_sent_as_another_type_is_415_saying_so(api, content_type):
    headers = {"content-type": content_type} if content_type else {}
    r = api.post("/v1/metadata", content=b'{"uri": "/nowhere"}', headers=headers)
    assert r.status_code == 415
    error = _error(r)
    assert error["type"] == "ConfigError"
    sent = repr(content_type) if content_type else "'no Content-Type'"
    assert error["message"] == f"a request body must be JSON sent as Content-Type: application/json, got {sent}"
    # JSON with a charset is JSON: the request is read (and refused for its URI).
    r = api.post("/v1/metadata", content=b'{"uri": "/nowhere"}', headers={"content-type": "application/json; charset=utf-8"})
    assert r.status_code == 400 and _error(r)["type"] == "InvalidURIError"
