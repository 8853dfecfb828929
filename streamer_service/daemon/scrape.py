"""The metrics listener: ``GET /metrics`` and ``GET /healthz`` on a TCP port, for Prometheus and
kubelet probes (``serve --metrics-port PORT``; off unless asked).

Read-only by construction: a plain ``http.server`` on its own thread that knows two paths and the
GET and HEAD methods, and nothing of the API (sessions, metadata pulls). So it needs no bearer
token and may listen on the pod IP, where the API's TCP listener (``--tcp-port``) stays on
127.0.0.1 behind a token. Labels carry no URI, key or credential.

``/healthz`` asks the API on its unix socket (``/readyz``) and answers what it heard, so a probe
sees the API's own event loop answer, not only this thread: 200 ``{"status": "ready"}``, else 503.
It costs one HTTP request on a unix socket. An exec probe starts ``streamer-service health`` every
period instead: a new interpreter and the CLI's imports every time.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from streamer_client._connection import DaemonClient
from streamer_client.errors import ConfigError, DaemonError

from .metrics import CONTENT_TYPE

__all__ = ["MetricsListener"]

log = logging.getLogger(__name__)

_HEALTH_TIMEOUT_S = 2.0  # below a kubelet probe's default timeoutSeconds of 1 s x a few retries


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True


class MetricsListener:
    """Serves ``render()`` at ``/metrics`` and the API's readiness at ``/healthz`` on ``host:port``.

    ``render`` returns the metrics text, or ``None`` while the daemon is still starting (503).
    Binding happens in the constructor, so a port in use is a start-up error (``ConfigError``).
    """

    def __init__(self, host: str, port: int, render: Callable[[], bytes | None], api_socket: Path) -> None:
        handler = _handler(render, api_socket)
        server = type("_Server", (_Server,), {"address_family": socket.AF_INET6 if ":" in host else socket.AF_INET})
        try:
            self._server = server((host, port), handler)
        except OSError as exc:
            raise ConfigError(f"cannot listen for metrics on {host}:{port}: {exc.strerror or exc}") from None
        self.address = self._server.server_address[:2]
        self._thread = threading.Thread(target=self._server.serve_forever, name="metrics-listener", daemon=True)

    def start(self) -> None:
        self._thread.start()
        log.info("metrics on http://%s:%d/metrics (read-only; /healthz for probes)", *self.address)

    def close(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()
        self._server.server_close()


def _handler(render: Callable[[], bytes | None], api_socket: Path) -> type[BaseHTTPRequestHandler]:
    def readiness() -> tuple[int, dict]:
        # A connection per scrape: scrapes come further apart than the API keeps one open idle.
        client = DaemonClient(api_socket, connect_timeout_s=_HEALTH_TIMEOUT_S)
        try:
            status, reply = client.get("/readyz")
        except DaemonError as exc:
            return 503, {"status": "unavailable", "error": f"the API on {api_socket} does not answer: {exc}"}
        finally:
            client.close()
        if status != 200:
            body = {"status": "unavailable", "error": f"/readyz on {api_socket} answered {status}"}
            with contextlib.suppress(AttributeError):
                if reasons := reply.get("reasons"):  # not ready: why (the reaper, the shm room, stopping)
                    body["reasons"] = reasons
            return 503, body
        return 200, {"status": reply.get("status", "ready")}

    class Handler(BaseHTTPRequestHandler):
        server_version = "streamer-service-metrics"
        sys_version = ""

        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            self._answer(body=True)

        def do_HEAD(self) -> None:  # noqa: N802
            self._answer(body=False)

        def _answer(self, *, body: bool) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                text = render()
                if text is None:
                    self._send(503, b"the daemon is starting\n", "text/plain; charset=utf-8", body)
                else:
                    self._send(200, text, CONTENT_TYPE, body)
            elif path == "/healthz":
                status, reply = readiness()
                self._send(status, json.dumps(reply).encode() + b"\n", "application/json", body)
            else:
                self._send(404, b"only /metrics and /healthz here\n", "text/plain; charset=utf-8", body)

        def _send(self, status: int, payload: bytes, content_type: str, body: bool) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            if body:
                self.wfile.write(payload)

        def log_message(self, format: str, *args) -> None:  # noqa: A002 - one line per scrape is noise
            log.debug("metrics listener: " + format, *args)

    # Every other method (POST, PUT, DELETE, ...) gets http.server's 501: this listener changes nothing.
    return Handler
