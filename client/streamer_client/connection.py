"""The connection to the node daemon: HTTP on its unix socket (or loopback TCP with a token).

No torch here: metadata pulls, health checks and the service's own drivers (the demo and the
benchmarks start a daemon and read its stats) talk to the daemon without loading tensors.
Tensors are :mod:`streamer_client.daemon`'s. Replies and error bodies are
:mod:`streamer_client.protocol`'s.
"""

from __future__ import annotations

from pathlib import Path

import httpx

from . import protocol
from .errors import DaemonError

__all__ = ["POLL_WAIT_S", "DaemonClient"]

POLL_WAIT_S = 2.0  # a long-poll; a daemon that dies is noticed at once (the socket resets)


class DaemonClient:
    """Talks to the daemon on its unix socket."""

    def __init__(self, socket: Path | str, *, connect_timeout_s: float = 5.0, token: str | None = None) -> None:
        """``socket``: a unix socket path, or ``tcp://127.0.0.1:PORT`` (then ``token`` is sent)."""
        self.socket = socket
        self._timeout = connect_timeout_s
        timeout = httpx.Timeout(connect_timeout_s, read=POLL_WAIT_S + connect_timeout_s)
        address = str(socket)
        # Plain HTTP on a unix socket or loopback: no TLS, so no CA bundle to load (verify=True
        # would parse it for every client, 0.1-0.35 s of every stream() call).
        if address.startswith("tcp://"):
            headers = {"Authorization": f"Bearer {token}"} if token else {}
            self._http = httpx.Client(
                base_url="http://" + address[len("tcp://") :], timeout=timeout, headers=headers, verify=False
            )
        else:
            self._http = httpx.Client(
                transport=httpx.HTTPTransport(uds=address, verify=False), base_url="http://streamer-daemon", timeout=timeout
            )

    def close(self) -> None:
        self._http.close()

    def reachable(self) -> bool:
        try:
            return self._http.get("/healthz", timeout=self._timeout).status_code == 200
        except httpx.HTTPError:
            return False

    def call(self, path: str, body: dict | None = None, *, read_timeout: float | None = -1.0) -> dict:
        """POST ``body`` (GET without one); our error classes for error replies."""
        timeout = httpx.Timeout(self._timeout, read=read_timeout) if read_timeout != -1.0 else None
        try:
            if body is None:
                reply = self._http.get(path, **({"timeout": timeout} if timeout else {}))
            else:
                reply = self._http.post(path, json=body, **({"timeout": timeout} if timeout else {}))
        except httpx.TransportError as exc:
            raise DaemonError(f"streamer daemon at {self.socket} unreachable or gone ({type(exc).__name__}: {exc})") from None
        try:
            data = reply.json()
        except ValueError:
            raise DaemonError(f"streamer daemon at {self.socket} answered {reply.status_code} without JSON") from None
        if reply.status_code >= 400:
            raise protocol.error_from_body(data, reply.status_code, self.socket)
        return data
