"""Bad input to a real daemon: each a clear error naming what was wrong; the daemon stays up.

URIs, selections and API misuse through the HTTP API (the client raises these again, see
tests/test_client.py). Unit-level coverage lives beside the code: tests/test_uri.py (every URI
rule), tests/test_plan.py (selection rules), tests/test_header.py (headers),
tests/test_metadata.py (object keys).
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path

import httpx
import pytest
from daemon_harness import DaemonProcess, leftovers, wait_until

from streamer_client._protocol import ERROR_TEXT_LIMIT
from streamer_service.daemon.api import MAX_BODY_BYTES, MAX_LIST
from streamer_service.sample import build_sample


@pytest.fixture(scope="module")
def sample(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("sample") / "ckpt"
    build_sample(src, size_mb=2)
    return src


@pytest.fixture
def daemon(tmp_path):
    d = DaemonProcess(tmp_path, {"STREAMER_JOIN_TIMEOUT_S": "20", "STREAMER_RANK_TIMEOUT_S": "5"}).start()
    yield d
    d.stop()


def _join(c: httpx.Client, uri: str, **kw) -> httpx.Response:
    body = {"uri": uri, "session": "s", "rank": 0, "world_size": 1, **kw}
    return c.post("/v1/sessions/join", json=body, timeout=60)


def _keep_reading(daemon: DaemonProcess, session_id: str, rank: int, stop: threading.Event) -> None:
    """Rank ``rank`` of ``session_id``, alive: takes and releases every batch, and once ``stop`` is
    set and it has received everything, leaves."""
    base = f"/v1/sessions/{session_id}/ranks/{rank}"
    release: list[int] = []
    done = False
    with daemon.client() as c:
        while not (done and stop.is_set()):
            reply = c.post(f"{base}/next", json={"release": release, "wait_s": 0.2}, timeout=60)
            assert reply.status_code == 200, reply.text
            release, done = sorted({h[0] for h in reply.json()["handles"]}), reply.json()["done"]
        # The load may have ended by now (this rank had released everything): both are no-ops then.
        c.post(f"{base}/next", json={"release": release, "wait_s": 0.0}, timeout=60)
        c.post(f"{base}/leave")


def _error(r: httpx.Response, status: int, kind: str) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["type"] == kind, error
    return error


def _still_fine(d: DaemonProcess, cache_dir: Path) -> None:
    assert leftovers(d, cache_dir) == ([], [])
    assert d.healthy()


BAD_URIS = {
    "hdfs://namenode/models/x": "unsupported URI scheme 'hdfs://'",
    "s3:///models/x": "names no bucket",
    "s3://bucket/models/x?versionId=3": "has a query or fragment",
    "s3://bucket/models/x#junk": "has a query or fragment",
    "s3://bücket/models/x": "invalid bucket name 'bücket'",
    "gs://bucket/models/../../etc": "'..' path segments",
    "": "empty",
}


def test_bad_uris_are_refused_naming_the_uri(daemon, tmp_path):
    with daemon.client() as c:
        for uri, message in BAD_URIS.items():
            for r in (_join(c, uri), c.post("/v1/metadata", json={"uri": uri})):
                error = _error(r, 400, "InvalidURIError")
                assert message in error["message"]
                if uri:
                    assert repr(uri) in error["message"] or uri in error["message"]
    _still_fine(daemon, tmp_path / "cache")


def test_bad_selections_are_refused_naming_the_entry(sample, daemon, tmp_path):
    uri = str(sample)
    with daemon.client() as c:
        error = _error(_join(c, uri, select=["model.layers.0.no_such_tensor"]), 400, "SelectionError")
        assert "'model.layers.0.no_such_tensor' matches no tensor" in error["message"]
        assert error["key"] == "model.layers.0.no_such_tensor"
        assert "selection is empty" in _error(_join(c, uri, select=[]), 400, "SelectionError")["message"]
        dup = ["model.embed_tokens.weight"] * 2
        assert "given twice" in _error(_join(c, uri, select=dup), 400, "SelectionError")["message"]
        overlap = ["model.layers.0.", "model.layers.0.input_layernorm.weight"]
        assert "overlap" in _error(_join(c, uri, select=overlap), 400, "SelectionError")["message"]
        assert "not a non-empty string" in _error(_join(c, uri, select=[""]), 400, "SelectionError")["message"]
        # A huge list within the limit is answered at once, naming the first bad entry only.
        huge = [f"model.layers.{i}.nothing" for i in range(MAX_LIST)]
        error = _error(_join(c, uri, select=huge), 400, "SelectionError")
        assert "'model.layers.0.nothing'" in error["message"] and len(error["message"]) < 300
        # One entry more than the limit is refused before the checkpoint is even opened.
        error = _error(_join(c, "s3://never-read/x", select=huge + ["x"]), 422, "ConfigError")
        assert "select" in error["message"] and f"at most {MAX_LIST} items" in error["message"]
        # A wrong type in the list.
        assert "select" in _error(_join(c, uri, select=[1, 2]), 422, "ConfigError")["message"]
        # Text no tensor name can be: a lone surrogate, which JSON's escapes let through.
        for field in ("select", "priority"):
            body = json.dumps({"uri": uri, "session": "s", "rank": 0, "world_size": 1, field: ["model.", "\ud800"]})
            sent = c.post("/v1/sessions/join", content=body.encode(), headers={"content-type": "application/json"})
            message = _error(sent, 422, "ConfigError")["message"]
            assert f"body.{field}: Value error, entry '\\ud800' is not valid Unicode text (a lone surrogate)" in message
        # An entry of a megabyte is named by its start: the reply does not send it back whole.
        long_entry = "model.layers.0.nothing." + "x" * 2**20
        sent = _join(c, uri, select=[long_entry])
        error = _error(sent, 400, "SelectionError")
        assert len(sent.content) < 3 * ERROR_TEXT_LIMIT
        message, key = error["message"], error["key"]
        assert message.startswith("selection entry 'model.layers.0.nothing.xxxx") and message.endswith(
            "' matches no tensor name or prefix"
        )
        assert len(message) <= ERROR_TEXT_LIMIT and " characters left out] ... " in message
        assert key.startswith(long_entry[:7000]) and len(key) <= ERROR_TEXT_LIMIT
    metrics = daemon.stats()
    assert metrics["sessions"] == [] and metrics["bytes_read"] == 0  # nothing was streamed
    _still_fine(daemon, tmp_path / "cache")


def test_a_symlink_loop_in_a_checkpoint_dir_is_a_clear_error_naming_it(sample, daemon, tmp_path):
    through_a_file, loop = tmp_path / "through-a-file", tmp_path / "loop"
    for broken in (through_a_file, loop):
        shutil.copytree(sample, broken)
    (through_a_file / "x").symlink_to(through_a_file / "config.json" / "x")  # ENOTDIR: dangling, skipped
    (loop / "a").symlink_to(loop / "b")
    (loop / "b").symlink_to(loop / "a")
    with daemon.client() as c:
        assert c.post("/v1/metadata", json={"uri": str(through_a_file)}, timeout=60).status_code == 200
        error = _error(_join(c, str(loop)), 502, "StorageError")
    assert error["message"] == f"cannot read {loop}/a: Too many levels of symbolic links" and error["key"] == "a"
    _still_fine(daemon, tmp_path / "cache")


def test_a_directory_the_walk_cannot_list_is_a_clear_error_naming_it(sample, daemon, tmp_path):
    deep = tmp_path / "deep"
    shutil.copytree(sample, deep)
    part = "d" * 250
    fd = os.open(deep, os.O_DIRECTORY)
    try:  # made one level at a time from the last: its full path is longer than the kernel takes
        for _ in range(20):
            os.mkdir(part, dir_fd=fd)
            inner = os.open(part, os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = inner
    finally:
        os.close(fd)
    levels = next(k for k in range(1, 21) if len(f"{deep}/{'/'.join([part] * k)}") >= os.pathconf("/", "PC_PATH_MAX"))
    key = "/".join([part] * levels)
    with daemon.client() as c:
        error = _error(_join(c, str(deep)), 502, "StorageError")
    assert error["message"] == f"cannot read {deep}/{key}: File name too long" and error["key"] == key
    _still_fine(daemon, tmp_path / "cache")


def test_api_misuse_is_a_clear_error(sample, daemon, tmp_path):
    uri = str(sample)
    with daemon.client() as c:
        # Malformed JSON and wrong shapes: 422 ConfigError naming the field.
        r = c.post("/v1/sessions/join", content=b'{"uri": ', headers={"content-type": "application/json"})
        assert "invalid request" in _error(r, 422, "ConfigError")["message"]
        assert "rank" in _error(_join(c, uri, rank=-1), 422, "ConfigError")["message"]
        assert "world_size" in _error(_join(c, uri, world_size=0), 422, "ConfigError")["message"]
        assert "world_size" in _error(_join(c, uri, world_size="two"), 422, "ConfigError")["message"]
        assert "body.rank: Input should be a valid integer" in _error(_join(c, uri, rank=True), 422, "ConfigError")["message"]
        assert "world_size" in _error(_join(c, uri, world_size=2.0), 422, "ConfigError")["message"]
        assert "body.bogus: Extra inputs are not permitted" in _error(_join(c, uri, bogus=1), 422, "ConfigError")["message"]
        r = c.post("/v1/sessions/join", json={"session": "s", "rank": 0, "world_size": 1})
        assert "uri" in _error(r, 422, "ConfigError")["message"]
        r = c.post("/v1/sessions/join", json=[1, 2, 3])
        _error(r, 422, "ConfigError")
        # A rank outside the world.
        assert "outside world_size 2" in _error(_join(c, uri, session="w", rank=2, world_size=2), 409, "SessionError")["message"]
        # Unknown session ids, and a rank that is not part of a session.
        assert (
            "unknown or finished session 'nope'"
            in _error(c.post("/v1/sessions/nope/ranks/0/next", json={}), 409, "SessionError")["message"]
        )
        assert c.post("/v1/sessions/nope/ranks/0/leave").json() == {"left": False}
        # Oversized bodies are refused before they are read.
        big = b'{"uri": "' + b"x" * MAX_BODY_BYTES + b'"}'
        r = c.post("/v1/sessions/join", content=big, headers={"content-type": "application/json"})
        assert f"over the limit of {MAX_BODY_BYTES} bytes" in _error(r, 413, "ConfigError")["message"]

        def chunks():
            yield b'{"uri": "x", '
            yield b'"session": "s", "rank": 0, "world_size": 1}'

        r = c.post("/v1/sessions/join", content=chunks(), headers={"content-type": "application/json"})
        assert "Content-Length" in _error(r, 411, "ConfigError")["message"]

        # Rank 0 of a two-rank session joins (and waits for rank 1) ...
        first: dict = {}

        def join_rank0() -> None:
            with daemon.client() as c0:
                first["r"] = _join(c0, uri, session="pair", world_size=2)

        waiting = threading.Thread(target=join_rank0)
        waiting.start()
        wait_until(lambda: any(s["key"] == "pair" for s in daemon.stats()["sessions"]))
        # ... a second rank 0, and a rank with another world_size, are refused; the session goes on.
        assert (
            "rank 0 already joined session 'pair'"
            in _error(_join(c, uri, session="pair", world_size=2), 409, "SessionError")["message"]
        )
        error = _error(_join(c, uri, session="pair", rank=1, world_size=3), 409, "SessionError")
        assert "world_size 3" in error["message"] and "world_size 2" in error["message"]
        second = _join(c, uri, session="pair", rank=1, world_size=2)
        assert second.status_code == 200, second.text
        waiting.join(timeout=60)
        assert first["r"].status_code == 200 and first["r"].json()["session_id"] == second.json()["session_id"]
        # Rank 0 joining again after streaming began: the daemon waits until the first rank 0, silent
        # here, is reclaimed (STREAMER_RANK_TIMEOUT_S), then serves the newcomer as a rejoin in a
        # session of its own (docs/daemon.md, "Warm restart and rejoin"). Rank 1 keeps reading
        # meanwhile: were it silent too, the load would be abandoned when both are reclaimed, and a
        # rank 0 arriving after that starts a new group load instead (a race, in this test, before).
        session_id = second.json()["session_id"]
        stop = threading.Event()
        rank1 = threading.Thread(target=_keep_reading, args=(daemon, session_id, 1, stop))
        rank1.start()
        try:
            again = _join(c, uri, session="pair", world_size=2)
        finally:
            stop.set()
            rank1.join(timeout=60)
        assert again.status_code == 200, again.text
        rejoin_id = again.json()["session_id"]
        assert rejoin_id != session_id
        ended = wait_until(
            lambda: next((s for s in daemon.stats()["finished"] if s["id"] == session_id), None), what="the first session's end"
        )
        assert [ended["ranks"][r]["status"] for r in ("0", "1")] == ["reclaimed", "done"]
        assert c.post(f"/v1/sessions/{rejoin_id}/ranks/0/leave").json() == {"left": True}
    _still_fine(daemon, tmp_path / "cache")
