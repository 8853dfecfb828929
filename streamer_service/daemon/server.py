"""``streamer-service serve``: the API on a unix socket that only its owner can reach."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import resource
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import uvicorn

from streamer_client._connection import DaemonClient
from streamer_client.errors import ConfigError, InvalidURIError

from ..access import check_shared_access, socket_mode
from ..readers.choice import local_reader_in_force
from ..readers.runai import read_parallelism_in_force
from ..settings import DEFAULT_SOCKET, Settings, few_slots_warning
from ..uri import parse_uri
from .api import PeerCredentialsProtocol, create_app
from .scrape import MetricsListener
from .stats import DaemonStats
from .stop_signals import StopSignals

__all__ = ["DEFAULT_SOCKET", "ChildDaemon", "check_startup", "serve", "bind_unix_socket"]

log = logging.getLogger(__name__)


def bind_unix_socket(path: Path, mode: int = 0o600) -> socket.socket:
    """Bind ``path`` with ``mode`` from the first instant (umask), replacing a dead daemon's socket.

    We bind ourselves because uvicorn chmods the sockets it creates to 0666. A dir this user
    cannot make, enter or write is a :class:`ConfigError` naming the path.
    """
    try:
        return _bind_unix_socket(path, mode)
    except OSError as exc:
        raise ConfigError(
            f"cannot serve on {path}: {exc.strerror or exc} (--socket / STREAMER_SOCKET: a path in a dir this user can write)"
        ) from None


def _bind_unix_socket(path: Path, mode: int) -> socket.socket:
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
        os.chmod(path, mode)
        sock.listen(1024)
    except BaseException:
        sock.close()
        raise
    finally:
        os.umask(old)
    return sock


def bind_loopback(port: int) -> socket.socket:
    """127.0.0.1 only: the TCP listener is for tools on this node, never for the network."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(1024)
    return sock


def check_startup(settings: Settings) -> None:
    """Refuse, before anything is bound or served, what would make the daemon fail at start-up.

    Without this a bad ``--allow`` or ``--shm-dir`` failed inside uvicorn's lifespan: a traceback
    after "serving on unix socket" was logged, and exit 3.
    """
    if settings.tcp_port is not None and not (settings.token and settings.token.get_secret_value()):
        raise ConfigError("--tcp-port needs a bearer token in STREAMER_TOKEN")
    if settings.metrics_port is not None and settings.metrics_port == settings.tcp_port:
        raise ConfigError(
            f"--metrics-port {settings.metrics_port} is also --tcp-port: give the metrics listener a port of its own"
        )
    for prefix in settings.allow:
        try:
            parse_uri(prefix)
        except InvalidURIError as exc:
            raise ConfigError(f"--allow / STREAMER_ALLOW prefix {prefix!r} is not a URI this daemon can read: {exc}") from None
    check_shared_access(settings)
    shm = Path(settings.shm_dir)
    if not shm.is_dir():
        raise ConfigError(f"--shm-dir / STREAMER_SHM_DIR {shm} is not a directory")
    if not os.access(shm, os.W_OK | os.X_OK):
        raise ConfigError(f"--shm-dir / STREAMER_SHM_DIR {shm} is not writable by this user")
    if (warning := few_slots_warning(settings)) is not None:
        log.warning("%s", warning)


def serve(settings: Settings, stops: StopSignals) -> int:
    """Serve until SIGINT or SIGTERM (recorded by ``stops``, entered by the caller), then clean
    up: 0 for SIGTERM, KeyboardInterrupt for SIGINT. A stop that came before the server would
    start skips it. Where the stop abandoned reads still in flight (``Daemon.stop``), sets
    ``stops.exit_at_once``."""
    path = Path(settings.socket) if settings.socket else DEFAULT_SOCKET
    mode = socket_mode(settings)
    check_startup(settings)
    _raise_open_files_limit()
    app = create_app(settings)
    listener = None
    if settings.metrics_port is not None:  # bound first: a port in use stops the start, leaving nothing behind
        listener = MetricsListener(settings.metrics_host, settings.metrics_port, lambda: _render_metrics(app), path)
    sockets: list[socket.socket] = []
    try:
        sockets.append(bind_unix_socket(path, mode))
        # Secret fields (token, Azure key, SAS, connection string) dump as "**********".
        log.debug("settings: %s", settings.to_json())
        log.info("serving on unix socket %s (mode %o)", path, mode, extra={"socket": str(path)})
        if settings.tcp_port is not None:
            sockets.append(bind_loopback(settings.tcp_port))
            log.info("serving on 127.0.0.1:%d (bearer token required)", settings.tcp_port)
        in_force = read_parallelism_in_force(settings)
        log.info(
            "Run:ai reads: %s",
            ", ".join(f"{name}={v['value']} ({v['source']})" for name, v in in_force.items()),
            extra={"read_parallelism": in_force},
        )
        local = local_reader_in_force(settings.local_reader)
        # A warning where the setting asks for mapped reads and they are not in force.
        (log.warning if settings.local_reader == "mapped" and local != "mapped" else log.info)(
            "local dirs: read %s",
            "through file mappings by the native copier" if local == "mapped" else f"by {local}",
            extra={"local_reader": local},
        )
        if listener is not None:
            listener.start()
        config = uvicorn.Config(
            app,
            log_level=settings.log_level.lower(),
            log_config=None,  # uvicorn's records go to our handler, in STREAMER_LOG_FORMAT (logs.py)
            access_log=False,
            timeout_graceful_shutdown=3,
            lifespan="on",
            http=PeerCredentialsProtocol,  # ranks' PIDs, so a dead rank is reclaimed at once
        )
        if not stops.received:
            _Server(config, app, stops).run(sockets=sockets)
    finally:
        if listener is not None:
            listener.close()
        for sock in sockets:
            sock.close()
        if sockets:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        daemon = getattr(app.state, "daemon", None)
        stops.exit_at_once = daemon is not None and bool(daemon.abandoned)
    if stops.interrupted:
        raise KeyboardInterrupt
    return 0


