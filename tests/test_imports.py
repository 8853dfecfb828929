"""What importing the daemon costs: no torch (issue 13.4: 0.8 s of start-up and ~240 MiB RSS)."""

from __future__ import annotations

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


@pytest.mark.parametrize("module", ["streamer_service.api", "streamer_service.daemon", "streamer_service.server"])
def test_the_daemon_does_not_import_torch(module):
    result = subprocess.run([sys.executable, "-c", BLOCK_TORCH, module], capture_output=True, text=True, timeout=120)
    assert (result.returncode, result.stdout.strip()) == (0, "ok"), result.stderr[-3000:]
