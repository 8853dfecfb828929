"""Security of a real daemon: what it reads, who can reach it, what it tells and what it logs.

Also covered elsewhere (docs/reliability.md lists them): socket 0600 and segments 0600
(tests/test_daemon.py::test_four_ranks_overlapping_selections_read_each_byte_once), 0660/0640
with --group-access (test_group_access_opens_socket_and_segments_to_the_group), the TCP token
(test_tcp_listener_is_loopback_and_needs_the_token, test_tcp_without_a_token_refuses_to_start).
"""

from __future__ import annotations

import json
import socket
import subprocess
import uuid
from pathlib import Path

import httpx
import pytest
from daemon_harness import DaemonProcess, finish, leftovers
from harness.faults import denied_fault

from streamer_service.sample import build_sample


@pytest.fixture(scope="module")
def sample(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("sample") / "ckpt"
    build_sample(src, size_mb=2)
    return src


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening_addresses(port: int) -> set[str]:
    """Local addresses with a TCP socket LISTENing on ``port`` (from /proc/net/tcp and tcp6)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if int(hex_port, 16) == port and state == "0A":
                found.add(address)
    return found


def test_only_allowed_uris_are_read(sample, tmp_path):
    allowed = tmp_path / "models" / "m"
    sibling = tmp_path / "models" / "m2"  # shares the allowed prefix as a string, not as a path
    for d in (allowed, sibling):
        d.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["cp", "-r", str(sample), str(d)], check=True)
    d = DaemonProcess(tmp_path, {}, "--allow", str(allowed)).start()
    try:
        with d.client() as c:
            for uri in (str(sibling), f"{allowed}/../m2", str(tmp_path), "s3://bucket/models/m"):
                for r in (
                    c.post("/v1/sessions/join", json={"uri": uri, "session": "s", "rank": 0, "world_size": 1}),
                    c.post("/v1/metadata", json={"uri": uri}),
                ):
                    assert r.status_code == 403, (uri, r.text)
                    error = r.json()["error"]
                    assert error["type"] == "StorageAccessDeniedError" and "not under any --allow prefix" in error["message"]
            assert c.post("/v1/metadata", json={"uri": str(allowed)}).status_code == 200
        result = finish(d.start_rank(str(allowed), 0, 1, allowed, None))
        assert result["bad"] == [] and result["got"]
        # Nothing outside the allowed prefix was pulled into the cache.
        markers = [json.loads(p.read_text())["uri"] for p in (tmp_path / "cache").glob("*/.runai_complete")]
        assert markers == [str(allowed)]
        assert leftovers(d, tmp_path / "cache") == ([], [])
        assert d.healthy()
    finally:
        d.stop()


@pytest.mark.parametrize("backend", ["s3"], indirect=True)
def test_no_secret_in_logs_or_responses_and_no_path_outside_cache_or_shm(backend, sample, tmp_path):
    secret = f"FAKE-SECRET-{uuid.uuid4().hex}"
    secrets = {
        "AWS_SECRET_ACCESS_KEY": f"{secret}-aws",  # moto does not check signatures: loads still work
        "STREAMER_TOKEN": f"{secret}-token",
        "AZURE_STORAGE_SAS_TOKEN": f"sv=2024&sig={secret}-sas",
        "AZURE_STORAGE_CONNECTION_STRING": f"DefaultEndpointsProtocol=http;AccountName=x;AccountKey={secret}-conn;",
    }
    backend.put_tree("ckpt", {p.name: p.read_bytes() for p in sample.iterdir()})
    backend.put_tree("denied", {p.name: p.read_bytes() for p in sample.iterdir()})
    uri = backend.uri("ckpt")
    port = _free_port()
    env = {**backend.env, **secrets, "STREAMER_LOG_LEVEL": "DEBUG", "RUNAI_STREAMER_LOG_LEVEL": "DEBUG"}
    d = DaemonProcess(tmp_path, env, "--tcp-port", str(port), "--allow", uri, "--allow", backend.uri("denied")).start()
    texts: list[str] = []
    bodies: list = []
    try:
        assert _listening_addresses(port) == {"0100007F"}  # 127.0.0.1 only, no wildcard, no IPv6
        rank = d.start_rank(uri, 0, 1, sample, None)
        out, err = rank.communicate(timeout=300)
        assert rank.returncode == 0, err
        texts += [out, err]
        backend.proxy.fault = lambda r: denied_fault("s3")(r) if "/denied" in r.path else None
        with d.client() as c:
            responses = [
                c.get("/healthz"), c.get("/readyz"), c.get("/v1/stats"), c.get("/metrics"),
                c.post("/v1/metadata", json={"uri": uri}),
                c.post("/v1/metadata", json={"uri": backend.uri("denied")}),
                c.post("/v1/sessions/join", json={"uri": backend.uri("denied"), "session": "s", "rank": 0, "world_size": 1}),
                c.post("/v1/sessions/join", json={"uri": uri, "session": "s", "rank": 0, "world_size": 1, "select": ["x"]}),
                c.post("/v1/sessions/nope/ranks/0/next", json={}),
            ]  # fmt: skip
        tcp = f"http://127.0.0.1:{port}"
        responses += [
            httpx.get(f"{tcp}/v1/stats", headers={"Authorization": f"Bearer {secret}-wrong"}),
            httpx.get(f"{tcp}/v1/stats", headers={"Authorization": f"Bearer {secrets['STREAMER_TOKEN']}"}),
        ]
        assert [r.status_code for r in responses] == [200, 200, 200, 200, 200, 403, 403, 400, 409, 401, 200]
        for r in responses:
            texts.append(r.text)
            if r.headers.get("content-type", "").startswith("application/json"):
                bodies.append(r.json())
        texts.append(json.dumps(dict(responses[-1].headers)))
    finally:
        d.stop()
    texts.append(d.log.read_text())
    assert "DEBUG" in texts[-1]  # the daemon did log at DEBUG
    leaked = [t[max(0, t.find(secret) - 200) : t.find(secret) + 100] for t in texts if secret in t]
    assert leaked == []
    # Every path a response names is in the cache or the shm dir.
    cache, shm = tmp_path / "cache", d.shm_dir

    def paths(value):
        if isinstance(value, dict):
            for v in value.values():
                yield from paths(v)
        elif isinstance(value, list):
            for v in value:
                yield from paths(v)
        elif isinstance(value, str) and value.startswith("/"):
            yield Path(value)

    named = [p for body in bodies for p in paths(body)]
    assert named  # readyz names the shm dir, metadata the cache dir
    assert [p for p in named if not (p.is_relative_to(cache) or p.is_relative_to(shm))] == []


def test_symlinks_out_of_an_allowed_dir_are_refused_naming_the_entry(sample, tmp_path):
    """--allow is checked on every entry, not the URI only: a symlink inside an allowed dir must not make the
    daemon copy any file it can read into the shared cache, and header errors must not echo its first 8 bytes."""
    secret_dir = tmp_path / "secrets"
    secret_dir.mkdir()
    secret = secret_dir / "token"
    secret.write_bytes(b"SECRETSS" + b"x" * 64)
    allowed = tmp_path / "models"
    allowed.mkdir()
    cases = {
        "config": ("config.json", secret),  # a metadata file linked out
        "shard": ("model-00002-of-00002.safetensors", secret),  # a shard whose header would be read
        "dir": ("extra", secret_dir),  # a linked directory
    }
    for case, (entry, target) in cases.items():
        d = allowed / case
        subprocess.run(["cp", "-r", str(sample), str(d)], check=True)
        (d / entry).unlink(missing_ok=True)
        (d / entry).symlink_to(target)
    inside = allowed / "inside"  # a link that stays inside the allowed prefix is fine (HF cache snapshots)
    subprocess.run(["cp", "-r", str(sample), str(inside)], check=True)
    (allowed / "blob.json").write_text('{"model_type": "linked"}')
    (inside / "config.json").unlink()
    (inside / "config.json").symlink_to(allowed / "blob.json")
    d = DaemonProcess(tmp_path, {}, "--allow", str(allowed)).start()
    try:
        with d.client() as c:
            for case, (entry, _) in cases.items():
                for r in (
                    c.post("/v1/metadata", json={"uri": str(allowed / case)}),
                    c.post("/v1/sessions/join", json={"uri": str(allowed / case), "session": case, "rank": 0, "world_size": 1}),
                ):
                    assert r.status_code == 403, (case, r.text)
                    error = r.json()["error"]
                    assert error["type"] == "StorageAccessDeniedError" and error["key"] == entry, (case, error)
                    assert (
                        f"refusing {entry!r} under {allowed / case}: it resolves outside every --allow prefix" in error["message"]
                    )
                    assert "SECRET" not in r.text and str(int.from_bytes(b"SECRETSS", "little")) not in r.text
            reply = c.post("/v1/metadata", json={"uri": str(inside)})
            assert reply.status_code == 200, reply.text
            assert json.loads((Path(reply.json()["path"]) / "config.json").read_text()) == {"model_type": "linked"}
        # The secret was copied nowhere: not into the cache, not into shared memory.
        cache = tmp_path / "cache"
        assert not [p for p in cache.rglob("*") if p.is_file() and b"SECRETSS" in p.read_bytes()]
        assert leftovers(d, cache) == ([], [])
        assert b"SECRETSS" not in d.log.read_bytes()
        assert d.healthy()
    finally:
        d.stop()