class _Server(uvicorn.Server):
    """uvicorn's server, which acts on the stops received before it took the signals over and
    tells the ranks that the daemon stops before it stops serving them."""

    def __init__(self, config: uvicorn.Config, app, stops: StopSignals) -> None:
        super().__init__(config)
        self._app = app
        self._stops = stops

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        for sig in list(self._stops.received):  # uvicorn's handlers are in force: these came before
            self.handle_exit(sig, None)
        await super().startup(sockets)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        daemon = getattr(self._app.state, "daemon", None)
        if daemon is not None:
            await asyncio.to_thread(daemon.tell_stopping)
        await super().shutdown(sockets)


def _raise_open_files_limit() -> None:
    """The soft limit of open files up to the hard one: every connection, pending join and rank
    takes descriptors, and a node daemon serves many (the soft limit is often 1024)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft == resource.RLIM_INFINITY or soft >= target:
        return
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (OSError, ValueError) as exc:
        log.warning("open files: soft limit %d, could not raise it to %d: %s", soft, target, exc)
    else:
        log.info("open files: soft limit raised from %d to %d", soft, target)


def _render_metrics(app) -> bytes | None:
    """The daemon's metrics text, or None before the app's lifespan has started the daemon."""
    daemon = getattr(app.state, "daemon", None)
    return daemon.metrics.render() if daemon is not None else None


class ChildDaemon:
    """`streamer-service serve` as a child process on a private socket and shm dir under ``root``.

    For the demo and the benchmarks: rank processes get :meth:`env` to find it. ``shm_dir``: the
    segments' dir (one the caller owns, left in place); default a private one, removed at close.
    """

    def __init__(
        self,
        root: Path,
        budget: str,
        *,
        env: dict[str, str] | None = None,
        shm_dir: Path | None = None,
        start_timeout_s: float = 60,
    ) -> None:
        shm_parent = "/dev/shm" if os.path.isdir("/dev/shm") else str(root)
        self._own_shm_dir = shm_dir is None
        self.shm_dir = Path(tempfile.mkdtemp(prefix="streamer-child-", dir=shm_parent)) if shm_dir is None else Path(shm_dir)
        self.socket = root / "daemon.sock"
        self.log = root / "daemon.log"
        cmd = [sys.executable, "-m", "streamer_service", "serve", "--socket", str(self.socket),
               "--shm-dir", str(self.shm_dir), "--shm-budget", budget]  # fmt: skip
        with open(self.log, "wb") as log_file:
            self.proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        self.client = DaemonClient(self.socket)
        deadline = time.monotonic() + start_timeout_s
        while not self.client.reachable():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"the daemon did not start:\n{self.log.read_text()[-2000:]}")
            time.sleep(0.05)

    def env(self) -> dict[str, str]:
        return {"STREAMER_SOCKET": str(self.socket), "STREAMER_SHM_DIR": str(self.shm_dir)}

    def wait_preloaded(self, timeout_s: float = 120) -> None:
        """Return once the daemon's preloading at start is done (its stats say so): from then on
        what it reads is what its loads read."""
        deadline = time.monotonic() + timeout_s
        while not self.stats().preloaded:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the daemon did not finish preloading in {timeout_s:g} s:\n{self.log.read_text()[-2000:]}")
            time.sleep(0.05)

    def stats(self) -> DaemonStats:
        return DaemonStats.from_json(self.client.call("/v1/stats"))

    def close(self) -> None:
        self.client.close()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self._own_shm_dir:
            shutil.rmtree(self.shm_dir, ignore_errors=True)
