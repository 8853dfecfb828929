"""What importing the daemon costs: no torch (issue 13.4: 0.8 s of start-up and ~240 MiB RSS).
Neither does pulling metadata in-process (vLLM's and the CLI's first step)."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import textwrap

import pytest

BLOCK_TORCH = textwrap.dedent(
    """
    import importlib, importlib.abc, sys

    class NoTorch(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError(f"{name} imported by the daemon")

    sys.meta_path.insert(0, NoTorch())
    for module in sys.argv[1:]:
        importlib.import_module(module)
    from streamer_service.api import create_app
    from streamer_service.settings import Settings
    create_app(Settings())
    assert "torch" not in sys.modules
    print("ok")
    """
)


@pytest.mark.parametrize("module", ["streamer_service.api", "streamer_service.daemon", "streamer_service.server", "streamer_client.connection"])
def test_the_daemon_does_not_import_torch(module):
    result = subprocess.run([sys.executable, "-c", BLOCK_TORCH, module], capture_output=True, text=True, timeout=120)
    assert (result.returncode, result.stdout.strip()) == (0, "ok"), result.stderr[-3000:]


PULL_WITHOUT_TORCH = BLOCK_TORCH.split("for module in")[0] + textwrap.dedent(
    """
    import streamer_client
    path = streamer_client.pull_metadata(sys.argv[1], cache_dir=sys.argv[2])
    assert (path / "config.json").is_file() and "torch" not in sys.modules
    print("ok")
    """
)


def test_pulling_metadata_in_process_does_not_import_torch(sample, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "STREAMER_SOCKET"}
    env["STREAMER_SOCKET"] = str(tmp_path / "no-daemon.sock")  # none there: in-process
    result = subprocess.run([sys.executable, "-c", PULL_WITHOUT_TORCH, str(sample), str(tmp_path / "cache")], env=env, capture_output=True, text=True, timeout=120)
    assert (result.returncode, result.stdout.strip()) == (0, "ok"), result.stderr[-3000:]


FIRST_LOAD_COLLECTIONS = textwrap.dedent(
    """
    import gc, json, sys
    import torch, streamer_client
    if sys.argv[3] == "paused-by-the-caller":
        gc.disable()
    during = []

    def importing():
        module = sys.modules.get("streamer_service.embedded")
        return module is None or getattr(module.__spec__, "_initializing", False)

    gc.callbacks.append(lambda phase, info: phase == "start" and importing() and during.append(info["generation"]))
    state = streamer_client.load_state_dict(sys.argv[1], cache_dir=sys.argv[2])
    print(json.dumps({"tensors": len(state), "during_import": during, "enabled": gc.isenabled()}))
    """
)


@pytest.mark.parametrize("caller", ["collecting", "paused-by-the-caller"])
def test_the_first_in_process_load_imports_the_service_without_collecting(sample, tmp_path, caller):
    # The service's first import (pydantic-settings, the engine) set off 35 collections, one of them
    # full, which in a process with torch walks torch's objects: 0.26 of its 0.46 s on a 2-core VM.
    env = {k: v for k, v in os.environ.items() if k != "STREAMER_SOCKET"}
    code = [sys.executable, "-c", FIRST_LOAD_COLLECTIONS, str(sample), str(tmp_path / "cache"), caller]
    result = subprocess.run(code, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    got = json.loads(result.stdout.strip().splitlines()[-1])
    assert got["tensors"] > 0 and got["during_import"] == []
    assert got["enabled"] is (caller == "collecting"), "the collector is left as the caller had it"


def test_every_scheme_has_a_backend():
    from streamer_service.storage import BACKENDS, Storage
    from streamer_service.uri import Scheme

    assert set(BACKENDS) == set(Scheme)
    for scheme, where in BACKENDS.items():
        module, _, name = where.partition(":")
        backend = getattr(importlib.import_module(f"streamer_service.storage.{module}"), name)
        assert issubclass(backend, Storage), scheme
