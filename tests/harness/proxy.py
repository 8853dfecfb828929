"""A counting reverse HTTP proxy on 127.0.0.1, put in front of one storage emulator.

Every request is forwarded unchanged (method, path, query, headers including ``Host``, body)
and recorded as a :class:`RecordedRequest`. Responses are read fully from upstream and sent
back with a correct ``Content-Length`` (hop-by-hop headers dropped), over HTTP/1.1 keep-alive.

Fault injection: ``proxy.delay_s`` sleeps before each request is handled; ``proxy.fault`` is
called with each request and may return a :class:`Fault` to answer a status + body instead of
forwarding, or to drop the connection, or to forward and then damage the response body
(:class:`Damage`: cut short and closed, reset mid-body, or stalled after the headers and part
of the body). A stalled response waits until ``stall_s`` passes or the proxy is reset/stopped.
"""

from __future__ import annotations

import enum
import http.client
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

__all__ = ["RecordedRequest", "Damage", "Fault", "CountingProxy"]

# Hop-by-hop headers (RFC 9110 §7.6.1) plus the framing headers we recompute.
_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "expect",  # 100-continue is answered by this proxy itself
        "content-length",
    }
)


@dataclass(frozen=True)
class RecordedRequest:
    method: str
    path: str  # percent-decoded path, without the query ("/bucket/dir/file" for GCS too)
    query: str  # raw query string, "" when none
    range: str | None  # Range header (Azure: x-ms-range, preferred) as sent; None when absent
    status: int | None = None  # status sent back; None when the connection was dropped


class Damage(enum.Enum):
    """What happens to a forwarded response after its headers and the first half of its body."""

    TRUNCATE = "truncate"  # the connection is closed (FIN): fewer bytes than Content-Length
    RESET = "reset"  # the connection is reset (RST)
    STALL = "stall"  # nothing more is sent for ``stall_s``; then the connection is closed


@dataclass(frozen=True)
class Fault:
    """What the proxy does instead of forwarding a request (or to the response it forwards)."""

    status: int = 503
    body: bytes = b""
    headers: tuple[tuple[str, str], ...] = ()
    drop: bool = False  # close the connection without any response
    damage: Damage | None = None  # forward, then damage the response body
    stall_s: float = 0.0  # Damage.STALL: how long to send nothing

    @classmethod
    def drop_connection(cls) -> Fault:
        return cls(drop=True)

    @classmethod
    def truncated(cls) -> Fault:
        return cls(damage=Damage.TRUNCATE)

    @classmethod
    def reset(cls) -> Fault:
        return cls(damage=Damage.RESET)

    @classmethod
    def stalled(cls, seconds: float) -> Fault:
        return cls(damage=Damage.STALL, stall_s=seconds)


FaultHook = Callable[[RecordedRequest], Fault | None]


