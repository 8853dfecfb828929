"""What importing the daemon costs: no torch (issue 13.4: 0.8 s of start-up and ~240 MiB RSS).
Neither does pulling metadata in-process (vLLM's and the CLI's first step)."""

from __future__ import annotations

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
