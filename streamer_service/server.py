"""``streamer-service serve``: the API on a unix socket that only its owner can reach."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import stat
from pathlib import Path

import uvicorn

from streamer_client.errors import ConfigError

from .api import create_app
from .settings import Settings

__all__ = ["DEFAULT_SOCKET", "serve", "bind_unix_socket"]

log = logging.getLogger(__name__)

DEFAULT_SOCKET = Path("/run/streamer-service/daemon.sock")


def bind_unix_socket(path: Path, mode: int = 0o600) -> socket.socket:
    """Bind ``path`` with ``mode`` from the first instant (umask), replacing a dead daemon's socket.

    We bind ourselves because uvicorn chmods the sockets it creates to 0666.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() or path.is_symlink():
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise ConfigError(f"{path} exists and is not a socket; refusing to replace it")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
        except OSError:
            path.unlink()  # nobody answers: a dead daemon's socket
        else:
            raise ConfigError(f"another daemon is already serving on {path}")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o777 & ~mode)
    try:
        sock.bind(str(path))
    finally:
        os.umask(old)
    os.chmod(path, mode)
    sock.listen(1024)
    return sock


def bind_loopback(port: int) -> socket.socket:
    """127.0.0.1 only: the TCP listener is for tools on this node, never for the network."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(1024)
    return sock


def serve(settings: Settings, *, socket_mode: int = 0o600) -> int:
    path = Path(settings.socket) if settings.socket else DEFAULT_SOCKET
    if settings.tcp_port is not None and not (settings.token and settings.token.get_secret_value()):
        raise ConfigError("--tcp-port needs a bearer token in STREAMER_TOKEN")
    sockets = [bind_unix_socket(path, socket_mode)]
    log.info("serving on unix socket %s (mode %o)", path, socket_mode)
    if settings.tcp_port is not None:
        sockets.append(bind_loopback(settings.tcp_port))
        log.info("serving on 127.0.0.1:%d (bearer token required)", settings.tcp_port)
    config = uvicorn.Config(
        create_app(settings),
        log_level=settings.log_level.lower(),
        access_log=False,
        timeout_graceful_shutdown=3,
        lifespan="on",
    )
    try:
        uvicorn.Server(config).run(sockets=sockets)
    finally:
        for sock in sockets:
            sock.close()
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    return 0