class _DropConnection(Exception):
    pass


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive; also makes the base class answer 100-continue
    server: _Server
    _upstream: http.client.HTTPConnection | None = None
    _upstream_used = False

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - quiet
        pass

    def setup(self) -> None:
        super().setup()
        self.server.track(self.connection, add=True)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.server.track(self.connection, add=False)
            if self._upstream is not None:
                self._upstream.close()

    # Every method goes through one handler.
    def __getattr__(self, name: str):
        if name.startswith("do_"):
            return self._handle
        raise AttributeError(name)

    def _read_body(self) -> bytes | None:
        te = self.headers.get("Transfer-Encoding", "")
        if "chunked" in te.lower():
            chunks = []
            while True:
                line = self.rfile.readline(65537)
                if not line:
                    raise _DropConnection("client closed inside a chunked body")
                size = int(line.split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline(65537) not in (b"\r\n", b"\n", b""):
                        pass  # trailers: dropped
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline(65537)  # CRLF after the chunk
        length = self.headers.get("Content-Length")
        if length is None:
            return None
        return self.rfile.read(int(length))

    def _handle(self) -> None:
        proxy = self.server.proxy
        try:
            body = self._read_body()
        except (_DropConnection, ValueError):
            self.close_connection = True
            return
        parts = urlsplit(self.path)
        record = RecordedRequest(
            method=self.command,
            path=unquote(parts.path),
            query=parts.query,
            range=self.headers.get("x-ms-range") or self.headers.get("Range"),
        )
        if proxy.delay_s > 0:
            time.sleep(proxy.delay_s)
        hook = proxy.fault
        fault = hook(record) if hook is not None else None
        if fault is not None and fault.damage is not None:
            try:
                status, reason, headers, data, _ = self._forward(body)
            except (OSError, http.client.HTTPException):
                self.close_connection = True
                return
            proxy._record(replace(record, status=None))  # the client never got a whole response
            self._respond_damaged(status, reason, headers, data, fault)
            return
        if fault is not None:
            if fault.drop:
                proxy._record(record)
                self.close_connection = True
                try:
                    self.connection.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                return
            proxy._record(replace(record, status=fault.status))
            self._respond(fault.status, "", list(fault.headers), fault.body, None)
            return
        try:
            status, reason, headers, data, length = self._forward(body)
        except (OSError, http.client.HTTPException) as e:
            status, reason, headers, data, length = (
                502,
                "Bad Gateway",
                [("Content-Type", "text/plain")],
                f"proxy: upstream error: {e!r}".encode(),
                None,
            )
        proxy._record(replace(record, status=status))
        self._respond(status, reason, headers, data, length)

    def _forward(self, body: bytes | None):
        for attempt in (0, 1):
            reused = self._upstream is not None and self._upstream_used
            if self._upstream is None:
                host, port = self.server.proxy.upstream
                self._upstream = http.client.HTTPConnection(host, port, timeout=self.server.proxy.timeout_s)
                self._upstream_used = False
            conn = self._upstream
            try:
                conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                if "Host" not in self.headers:
                    conn.putheader("Host", f"{conn.host}:{conn.port}")
                dropped = {t.strip().lower() for t in self.headers.get("Connection", "").split(",") if t.strip()}
                for name, value in self.headers.items():
                    if name.lower() not in _HOP_BY_HOP and name.lower() not in dropped:
                        conn.putheader(name, value)
                if body is not None:
                    conn.putheader("Content-Length", str(len(body)))
                conn.endheaders(body)
                resp = conn.getresponse()
                data = resp.read()
            except (OSError, http.client.HTTPException):
                conn.close()
                self._upstream = None
                if attempt == 0 and reused:
                    continue  # stale keep-alive connection closed by upstream: retry once
                raise
            self._upstream_used = True
            if resp.will_close:
                conn.close()
                self._upstream = None
            return resp.status, resp.reason, resp.getheaders(), data, resp.getheader("Content-Length")
        raise AssertionError("unreachable")

    def _respond_damaged(self, status, reason, headers, data: bytes, fault: Fault) -> None:
        """Headers with the true Content-Length, half the body, then ``fault.damage``."""
        self.close_connection = True
        self.send_response_only(status, reason or None)
        for name, value in headers:
            if name.lower() not in _HOP_BY_HOP:
                self.send_header(name, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        try:
            self.wfile.write(data[: len(data) // 2])
            self.wfile.flush()
            if fault.damage is Damage.STALL:
                self.server.proxy._unstall.wait(fault.stall_s)
            if fault.damage is Damage.RESET:
                # SO_LINGER with a zero timeout: close() sends RST instead of FIN.
                # Closed here: the server's own shutdown(SHUT_WR) would send a FIN first.
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self.connection.close()
            else:
                self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _respond(self, status, reason, headers, data: bytes, upstream_length: str | None) -> None:
        self.send_response_only(status, reason or None)
        for name, value in headers:
            if name.lower() not in _HOP_BY_HOP:
                self.send_header(name, value)
        no_body = self.command == "HEAD" or status in (204, 304) or 100 <= status < 200
        if no_body:
            if upstream_length is not None:  # HEAD: the size of what a GET would return
                self.send_header("Content-Length", upstream_length)
        else:
            self.send_header("Content-Length", str(len(data)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if not no_body and data:
            self.wfile.write(data)
        self.wfile.flush()


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False  # open keep-alive connections are closed by CountingProxy.stop()
    request_queue_size = 128

    def __init__(self, address, proxy: CountingProxy) -> None:
        self.proxy = proxy
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        super().__init__(address, _Handler)

    def track(self, conn: socket.socket, add: bool) -> None:
        with self._conns_lock:
            (self._conns.add if add else self._conns.discard)(conn)

    def close_connections(self) -> None:
        with self._conns_lock:
            conns = list(self._conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class CountingProxy:
    """Reverse proxy ``http://127.0.0.1:<port>`` → ``upstream`` (``http://host:port``).

    The listening socket is bound at construction, so ``url`` is known before ``start()``
    (and before the upstream is even running).
    """

    def __init__(self, upstream: str, *, host: str = "127.0.0.1", port: int = 0, timeout_s: float = 120.0):
        self.upstream = _parse_upstream(upstream)
        self.timeout_s = timeout_s
        self.delay_s: float = 0.0
        self.fault: FaultHook | None = None
        self._unstall = threading.Event()  # set: stalled responses stop waiting
        self._records: list[RecordedRequest] = []
        self._lock = threading.Lock()
        self._server = _Server((host, port), self)
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    @property
    def url(self) -> str:
        return f"http://{self._server.server_address[0]}:{self.port}"

    def set_upstream(self, upstream: str) -> None:
        self.upstream = _parse_upstream(upstream)

    # -- lifecycle
    def start(self) -> CountingProxy:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._server.serve_forever,
                kwargs={"poll_interval": 0.1},
                name=f"counting-proxy-{self.port}",
                daemon=True,
            )
            self._thread.start()
        return self

    def stop(self) -> None:
        self._unstall.set()
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join()
            self._thread = None
        self._server.close_connections()
        self._server.server_close()

    def __enter__(self) -> CountingProxy:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- records
    def _record(self, r: RecordedRequest) -> None:
        with self._lock:
            self._records.append(r)

    @property
    def requests(self) -> list[RecordedRequest]:
        with self._lock:
            return list(self._records)

    def reset(self) -> None:
        """Forget the recorded requests (``delay_s`` and ``fault`` stay as they are)."""
        with self._lock:
            self._records.clear()

    def release_stalls(self) -> None:
        """End every stalled response now; later stalls wait again."""
        self._unstall.set()
        self._unstall = threading.Event()

    def count(
        self,
        method: str | None = None,
        path_contains: str | None = None,
        has_range: bool | None = None,
    ) -> int:
        return sum(
            1
            for r in self.requests
            if (method is None or r.method == method.upper())
            and (path_contains is None or path_contains in r.path)
            and (has_range is None or (r.range is not None) == has_range)
        )


def _parse_upstream(url: str) -> tuple[str, int]:
    parts = urlsplit(url if "://" in url else f"http://{url}")
    if parts.scheme != "http" or not parts.hostname or not parts.port:
        raise ValueError(f"upstream must be http://host:port, got {url!r}")
    return parts.hostname, parts.port
