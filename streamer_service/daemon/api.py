"""The daemon's HTTP API (FastAPI on a unix socket). ``create_app(settings)``; nothing at import.

Routes (JSON in the format of ``streamer_client._protocol``, which both sides import; errors are
``{"error": {"type", "message", "uri", "key"}}`` with the class name from ``streamer_client.errors``,
which the client raises again):

    GET  /healthz                                   the process is up
    GET  /readyz                                    the daemon can take sessions
    GET  /v1/stats                                  budget, bytes read, sessions
    GET  /metrics                                   Prometheus text format
    POST /v1/metadata                               pull a URI's metadata; -> {"path"}
    POST /v1/sessions/join                          join a load as rank r; blocks until all ranks joined
    POST /v1/sessions/{id}/ranks/{rank}/next        release batches, long-poll ready handles
    POST /v1/sessions/{id}/ranks/{rank}/leave       done, abandoning or failed ({"error"}): release everything
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import logging
import threading
from collections.abc import AsyncIterator, Callable
from typing import Annotated

import anyio.to_thread
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from streamer_client import errors
from streamer_client._protocol import ERROR_TEXT_LIMIT, JoinReply, MetadataReply, NextReply, error_body

from ..readers.choice import local_reader_in_force
from ..readers.runai import read_parallelism_in_force
from ..settings import Settings
from .core import Daemon
from .metrics import CONTENT_TYPE
from .process import peer_pid
from .readiness import segments_removed, shm_room

__all__ = ["PEER_PID", "PeerCredentialsProtocol", "create_app"]

log = logging.getLogger(__name__)

MAX_LIST = 100_000  # selection entries / releases in one request
MAX_PIECES = 1024  # slices of one tensor (a fused layout's pieces)

_Piece = Annotated[list[StrictInt], Field(min_length=3, max_length=3)]  # (dim, start, stop)
MAX_WAIT_S = 10.0
# Refused before anything is parsed: 100k selection entries of ~100-byte names fit in 16 MiB.
MAX_BODY_BYTES = 16 * 1024 * 1024

_STATUS = [
    (errors.SelectionError, 400),
    (errors.HeaderError, 422),
    (errors.CheckpointError, 422),
    (errors.InvalidURIError, 400),
    (errors.ConfigError, 400),
    (errors.UnsafeKeyError, 422),
    (errors.ObjectNotFoundError, 404),
    (errors.StorageAccessDeniedError, 403),
    (errors.SessionError, 409),
    (errors.CacheLockTimeoutError, 504),
    (errors.StorageError, 502),
]


PEER_PID = "streamer.peer_pid"
"""ASGI scope key: the PID of the process at the other end of the unix socket (SO_PEERCRED)."""


class PeerCredentialsProtocol(AutoHTTPProtocol):
    """uvicorn's HTTP protocol, adding the peer's PID of a unix-socket connection to each request's
    scope, so the daemon can watch a rank's process. Imported only by ``serve``."""

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        pid = peer_pid(transport.get_extra_info("socket"))
        if pid is not None:
            app = self.app

            async def with_peer(scope, receive, send) -> None:
                scope[PEER_PID] = pid
                await app(scope, receive, send)

            self.app = with_peer


