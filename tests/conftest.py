"""Shared fixtures: an isolated environment for every test, and the storage backends.

``backend`` runs a test on local files, S3 (moto), GCS (fake-gcs-server) and Azure (Azurite);
``cloud_backend`` on the three clouds only. Each emulator is started on first use and stopped
at the end of the session. A missing emulator fails the tests: run ``scripts/bootstrap``.
``azure_tls`` is a container on an HTTPS Azurite that Run:ai's Azure reader can read from inside
a private mount namespace (tests/harness/azure_tls.py; root only, else skipped).
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import pytest
from harness import azure_tls as _azure_tls
from harness.backends import SERVICES, Backend, LocalBackend
from hypothesis import settings as _hypothesis_settings

# Property tests draw the same examples on every run (a counterexample found at random would make
# the suite fail at random); HYPOTHESIS_PROFILE=explore draws new ones, to look for more. Loaded
# here, before the test modules' @settings take it as their parent.
_hypothesis_settings.register_profile("repeatable", derandomize=True, database=None)
_hypothesis_settings.register_profile("explore")
_hypothesis_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))

BACKENDS = ["local", "s3", "gcs", "azure"]
CLOUD_BACKENDS = ["s3", "gcs", "azure"]

_REMOVED_VARS = (
    "STREAMER_SOCKET",
    "STREAMER_LAUNCH_ID",
    "TORCHELASTIC_RUN_ID",
    "TRTLLM_OBJECT_STORAGE_FORCE_PULL",
    "STREAMER_FORCE_PULL",
    "STORAGE_EMULATOR_HOST",
    "CLOUD_STORAGE_EMULATOR_ENDPOINT",
)
_REMOVED_PREFIXES = ("STREAMER_", "AWS_", "GOOGLE_", "GCLOUD_", "AZURE_")


def _clear_settings_cache() -> None:
    if "streamer_service.settings" not in sys.modules:
        try:
            importlib.import_module("streamer_service.settings")
        except ImportError:
            return
    get_settings = getattr(sys.modules["streamer_service.settings"], "get_settings", None)
    if get_settings is not None and hasattr(get_settings, "cache_clear"):
        get_settings.cache_clear()


@pytest.fixture(autouse=True)
def isolated_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Per-test cache and shm dirs; no other STREAMER_* setting (daemon socket, launch id...),
    no torchrun/TRT-LLM variables, no cloud credentials or endpoints from the machine."""
    for name in list(os.environ):
        if name.startswith("STREAMER_TEST_"):  # harness settings (e.g. STREAMER_TEST_AZURITE_DIR)
            continue
        if name in _REMOVED_VARS or name.startswith(_REMOVED_PREFIXES):
            monkeypatch.delenv(name, raising=False)
    # Keep the SDKs away from the developer's own config and credential files.
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path / "no-gcloud-config"))
    shm = tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setenv("STREAMER_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("STREAMER_SHM_DIR", str(shm))
    _clear_settings_cache()
    yield
    _clear_settings_cache()


# --------------------------------------------------------------------------- emulators (lazy)


@pytest.fixture(scope="session")
def emulator_log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("emulators")


def _service(name: str, log_dir: Path):
    svc = SERVICES[name](log_dir=log_dir)
    try:
        yield svc
    finally:
        svc.stop()


@pytest.fixture(scope="session")
def s3_service(emulator_log_dir):
    yield from _service("s3", emulator_log_dir)


@pytest.fixture(scope="session")
def gcs_service(emulator_log_dir):
    yield from _service("gcs", emulator_log_dir)


@pytest.fixture(scope="session")
def azure_service(emulator_log_dir):
    yield from _service("azure", emulator_log_dir)


@pytest.fixture(scope="session")
def azure_tls_service(emulator_log_dir):
    """Azurite over HTTPS plus a private mount namespace that trusts it, for code that reads
    through Run:ai's Azure reader (see tests/harness/azure_tls.py). Skips only without root or
    ``unshare``; any other failure to build it fails the tests."""
    reason = _azure_tls.skip_reason()
    if reason is not None:
        pytest.skip(reason)
    svc = _azure_tls.AzureTLSService(log_dir=emulator_log_dir)
    try:
        yield svc
    finally:
        svc.stop()


# --------------------------------------------------------------------------- backends


def _make_backend(request: pytest.FixtureRequest, name: str, tmp_path: Path, monkeypatch) -> Backend:
    if name == "local":
        b: Backend = LocalBackend(tmp_path / "storage")
    else:
        b = request.getfixturevalue(f"{name}_service").new_backend()
    for key, value in b.env.items():
        monkeypatch.setenv(key, value)
    _clear_settings_cache()
    return b


@pytest.fixture(params=BACKENDS, ids=BACKENDS)
def backend(request, isolated_env, tmp_path, monkeypatch):
    """A fresh bucket/container (or directory) on each of the four backends."""
    b = _make_backend(request, request.param, tmp_path, monkeypatch)
    yield b
    b.close()


@pytest.fixture(params=CLOUD_BACKENDS, ids=CLOUD_BACKENDS)
def cloud_backend(request, isolated_env, tmp_path, monkeypatch):
    """Like ``backend``, on the three cloud emulators only."""
    b = _make_backend(request, request.param, tmp_path, monkeypatch)
    yield b
    b.close()


@pytest.fixture
def azure_tls(azure_tls_service, isolated_env):
    """A fresh container on the HTTPS Azurite; run code under test with ``azure_tls.python``
    (inside the namespace, with ``azure_tls.env``)."""
    b = azure_tls_service.new_backend()
    yield b
    b.close()


@pytest.fixture
def sample(tmp_path_factory):
    """A ~12 MB MoE-shaped checkpoint (2 shards), built once per test (files with their own
    ``sample`` fixture use theirs)."""
    from streamer_service.sample import build_sample

    src = tmp_path_factory.mktemp("sample") / "ckpt"
    build_sample(src, size_mb=12)
    return src


@pytest.fixture
def daemon(tmp_path):
    """``daemon(env=None, *serve_args)`` starts a real ``streamer-service serve`` (ranks silent for
    10 s are reclaimed unless ``env`` says otherwise; a rank whose process is gone is reclaimed at
    once); every daemon started is stopped afterwards."""
    from daemon_harness import DaemonProcess

    procs = []

    def start(env=None, *extra):
        d = DaemonProcess(tmp_path, {"STREAMER_RANK_TIMEOUT_S": "10", **(env or {})}, *extra).start()
        procs.append(d)
        return d

    yield start
    for d in procs:
        d.stop()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests that share one worker (``xdist_group``: the real-vLLM ones, minutes each) go first, so
    that the other worker runs the rest beside them instead of idling while they finish last."""
    items.sort(key=lambda item: item.get_closest_marker("xdist_group") is None)
