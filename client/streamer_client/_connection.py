"""The connection to the node daemon: HTTP on its unix socket (or loopback TCP with a token).

No torch here: metadata pulls, health checks and the service's own drivers (the demo and the
benchmarks start a daemon and read its stats) talk to the daemon without loading tensors.
Tensors are :mod:`streamer_client._daemon`'s. Replies and error bodies are
:mod:`streamer_client._protocol`'s.

The standard library's ``http.client`` speaks the HTTP: a rank process imports nothing for it
beyond what Python has (an HTTP client package costs a fresh process its import inside the
timed first load). A client keeps its connection open across calls (a load makes dozens of
``/next`` calls). The daemon closes a connection that sat idle for a few seconds; before a call
reuses one, a zero-timeout poll sees whether the daemon closed it (readable while no reply is
due: its end of file), and the call connects afresh. A request is never sent twice: once sent,
a failure is a :class:`DaemonError`, as the daemon may have acted on it (a join, a release).
"""

from __future__ import annotations

import http.client
import json
import select
import socket as _socket
import threading
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from . import _protocol as protocol
from .errors import DaemonError

__all__ = ["POLL_WAIT_S", "DaemonClient"]

POLL_WAIT_S = 2.0  # a long-poll; a daemon that dies is noticed at once (the socket resets)

_FAILURES = (OSError, http.client.HTTPException)  # a socket error, a timeout, a broken or cut reply


class _UnixConnection(http.client.HTTPConnection):
    """HTTP/1.1 on a unix socket; ``timeout`` bounds the connect."""

    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("streamer-daemon", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
        try:
            sock.settimeout(self.timeout)
            sock.connect(self._path)
        except BaseException:
            sock.close()
            raise
        self.sock = sock


def _dropped(sock: _socket.socket) -> bool:
    """Whether the daemon closed this idle connection: readable while no reply is due (its end of
    file, or bytes out of turn, or an error), the check urllib3 makes before it reuses one."""
    poller = select.poll()  # not select.select: it cannot watch a descriptor above 1023
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0))


class DaemonClient:
    """Talks to the daemon on its unix socket.

    Safe to share between threads: a call takes the idle connection, or opens one when none is
    idle (another thread's call holds it), and gives it back once the reply is read.
    """

    def __init__(self, socket: Path | str, *, connect_timeout_s: float = 5.0, token: str | None = None) -> None:
        """``socket``: a unix socket path, or ``tcp://127.0.0.1:PORT`` (then ``token`` is sent)."""
        self.socket = socket
        self._timeout = connect_timeout_s
        self._headers: dict[str, str] = {}
        address = str(socket)
        if address.startswith("tcp://"):
            where = urlsplit("http://" + address[len("tcp://") :])
            host, port = where.hostname or "127.0.0.1", where.port
            self._open = lambda: http.client.HTTPConnection(host, port, timeout=connect_timeout_s)
            if token:
                self._headers["Authorization"] = f"Bearer {token}"
        else:
            self._open = lambda: _UnixConnection(address, connect_timeout_s)
        self._idle: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()

    def close(self) -> None:
        """Closes the idle connection (a later call opens a new one)."""
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def reachable(self) -> bool:
        try:
            return self._exchange("GET", "/healthz", None, self._timeout)[0] == 200
        except _FAILURES:
            return False

    def get(self, path: str) -> tuple[int, Any]:
        """GET ``path``, reading with the connect timeout: the status and the JSON body, whatever
        the status (a health probe reads why ``/readyz`` answered 503). ``DaemonError`` when no
        daemon answers or the reply is not JSON."""
        return self._json(*self._exchange_or_raise("GET", path, None, self._timeout))

    def call(self, path: str, body: dict | None = None, *, read_timeout: float | None = -1.0) -> dict:
        """POST ``body`` as JSON (GET without one); our error classes for error replies.

        ``read_timeout``: how long a reply may keep us waiting between bytes; ``None`` waits as
        long as it takes (a join blocks until every rank joined; the daemon bounds it); the
        default is a long-poll's wait plus the connect timeout.
        """
        payload = None if body is None else json.dumps(body, separators=(",", ":")).encode()
        timeout = POLL_WAIT_S + self._timeout if read_timeout == -1.0 else read_timeout
        status, data = self._json(*self._exchange_or_raise("POST" if body is not None else "GET", path, payload, timeout))
        if status >= 400:
            raise protocol.error_from_body(data, status, self.socket)
        return data

    def _json(self, status: int, content: bytes) -> tuple[int, Any]:
        try:
            return status, json.loads(content)
        except ValueError:
            raise DaemonError(f"streamer daemon at {self.socket} answered {status} without JSON") from None

    def _exchange_or_raise(self, method: str, path: str, payload: bytes | None, read_timeout: float | None) -> tuple[int, bytes]:
        try:
            return self._exchange(method, path, payload, read_timeout)
        except _FAILURES as exc:
            raise DaemonError(f"streamer daemon at {self.socket} unreachable or gone ({type(exc).__name__}: {exc})") from None

    def _exchange(self, method: str, path: str, payload: bytes | None, read_timeout: float | None) -> tuple[int, bytes]:
        """One request and its whole reply (status, body bytes) on a live connection."""
        conn = self._take()
        try:
            if conn.sock is None:
                conn.connect()
            conn.sock.settimeout(self._timeout)  # sending: the connect timeout
            headers = {"Content-Type": "application/json", **self._headers} if payload is not None else self._headers
            conn.request(method, path, body=payload, headers=headers)
            conn.sock.settimeout(read_timeout)
            reply = conn.getresponse()
            content = reply.read()
        except BaseException:
            conn.close()  # half a request or half a reply: the connection is of no further use
            raise
        if conn.sock is not None:  # a reply with "Connection: close" closed it already
            with self._lock:
                self._idle.append(conn)
        return reply.status, content

    def _take(self) -> http.client.HTTPConnection:
        """The idle connection if the daemon still holds it open, else a new one (not yet connected)."""
        with self._lock:
            while self._idle:
                conn = self._idle.pop()
                if not _dropped(conn.sock):
                    return conn
                conn.close()
        return self._open()
