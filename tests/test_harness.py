"""The test harness itself: emulators, the counting proxy, and the backend fixtures."""

from __future__ import annotations

import http.client
import os
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from harness import emulators
from harness.backends import closed_port_url
from harness.faults import always, denied_fault, every_nth, first_n, unavailable_fault
from harness.proxy import CountingProxy, Fault

PAYLOAD = os.urandom(256 * 1024) + b"tail"


# --------------------------------------------------------------------------- SDK clients via env


def _sdk_read(backend, key: str, start: int | None = None, end: int | None = None) -> bytes:
    """Read through the code-under-test path: an SDK configured only from ``os.environ``
    (which the fixture pointed at the proxy). ``end`` is inclusive."""
    if backend.name == "s3":
        import boto3

        kw = {"Range": f"bytes={start}-{end}"} if start is not None else {}
        return boto3.client("s3").get_object(Bucket=backend.bucket, Key=key, **kw)["Body"].read()
    if backend.name == "gcs":
        from google.cloud import storage

        blob = storage.Client().bucket(backend.bucket).blob(key)
        return blob.download_as_bytes(start=start, end=end)
    if backend.name == "azure":
        from azure.storage.blob import BlobServiceClient, LinearRetry

        # The default ExponentialRetry waits 15 s before its first retry.
        svc = BlobServiceClient.from_connection_string(
            os.environ["AZURE_STORAGE_CONNECTION_STRING"],
            retry_policy=LinearRetry(backoff=0.1, random_jitter_range=0),
        )
        blob = svc.get_blob_client(backend.bucket, key)
        if start is None:
            return blob.download_blob().readall()
        return blob.download_blob(offset=start, length=end - start + 1).readall()
    raise AssertionError(backend.name)


def _proxy_http(backend, method: str, path: str, headers=None) -> http.client.HTTPResponse:
    conn = http.client.HTTPConnection("127.0.0.1", backend.proxy.port, timeout=10)
    conn.request(method, path, headers=headers or {})
    return conn.getresponse()


def _object_path(backend, key: str) -> str:
    if backend.name == "s3":
        return f"/{backend.bucket}/{key}"
    if backend.name == "gcs":
        return f"/storage/v1/b/{backend.bucket}/o/{key.replace('/', '%2F')}?alt=media"
    return f"/devstoreaccount1/{backend.bucket}/{key}"


# --------------------------------------------------------------------------- backends


def test_backend_roundtrip_and_uri(backend):
    backend.put_tree("m/sub", {"a.json": b"{}", "deep/b.bin": b"\x00\x01"})
    backend.put("m/c.txt", b"c")
    assert backend.get("m/sub/a.json") == b"{}"
    assert backend.get("m/sub/deep/b.bin") == b"\x00\x01"
    assert backend.keys("m/") == ["m/c.txt", "m/sub/a.json", "m/sub/deep/b.bin"]
    backend.delete("m/c.txt")
    assert backend.keys("m/") == ["m/sub/a.json", "m/sub/deep/b.bin"]
    uri = backend.uri("m/sub")
    if backend.name == "local":
        assert Path(uri).is_dir() and (Path(uri) / "a.json").read_bytes() == b"{}"
        assert backend.proxy is None and backend.env == {}
    else:
        scheme = {"s3": "s3", "gcs": "gs", "azure": "az"}[backend.name]
        assert uri == f"{scheme}://{backend.bucket}/m/sub"
        assert backend.proxy.count() == 0, "direct SDK calls must not go through the proxy"
        for k, v in backend.env.items():
            assert os.environ[k] == v


def test_isolated_env(tmp_path):
    assert os.environ["STREAMER_CACHE_DIR"] == str(tmp_path / "cache")
    assert os.environ["STREAMER_SHM_DIR"] == str(tmp_path / "shm")
    for name in (
        "STREAMER_SOCKET",
        "STREAMER_LAUNCH_ID",
        "TORCHELASTIC_RUN_ID",
        "AWS_ACCESS_KEY_ID",
        "AWS_ENDPOINT_URL",
        "STORAGE_EMULATOR_HOST",
        "AZURE_STORAGE_CONNECTION_STRING",
    ):
        assert name not in os.environ