class _BodyLimit:
    """ASGI middleware: a body larger than ``limit`` (by its Content-Length) is refused with 413
    before it is read; a body without a Content-Length (chunked) is refused with 411; a body that
    is not sent as JSON (``Content-Type: application/json``) with 415. pydantic's limits on list
    and string lengths apply only after the whole body was read and parsed."""

    def __init__(self, app, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] in ("POST", "PUT", "PATCH"):
            headers = dict(scope["headers"])
            length = headers.get(b"content-length")
            problem = None
            if length is None:
                if b"chunked" in headers.get(b"transfer-encoding", b""):
                    problem = (411, "a request body needs a Content-Length")
            elif not length.isdigit() or int(length) > self.limit:
                problem = (413, f"request body of {length.decode('latin-1')!s} bytes is over the limit of {self.limit} bytes")
            elif int(length) and not _is_json(headers.get(b"content-type", b"")):
                sent = headers.get(b"content-type", b"").decode("latin-1") or "no Content-Type"
                problem = (415, f"a request body must be JSON sent as Content-Type: application/json, got {sent!r}")
            if problem is not None:
                await JSONResponse(error_body("ConfigError", problem[1]), status_code=problem[0])(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _is_json(content_type: bytes) -> bool:
    kind = content_type.split(b";", 1)[0].strip().lower()
    return kind == b"application/json" or (kind.startswith(b"application/") and kind.endswith(b"+json"))


class _Model(BaseModel):
    """A request body as the daemon validates it: the fields of its class in ``streamer_client._protocol``
    (tests/test_protocol.py compares them), with their limits."""

    model_config = ConfigDict(extra="forbid")


class MetadataRequest(_Model):
    uri: str = Field(max_length=4096)
    force: bool | None = None
    launch_id: str | None = Field(default=None, max_length=256)


class JoinRequest(_Model):
    uri: str = Field(max_length=4096)
    session: str = Field(min_length=1, max_length=1024)
    rank: int = Field(ge=0, le=65535, strict=True)  # strict: true is not rank 1
    world_size: int = Field(ge=1, le=65536, strict=True)
    select: list[str] | None = Field(default=None, max_length=MAX_LIST)
    priority: list[str] | None = Field(default=None, max_length=MAX_LIST)
    launch_id: str | None = Field(default=None, max_length=256)
    force: bool | None = None  # TRTLLM_OBJECT_STORAGE_FORCE_PULL of the rank; None: the daemon's
    pins: bool = Field(default=False, strict=True)  # the rank may page-lock segments (JoinReply.ring_slots)
    dtypes: list[Annotated[str, Field(max_length=64)]] | None = Field(default=None, max_length=256)  # the rank's torch's
    fence: bool = Field(default=False, strict=True)  # the rank checks segment generations (JoinReply.generations)
    # The parts of tensors the rank keeps (streamer_client._slicing): name -> its pieces.
    slices: (
        dict[Annotated[str, Field(max_length=4096)], Annotated[list[_Piece], Field(min_length=1, max_length=MAX_PIECES)]] | None
    ) = Field(default=None, max_length=MAX_LIST)

    @field_validator("select", "priority")
    @classmethod
    def _text(cls, entries: list[str] | None) -> list[str] | None:
        """Entries are text a name can be (JSON lets a lone surrogate through as ``\\ud800``)."""
        for entry in entries or ():
            if not entry.isascii():
                try:
                    entry.encode()
                except UnicodeEncodeError:
                    raise ValueError(f"entry {entry!r} is not valid Unicode text (a lone surrogate)") from None
        return entries


class LeaveRequest(_Model):
    error: str | None = Field(default=None, max_length=ERROR_TEXT_LIMIT)  # the rank failed with this (not: abandoned)


class NextRequest(_Model):
    release: list[int] = Field(default_factory=list, max_length=MAX_LIST)
    wait_s: float = Field(default=2.0, ge=0, le=MAX_WAIT_S)
    fence: bool = Field(default=False, strict=True)  # handles with their generations (an older rank: without)


def create_app(settings: Settings) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Long-polls block a worker thread each (joins wait on the loop): 8 ranks x a few sessions need more than
        # anyio's default 40.
        anyio.to_thread.current_default_thread_limiter().total_tokens = 512
        daemon = Daemon(settings)
        daemon.start()
        app.state.daemon = daemon
        try:
            yield
        finally:
            daemon.stop()

    app = FastAPI(title="streamer-service", version="0.1.0", lifespan=lifespan)
    app.add_middleware(_BodyLimit, limit=MAX_BODY_BYTES)

    token = settings.token.get_secret_value().encode() if settings.token else None

    @app.middleware("http")
    async def require_token_over_tcp(request: Request, call_next):
        # The unix socket is guarded by its file mode; TCP (loopback only) by the bearer token.
        peer = request.scope.get("client")
        if peer and peer[0]:  # a TCP peer; unix-socket requests carry no address
            presented = request.headers.get("authorization", "").removeprefix("Bearer ").encode()
            if token is None or not hmac.compare_digest(presented, token):
                message = "missing or wrong bearer token (Authorization: Bearer $STREAMER_TOKEN)"
                return JSONResponse(error_body("StorageAccessDeniedError", message), status_code=401)
        return await call_next(request)

    @app.exception_handler(errors.StreamerError)
    async def streamer_error(request: Request, exc: errors.StreamerError) -> JSONResponse:
        status = next((code for cls, code in _STATUS if isinstance(exc, cls)), 500)
        request.app.state.daemon.metrics.errors.labels(type=type(exc).__name__).inc()
        return JSONResponse(error_body(type(exc).__name__, exc.message, uri=exc.uri, key=exc.key), status_code=status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # FastAPI's own refusals (no such path, method not allowed, a body it cannot parse) in our body.
        request.app.state.daemon.metrics.errors.labels(type="ConfigError").inc()
        where = f"{request.method} {request.url.path}"
        if exc.status_code == 404:
            message = f'{where}: no such path (the API: docs/daemon.md, "HTTP API", or GET /openapi.json)'
        elif exc.status_code == 405:
            allowed = next((v for k, v in (exc.headers or {}).items() if k.lower() == "allow"), "?")
            message = f"{where}: method not allowed (allowed: {allowed})"
        else:
            message = f"{where}: {exc.detail}"
        return JSONResponse(error_body("ConfigError", message), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        request.app.state.daemon.metrics.errors.labels(type="ConfigError").inc()
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()[:5])
        return JSONResponse(error_body("ConfigError", f"invalid request: {problems}"), status_code=422)

    def daemon(request: Request) -> Daemon:
        return request.app.state.daemon

    # Health and readiness on the event loop, never behind requests that wait in worker threads.
    @app.get("/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz(request: Request) -> JSONResponse:
        d = daemon(request)
        pages = d.store.pages
        held = d.budget.in_use + d.resident.stats().resident_bytes
        room = shm_room(d.store.shm_dir, pages, budget=d.budget.limit, slot=d.slot_size, in_flight=d.in_flight, held=held)
        reasons = [r for r in (
            "the daemon is stopping" if d.stopping else None,
            d.reaper_stopped or (None if d.reaper_alive() else "the reaper thread is not running"),
            segments_removed(d.store),
            room.problem,
        ) if r]  # fmt: skip
        body = {
            "status": "not ready" if reasons else "ready",
            **({"reasons": reasons} if reasons else {}),
            "shm_dir": str(d.store.shm_dir),
            "shm_budget": d.budget.limit,
            "shm_free": room.free,  # what the shm filesystem has free, against the budget claimed
            "shm_ring": room.ring,  # bytes of the ring one load streams through
            "shm_page_size": pages.size,  # docs/deploy.md, "Huge-page segments"
            "shm_pages": pages.source,
            "segments_prepared": d.pool.prepared,  # docs/deploy.md, "Segments made at start"
            "segments_preparing": d.pool.preparing,
            "read_parallelism": read_parallelism_in_force(settings),  # docs/configuration.md, "Read parallelism"
            "local_reader": local_reader_in_force(settings.local_reader),  # docs/configuration.md
        }
        return JSONResponse(body, status_code=503 if reasons else 200)

    @app.get("/metrics")
    def metrics(request: Request) -> Response:
        return Response(daemon(request).metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/stats")
    def stats(request: Request) -> dict:
        return daemon(request).stats().to_json()

    @app.post("/v1/metadata")
    def metadata(body: MetadataRequest, request: Request) -> dict:
        path = daemon(request).pull(body.uri, force=body.force, launch_id=body.launch_id)
        return MetadataReply(str(path)).to_wire()

    @app.post("/v1/sessions/join")
    async def join(body: JoinRequest, request: Request) -> dict:
        # Admission (the checkpoint opened, the selection checked) in a worker thread; the wait for
        # the other ranks on the event loop, so pending joins hold no thread, and a rank whose
        # connection closes while it waits is withdrawn from the session.
        loop = asyncio.get_running_loop()
        others_joined = asyncio.Event()

        def admit():
            session = daemon(request).join(
                uri=body.uri,
                key=body.session,
                rank=body.rank,
                world_size=body.world_size,
                select=body.select,
                priority=body.priority,
                launch_id=body.launch_id,
                force=body.force,
                pins=body.pins,
                dtypes=body.dtypes,
                slices=body.slices,
                peer_pid=request.scope.get(PEER_PID),
            )
            session.on_joined(functools.partial(_wake, loop, others_joined))
            return session

        session = await anyio.to_thread.run_sync(admit)
        if not await _wait_unless_disconnected(others_joined, request):
            await anyio.to_thread.run_sync(session.withdraw, body.rank)
            return {}  # nobody reads it
        rank = await anyio.to_thread.run_sync(session.joined, body.rank)
        # The shm dir as the daemon sees it; STREAMER_SHM_DIR overrides it in a rank that mounts
        # the same dir elsewhere.
        store = daemon(request).store
        return JoinReply(
            session.id, rank.to_hand_out, rank.keeps, str(session.checkpoint.metadata_dir), str(store.shm_dir),
            store.pages.size, session.from_memory(body.rank), session.ring_slots(body.rank),
            store.generations.name if body.fence else None,
        ).to_wire()  # fmt: skip

    @app.post("/v1/sessions/{session_id}/ranks/{rank}/next")
    async def next_handles(session_id: str, rank: int, body: NextRequest, request: Request) -> dict:
        gone = threading.Event()  # the connection closed: the handles stay for the rank's next request
        watch = asyncio.ensure_future(_on_disconnect(request, gone.set))

        def next_in_thread() -> tuple[list, bool]:
            session = daemon(request).session(session_id)
            return session.next(rank, body.release, body.wait_s, gone, peer_pid=request.scope.get(PEER_PID))

        try:
            handles, done = await anyio.to_thread.run_sync(next_in_thread)
        finally:
            watch.cancel()
        return NextReply(tuple(handles), done).to_wire(fenced=body.fence)

    @app.post("/v1/sessions/{session_id}/ranks/{rank}/leave")
    def leave(session_id: str, rank: int, request: Request, body: LeaveRequest | None = None) -> dict:
        try:
            session = daemon(request).session(session_id)
        except errors.SessionError:
            return {"left": False}  # already over: leaving is idempotent
        session.leave(rank, body.error if body is not None else None, peer_pid=request.scope.get(PEER_PID))
        return {"left": True}

    return app


def _wake(loop: asyncio.AbstractEventLoop, event: asyncio.Event) -> None:
    with contextlib.suppress(RuntimeError):  # the loop is gone: the server stopped
        loop.call_soon_threadsafe(event.set)


async def _on_disconnect(request: Request, then: Callable[[], None]) -> None:
    """Call ``then`` when the client's connection closes (its body was read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    then()


async def _wait_unless_disconnected(event: asyncio.Event, request: Request) -> bool:
    """Wait for ``event``; False if the client's connection closed first (its body was read)."""
    waits = [asyncio.ensure_future(event.wait()), asyncio.ensure_future(_on_disconnect(request, lambda: None))]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
    return event.is_set()
