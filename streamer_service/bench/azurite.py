"""The ``azure`` bench source: Azurite over HTTPS, started by ``benchmarks/azure_bench.py``.

Run:ai's Azure reader dials ``https://<account>.<AZURE_STORAGE_ENDPOINT_SUFFIX>`` and trusts only
the system CA bundle, so a loopback Azurite needs a certificate the system trusts and a name that
resolves. ``benchmarks/azure_bench.py`` makes both without changing the machine (a throwaway CA,
bind-mounted with a hosts entry inside a private mount namespace, as the tests do: see
docs/reliability.md) and runs the bench in that namespace; this source then finds Azurite's port
in ``STREAMER_BENCH_AZURITE_PORT`` and the account in ``AZURE_STORAGE_ACCOUNT_NAME`` /
``AZURE_STORAGE_ACCOUNT_KEY``.

Every contender reaches Azurite through a :class:`~.latency.LatencyProxy` (no delay unless
``--latency-ms``), which passes TLS through unchanged; bytes are what it passed to the readers
(TLS records and metadata reads included: a little over the body bytes). The checkpoint is
uploaded directly, not through the proxy.
"""

from __future__ import annotations

import os
from pathlib import Path

from streamer_client.errors import ConfigError

from .latency import LatencyProxy
from .source import BUCKET, HOST, PREFIX, Source

__all__ = ["AzuriteSource"]

ENDPOINT_SUFFIX_HOST = "blob.localhost"
PORT_VARIABLE = "STREAMER_BENCH_AZURITE_PORT"


class AzuriteSource(Source):
    name = "azure"

    def __init__(self, work: Path, checkpoint: Path, latency_s: float = 0.0) -> None:
        port = os.environ.get(PORT_VARIABLE, "")
        account = os.environ.get("AZURE_STORAGE_ACCOUNT_NAME", "")
        key = os.environ.get("AZURE_STORAGE_ACCOUNT_KEY", "")
        if not port.isdigit() or not account or not key:
            raise ConfigError(
                f"bench source 'azure' needs Azurite over HTTPS and a namespace that trusts it ({PORT_VARIABLE}, "
                "AZURE_STORAGE_ACCOUNT_NAME, AZURE_STORAGE_ACCOUNT_KEY): run it through benchmarks/azure_bench.py"
            )
        self.work = work
        self.uri = f"az://{BUCKET}/{PREFIX}"
        self.host = f"{account}.{ENDPOINT_SUFFIX_HOST}"
        self.proxy = LatencyProxy(HOST, int(port), latency_s).start()
        try:
            self.env = self._environment(account, key, self.proxy.port)
            self._upload(checkpoint, self._environment(account, key, int(port))["AZURE_STORAGE_CONNECTION_STRING"])
        except BaseException:
            self.close()
            raise

    def _environment(self, account: str, key: str, port: int) -> dict[str, str]:
        """Run:ai's variables and the service's SDK client's, for Azurite at ``port``."""
        return {
            "AZURE_STORAGE_ACCOUNT_NAME": account,
            "AZURE_STORAGE_ACCOUNT_KEY": key,
            "AZURE_STORAGE_ENDPOINT_SUFFIX": f"{ENDPOINT_SUFFIX_HOST}:{port}",
            "AZURE_STORAGE_CONNECTION_STRING": (
                f"DefaultEndpointsProtocol=https;AccountName={account};AccountKey={key};BlobEndpoint=https://{self.host}:{port};"
            ),
        }

    def _upload(self, checkpoint: Path, connection_string: str) -> None:
        from azure.storage.blob import BlobServiceClient

        with BlobServiceClient.from_connection_string(connection_string) as client:
            container = client.get_container_client(BUCKET)
            if not container.exists():
                container.create_container()
            for path in sorted(checkpoint.iterdir()):
                if path.is_file():
                    with open(path, "rb") as data:
                        container.upload_blob(f"{PREFIX}/{path.name}", data, overwrite=True, max_concurrency=4)

    def bytes_served(self) -> int:
        return self.proxy.counts.bytes_down

    def describe(self) -> str:
        return "Azurite over HTTPS on loopback; bytes: what the proxy in front passed to the readers (TLS included)"