def test_each_test_gets_a_fresh_bucket(cloud_backend):
    assert cloud_backend.keys() == []
    assert 3 <= len(cloud_backend.bucket) <= 63
    assert all(c.isdigit() or c == "-" or "a" <= c <= "z" for c in cloud_backend.bucket)


def test_sdk_reads_through_proxy_are_counted(cloud_backend):
    b = cloud_backend
    b.put("dir/obj.bin", PAYLOAD)
    assert b.get("dir/obj.bin") == PAYLOAD
    assert b.proxy.count() == 0

    assert _sdk_read(b, "dir/obj.bin") == PAYLOAD
    full_gets = b.proxy.count(method="GET", path_contains="dir/obj.bin")
    assert full_gets >= 1

    before = b.proxy.count(has_range=True)
    assert _sdk_read(b, "dir/obj.bin", 1000, 200_999) == PAYLOAD[1000:201_000]
    assert b.proxy.count(has_range=True) == before + 1
    ranged = [r for r in b.proxy.requests if r.range is not None][-1]
    assert ranged.method == "GET" and "dir/obj.bin" in ranged.path and ranged.status == 206
    assert "1000-200999" in ranged.range

    b.proxy.reset()
    assert b.proxy.count() == 0 and b.proxy.requests == []


def _sdk_write(backend, key: str, data: bytes) -> None:
    """Upload through the proxy with an SDK configured from ``os.environ``."""
    import io

    if backend.name == "s3":
        import boto3

        boto3.client("s3").upload_fileobj(io.BytesIO(data), backend.bucket, key)  # streaming, checksummed
    elif backend.name == "gcs":
        from google.cloud import storage

        storage.Client().bucket(backend.bucket).blob(key).upload_from_string(data)  # > 8 MiB: resumable
    else:
        from azure.storage.blob import BlobServiceClient

        svc = BlobServiceClient.from_connection_string(
            os.environ["AZURE_STORAGE_CONNECTION_STRING"], max_single_put_size=4 * 1024 * 1024
        )
        svc.get_blob_client(backend.bucket, key).upload_blob(data)  # staged blocks + commit


def test_sdk_writes_through_proxy(cloud_backend):
    data = os.urandom(9 * 1024 * 1024)
    _sdk_write(cloud_backend, "up/big.bin", data)
    assert cloud_backend.get("up/big.bin") == data
    writes = cloud_backend.proxy.count(method="PUT") + cloud_backend.proxy.count(method="POST")
    assert writes >= 1 and all(r.status < 300 for r in cloud_backend.proxy.requests)


def test_gcs_listed_blob_downloads_stay_on_proxy(gcs_service):
    """fake-gcs-server's mediaLink must name the proxy, or SDK downloads of listed/reloaded
    blobs would bypass it."""
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    b = gcs_service.new_backend()
    try:
        b.put("x/y.bin", b"hello")
        client = storage.Client(project="test", credentials=AnonymousCredentials(), client_options={"api_endpoint": b.proxy.url})
        (listed,) = list(client.list_blobs(b.bucket))
        assert listed.download_as_bytes() == b"hello"
        got = client.bucket(b.bucket).get_blob("x/y.bin")
        assert got.download_as_bytes() == b"hello"
        assert b.proxy.count(method="GET", path_contains="/download/") == 2
    finally:
        b.close()


