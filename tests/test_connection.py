"""The rank's connection to a real daemon (``streamer_client._connection.DaemonClient``): one
kept-alive connection, reopened when the daemon closed it idle; a daemon gone is a DaemonError
naming the socket; a request whose connection is lost is not sent again; a load through the
daemon imports no HTTP package."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
import threading

import pytest
import torch
from checkpoints import ground_truth
from daemon_harness import wait_until

from streamer_client import errors
from streamer_client._connection import DaemonClient
from streamer_client._daemon import daemon_stream
from streamer_client._request import StreamRequest
from streamer_client.errors import DaemonError, SelectionError

TOKEN = "t0ken-for-the-tcp-listener"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _connection(client: DaemonClient) -> socket.socket:
    """The socket of the client's one idle connection."""
    [conn] = client._idle
    return conn.sock


def _closed_by_peer(sock: socket.socket) -> bool:
    """Whether the daemon closed its end: readable, and what is there is the end of file."""
    sock.setblocking(False)
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    finally:
        sock.setblocking(True)


def _client(d, kind: str) -> DaemonClient:
    if kind == "tcp":
        return DaemonClient(f"tcp://127.0.0.1:{d.tcp_port}", token=TOKEN)
    return DaemonClient(d.socket)


@pytest.fixture(params=["unix", "tcp"])
def served(request, daemon, sample):
    """A daemon that serves ``sample`` on its unix socket and on loopback TCP (with a token),
    ranks not reclaimed while a test holds one idle; and how this test talks to it."""
    port = _free_port()
    d = daemon({"STREAMER_TOKEN": TOKEN, "STREAMER_RANK_TIMEOUT_S": "600"}, "--tcp-port", str(port), "--allow", str(sample))
    d.tcp_port = port
    return d, request.param


def test_a_connection_the_daemon_closed_while_idle_is_reopened_mid_load(served, sample):
    d, kind = served
    client = _client(d, kind)
    assert client.reachable()
    first = _connection(client)
    assert client.call("/v1/stats")["sessions"] == []
    assert _connection(client) is first  # kept alive: the same connection for the next call
    # The daemon closes a connection left idle (uvicorn's keep-alive timeout): wait until it has.
    wait_until(lambda: _closed_by_peer(first), 60, "the daemon to close the idle connection")
    # The join (a POST, sent once) goes out on a new connection, and so does the next request
    # (a /next, or the leave) after the consumer sat on a tensor until the daemon closed the
    # connection again.
    request = StreamRequest(str(sample), launch_id="idle-test")
    got: dict[str, torch.Tensor] = {}
    tensors = daemon_stream(client, request)
    name, tensor = next(tensors)
    got[name] = tensor
    held = _connection(client)
    assert held is not first
    wait_until(lambda: _closed_by_peer(held), 60, "the daemon to close the connection idle mid-load")
    got.update(tensors)
    truth = ground_truth(sample)
    assert got.keys() == truth.keys()
    for n, want in truth.items():
        assert got[n].dtype == want.dtype and torch.equal(got[n], want), n
    assert d.finished()[-1]["state"] == "done"


def test_a_daemon_killed_between_calls_is_a_daemon_error_naming_the_socket(served):
    d, kind = served
    client = _client(d, kind)
    where = f"tcp://127.0.0.1:{d.tcp_port}" if kind == "tcp" else str(d.socket)
    assert client.call("/v1/stats")["sessions"] == []
    d.stop(signal.SIGKILL)
    for body in (None, {"uri": "/nowhere", "session": "s", "rank": 0, "world_size": 1}):  # a GET and a POST
        with pytest.raises(DaemonError) as caught:
            client.call("/v1/sessions/join" if body else "/v1/stats", body)
        assert str(caught.value).startswith(f"streamer daemon at {where} unreachable or gone (ConnectionRefusedError: ")
    assert not client.reachable()
    client.close()


