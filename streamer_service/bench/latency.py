"""A TCP proxy on 127.0.0.1 that makes a loopback storage server answer like a remote one.

Object stores answer a ranged GET's first byte in tens of milliseconds; a server on loopback in
microseconds, so on loopback a reader that keeps too few requests in flight looks as fast as
one that keeps enough. :class:`LatencyProxy` sits between the readers and the server and holds
each request for ``delay_s`` before passing it on: every request's first byte comes ``delay_s``
later, and only concurrency hides it. Bytes are passed through unchanged, both ways.

A request is what a client sends after the server last sent it something (HTTP/1.1 clients do
not pipeline: one request, then its response, on a connection). What it counts: requests,
connections, the most connections open at once, and bytes each way.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from dataclasses import dataclass

__all__ = ["LatencyProxy", "ProxyCounts"]

HOST = "127.0.0.1"
_CHUNK = 1 << 20


@dataclass
class ProxyCounts:
    requests: int = 0  # each held for the delay
    connections: int = 0
    peak_connections: int = 0  # open at once
    bytes_up: int = 0  # client -> server
    bytes_down: int = 0  # server -> client


class LatencyProxy:
    """``with LatencyProxy("127.0.0.1", port, 0.030) as proxy: ... proxy.endpoint ...``"""

    def __init__(self, upstream_host: str, upstream_port: int, delay_s: float) -> None:
        if delay_s < 0:
            raise ValueError(f"delay must be >= 0 s, got {delay_s!r}")
        self.upstream = (upstream_host, upstream_port)
        self.delay_s = delay_s
        self.counts = ProxyCounts()
        self.port = 0
        self._open = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.base_events.Server | None = None
        self._thread: threading.Thread | None = None
        self._tasks: set[asyncio.Task] = set()

    @classmethod
    def for_url(cls, url: str, delay_s: float) -> LatencyProxy:
        """A proxy in front of ``http://host:port``."""
        from urllib.parse import urlsplit

        parts = urlsplit(url)
        if parts.scheme != "http" or parts.hostname is None or parts.port is None:
            raise ValueError(f"the latency proxy needs a plain http://host:port endpoint, got {url!r}")
        return cls(parts.hostname, parts.port, delay_s)

    @property
    def endpoint(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self) -> LatencyProxy:
        started = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                self._server = loop.run_until_complete(asyncio.start_server(self._serve, HOST, 0))
                self.port = self._server.sockets[0].getsockname()[1]
            except BaseException as exc:  # noqa: BLE001 - raised in start()
                failure.append(exc)
                started.set()
                loop.close()
                return
            started.set()
            try:
                loop.run_forever()
            finally:
                loop.close()

        self._thread = threading.Thread(target=run, name="latency-proxy", daemon=True)
        self._thread.start()
        started.wait()
        if failure:
            raise failure[0]
        return self

    def close(self) -> None:
        loop, self._loop = self._loop, None
        if loop is None:
            return

        async def stop() -> None:
            self._server.close()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await self._server.wait_closed()

        asyncio.run_coroutine_threadsafe(stop(), loop).result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)
        self._thread.join(timeout=30)

    def __enter__(self) -> LatencyProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ one connection

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._tasks.add(task)
        counts = self.counts
        counts.connections += 1
        self._open += 1
        counts.peak_connections = max(counts.peak_connections, self._open)
        server_w = None
        try:
            server_r, server_w = await asyncio.open_connection(*self.upstream)
            answered = [True]  # the server spoke since the client last did: the next bytes are a new request
            up = asyncio.ensure_future(self._pump_up(client_r, server_w, answered))
            down = asyncio.ensure_future(self._pump_down(server_r, client_w, answered))
            done, pending = await asyncio.wait((up, down), return_when=asyncio.FIRST_COMPLETED)
            for other in pending:
                other.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            self._open -= 1
            for writer in (client_w, server_w):
                if writer is not None:
                    writer.close()
                    with contextlib.suppress(Exception):
                        await writer.wait_closed()
            self._tasks.discard(task)

    async def _pump_up(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, answered: list[bool]) -> None:
        while data := await reader.read(_CHUNK):
            if answered[0]:
                answered[0] = False
                self.counts.requests += 1
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
            self.counts.bytes_up += len(data)
            writer.write(data)
            await writer.drain()

    async def _pump_down(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, answered: list[bool]) -> None:
        while data := await reader.read(_CHUNK):
            answered[0] = True
            self.counts.bytes_down += len(data)
            writer.write(data)
            await writer.drain()