def test_fault_hook_injects_503_and_drop(cloud_backend):
    b = cloud_backend
    b.put("k.bin", b"0123456789")
    path = _object_path(b, "k.bin")

    b.proxy.fault = lambda r: Fault(status=503, body=b"busy") if "k.bin" in r.path else None
    resp = _proxy_http(b, "GET", path)
    assert (resp.status, resp.read()) == (503, b"busy")
    assert b.proxy.requests[-1].status == 503

    b.proxy.fault = lambda r: Fault.drop_connection()
    with pytest.raises((http.client.RemoteDisconnected, ConnectionError)):
        _proxy_http(b, "GET", path).read()
    assert b.proxy.requests[-1].status is None

    b.proxy.fault = unavailable_fault(b.name)
    resp = _proxy_http(b, "HEAD", path)
    assert resp.status == 503 and resp.read() == b""
    b.proxy.fault = denied_fault(b.name)
    resp = _proxy_http(b, "GET", path)
    assert resp.status == 403 and resp.read()

    assert b.proxy.count() == 4


def test_sdk_sees_injected_503_then_recovers(cloud_backend):
    b = cloud_backend
    b.put("r.bin", PAYLOAD)
    b.proxy.fault = first_n(1, unavailable_fault(b.name), when=lambda r: "r.bin" in r.path)
    assert _sdk_read(b, "r.bin", 0, 99) == PAYLOAD[:100]
    statuses = [r.status for r in b.proxy.requests if "r.bin" in r.path]
    assert statuses[0] == 503 and statuses[-1] == 206


def test_unreachable_env_refuses_connections(cloud_backend):
    env = cloud_backend.unreachable_env()
    assert env.keys() == cloud_backend.env.keys()
    url = env.get("AWS_ENDPOINT_URL") or env.get("STORAGE_EMULATOR_HOST") or env["AZURE_STORAGE_CONNECTION_STRING"]
    port = int(url.split("127.0.0.1:")[1].split("/")[0])
    assert port != cloud_backend.proxy.port
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=2)


# --------------------------------------------------------------------------- proxy vs a plain server