class CuttingProxy:
    """A unix socket in front of the daemon's: forwards each connection whole, counts them, and
    cuts every one on :meth:`cut` (a connection lost with a request in flight)."""

    def __init__(self, path, upstream) -> None:
        self.path, self.upstream = str(path), str(upstream)
        self.accepted = 0
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        self._listener = socket.socket(socket.AF_UNIX)
        self._listener.bind(self.path)
        self._listener.listen()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            self.accepted += 1
            up = socket.socket(socket.AF_UNIX)
            up.connect(self.upstream)
            self._pairs.append((conn, up))
            for a, b in ((conn, up), (up, conn)):
                threading.Thread(target=_pump, args=(a, b), daemon=True).start()

    def cut(self) -> None:
        for pair in self._pairs:
            for s in pair:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.cut()
        self._listener.close()


def _pump(a: socket.socket, b: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := a.recv(65536):
            b.sendall(data)


def test_a_connection_lost_while_a_join_waits_is_a_daemon_error_and_the_join_is_not_sent_again(daemon, sample, tmp_path):
    """A join waits for every rank with no read timeout; its connection cut under it ends it with
    a DaemonError, and the join goes out once: the daemon may have counted it."""
    d = daemon({"STREAMER_RANK_TIMEOUT_S": "600"})
    proxy = CuttingProxy(tmp_path / "proxy.sock", d.socket)
    client = DaemonClient(proxy.path)
    outcome: list[BaseException] = []

    def join() -> None:
        try:
            client.call("/v1/sessions/join", {"uri": str(sample), "session": "s", "rank": 0, "world_size": 2}, read_timeout=None)
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            outcome.append(exc)

    waiting = threading.Thread(target=join, daemon=True)
    waiting.start()
    try:
        wait_until(lambda: any(len(s["ranks"]) == 1 for s in d.stats()["sessions"]), 60, "the daemon to count the join")
        proxy.cut()
        waiting.join(timeout=60)
        assert not waiting.is_alive(), "the join still waits on a connection that is gone"
    finally:
        proxy.close()
    [exc] = outcome
    assert isinstance(exc, DaemonError), repr(exc)
    assert str(exc).startswith(f"streamer daemon at {proxy.path} unreachable or gone ("), str(exc)
    assert proxy.accepted == 1  # one connection: the join was not sent again on a new one
    assert client._idle == []  # and the cut one is not kept


def test_error_replies_keep_their_classes_on_a_kept_connection(served, sample):
    d, kind = served
    client = _client(d, kind)
    body = {"uri": str(sample), "session": "s", "rank": 0, "world_size": 1, "select": ["no-such-tensor"]}
    for _ in range(2):
        with pytest.raises(SelectionError):
            client.call("/v1/sessions/join", body)
    status, ready = client.get("/readyz")
    assert status == 200 and ready["status"] == "ready"
    assert len(client._idle) == 1  # error replies leave the connection in use


def test_tcp_without_the_token_is_refused(daemon, sample):
    port = _free_port()
    daemon({"STREAMER_TOKEN": TOKEN}, "--tcp-port", str(port), "--allow", str(sample))
    assert DaemonClient(f"tcp://127.0.0.1:{port}", token=TOKEN).reachable()
    client = DaemonClient(f"tcp://127.0.0.1:{port}", token="wrong")
    assert not client.reachable()
    status, body = client.get("/healthz")
    assert status == 401 and body["error"]["type"] == "StorageAccessDeniedError"
    with pytest.raises(errors.StorageAccessDeniedError, match="missing or wrong bearer token"):
        client.call("/v1/stats")


LOAD = """
import json, sys
import streamer_client
state = streamer_client.load_state_dict(sys.argv[1], require_daemon=True)
print(json.dumps({"tensors": len(state), "http": sorted(m for m in sys.modules if m.split(".")[0] in ("httpx", "httpcore", "h11", "anyio"))}))
"""


def test_a_fresh_process_loading_through_the_daemon_imports_no_http_package(daemon, sample):
    d = daemon()
    result = subprocess.run(
        [sys.executable, "-c", LOAD, str(sample)], env=d.rank_env(), capture_output=True, text=True, timeout=180
    )
    assert result.returncode == 0, result.stderr[-3000:]
    reply = json.loads(result.stdout.strip().splitlines()[-1])
    assert reply == {"tensors": len(ground_truth(sample)), "http": []}
    assert d.finished()[-1]["state"] == "done"  # it went through the daemon
