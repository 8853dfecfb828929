"""``streamer-service bench --source azure``, with Azurite over HTTPS that Run:ai's Azure reader trusts.

    sudo .venv/bin/python benchmarks/azure_bench.py [BENCH FLAGS ...]

Starts Azurite with a throwaway CA's certificate for ``devstoreaccount1.blob.localhost`` and runs
the bench in a private mount namespace where that CA is in the system bundle and the name
resolves to 127.0.0.1 (``tests/harness/azure_tls.py``, the tests' own setup; nothing outside the
namespace changes). Needs root (``unshare --mount``) and Azurite (``scripts/bootstrap``). Every
flag goes to the bench, e.g. ``--size 1GiB --ranks 1 --modes A,B --latency-ms 30``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.harness.azure_tls import AzureTLSService  # noqa: E402


def main(argv: list[str]) -> int:
    service = AzureTLSService()
    try:
        env = {**os.environ, **service.env, "STREAMER_BENCH_AZURITE_PORT": str(service.port)}
        env.pop("AZURE_STORAGE_CONNECTION_STRING", None)  # the source builds it for its proxy
        bench = [sys.executable, "-m", "streamer_service", "bench", "--source", "azure", *argv]
        return subprocess.run(service.namespaced(bench), env=env, cwd=REPO).returncode
    finally:
        service.stop()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