class _Echo(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def _any(self):
        n = int(self.headers.get("Content-Length", 0))
        body = self.rfile.read(n)
        info = (
            f"{self.command} {self.path} cl={self.headers.get('Content-Length')} "
            f"te={self.headers.get('Transfer-Encoding')} host={self.headers.get('Host')} "
            f"x={self.headers.get('X-Test')} "
        ).encode() + body
        self.send_response(200)
        if self.path.startswith("/chunked"):  # upstream chunked response
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for part in (info[:5], info[5:]):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
            self.wfile.write(b"0\r\n\r\n")
            return
        self.send_header("Content-Length", str(len(info)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(info)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = do_PATCH = _any


@pytest.fixture
def echo_proxy():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Echo)
    server.daemon_threads = True
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    proxy = CountingProxy(f"http://127.0.0.1:{server.server_address[1]}").start()
    yield proxy
    proxy.stop()
    server.shutdown()
    server.server_close()


def test_proxy_forwards_methods_bodies_and_keeps_alive(echo_proxy):
    conn = http.client.HTTPConnection("127.0.0.1", echo_proxy.port, timeout=10)
    conn.request("PUT", "/a%2Fb?x=1", body=b"hello", headers={"X-Test": "yes"})
    resp = conn.getresponse()
    body = resp.read()
    assert resp.status == 200 and body.startswith(b"PUT /a%2Fb?x=1 cl=5 te=None") and body.endswith(b"hello")
    assert f"host=127.0.0.1:{echo_proxy.port}".encode() in body and b"x=yes" in body
    sock = conn.sock

    # chunked request body → forwarded with Content-Length, same client connection
    conn.request("POST", "/post", body=iter([b"ab", b"cde"]), encode_chunked=True, headers={"Transfer-Encoding": "chunked"})
    body = conn.getresponse().read()
    assert b"cl=5 te=None" in body and body.endswith(b"abcde")

    # chunked upstream response → sent back with Content-Length
    conn.request("GET", "/chunked", headers={"Range": "bytes=0-1"})
    resp = conn.getresponse()
    body = resp.read()
    assert resp.getheader("Content-Length") == str(len(body)) and resp.getheader("Transfer-Encoding") is None
    assert body.startswith(b"GET /chunked")

    conn.request("HEAD", "/h")
    resp = conn.getresponse()
    assert resp.read() == b"" and int(resp.getheader("Content-Length")) > 0

    conn.request("DELETE", "/d")
    assert conn.getresponse().read().startswith(b"DELETE /d")
    assert conn.sock is sock, "keep-alive: one client connection for all requests"
    conn.close()

    assert [r.method for r in echo_proxy.requests] == ["PUT", "POST", "GET", "HEAD", "DELETE"]
    assert echo_proxy.requests[0].path == "/a/b" and echo_proxy.requests[0].query == "x=1"
    assert echo_proxy.count(has_range=True) == 1 and echo_proxy.count(method="put") == 1
    assert echo_proxy.count(path_contains="/a/") == 1
    assert all(r.status == 200 for r in echo_proxy.requests)


def test_proxy_retries_a_stale_upstream_connection(echo_proxy, monkeypatch):
    monkeypatch.setattr(_Echo, "timeout", 0.2)  # upstream closes idle keep-alive connections
    conn = http.client.HTTPConnection("127.0.0.1", echo_proxy.port, timeout=10)
    for i in range(3):
        conn.request("GET", f"/n{i}")
        resp = conn.getresponse()
        assert resp.status == 200 and resp.read().startswith(f"GET /n{i}".encode())
        time.sleep(0.4)
    conn.close()
    assert [r.status for r in echo_proxy.requests] == [200, 200, 200]


def test_proxy_delay_and_upstream_down():
    proxy = CountingProxy(closed_port_url()).start()
    try:
        proxy.delay_s = 0.2
        started = time.monotonic()
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
        conn.request("GET", "/x")
        resp = conn.getresponse()
        assert resp.status == 502 and b"upstream error" in resp.read()
        assert time.monotonic() - started >= 0.2
        assert proxy.requests[-1].status == 502
    finally:
        proxy.stop()


# --------------------------------------------------------------------------- emulator processes


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("start", ["start_moto", "start_fake_gcs", "start_azurite"])
def test_emulator_process_is_gone_after_stop(start, tmp_path):
    emu = getattr(emulators, start)(log_dir=tmp_path)
    pid = emu.pid
    assert emu.running and _pid_alive(pid)
    socket.create_connection(("127.0.0.1", emu.port), timeout=2).close()
    emu.stop()
    assert not emu.running and not _pid_alive(pid)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", emu.port), timeout=2)
    assert emu.log_path.is_file()


def test_missing_emulator_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("STREAMER_TEST_AZURITE_DIR", str(tmp_path / "nowhere"))
    with pytest.raises(emulators.EmulatorMissing, match="scripts/bootstrap"):
        emulators.start_azurite(log_dir=tmp_path)


def test_damaged_responses_and_every_nth_ranged_get(echo_proxy):
    path, ranged = "/" + "a" * 2000, {"Range": "bytes=0-9999"}

    def get(headers, timeout=10):
        conn = http.client.HTTPConnection("127.0.0.1", echo_proxy.port, timeout=timeout)
        conn.request("GET", path, headers=headers)
        return conn.getresponse()

    whole = get(ranged).read()
    echo_proxy.reset()
    echo_proxy.fault = always(Fault.truncated())
    resp = get(ranged)
    assert resp.status == 200 and resp.getheader("Content-Length") == str(len(whole))
    with pytest.raises(http.client.IncompleteRead) as info:
        resp.read()
    assert info.value.partial == whole[: len(whole) // 2]

    echo_proxy.fault = always(Fault.reset())
    with pytest.raises(ConnectionResetError):
        get(ranged).read()

    echo_proxy.fault = always(Fault.stalled(60))
    resp = get(ranged, timeout=1)
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        resp.read()
    assert time.monotonic() - started < 5
    echo_proxy.release_stalls()
    assert [r.status for r in echo_proxy.requests] == [None, None, None]  # no whole response was sent

    echo_proxy.reset()
    echo_proxy.fault = every_nth(2, lambda r: Fault(status=503))
    statuses = [get(ranged).status for _ in range(4)] + [get({}).status]
    assert statuses == [200, 503, 200, 503, 200]  # a GET without Range is not counted
