"""Azure Blob (Azurite over HTTPS) for Run:ai's native reader, without changing the machine.

Why this exists
---------------
Run:ai Model Streamer 0.17.0 reads ``az://`` objects in ``libstreamerazure.so`` (the Azure C++
SDK over a statically linked libcurl + OpenSSL). Read from that library (its strings, and by
experiment against Azurite):

- It reads only ``AZURE_STORAGE_ACCOUNT_NAME`` (required), ``AZURE_STORAGE_ACCOUNT_KEY`` or
  ``AZURE_STORAGE_SAS_TOKEN`` (neither: the DefaultAzureCredential chain, ``AZURE_CLIENT_ID``,
  ``AZURE_TENANT_ID``, ``AZURE_FEDERATED_TOKEN_FILE``, managed identity...) and
  ``AZURE_STORAGE_ENDPOINT_SUFFIX`` (default ``blob.core.windows.net``: the suffix INCLUDES
  ``blob.``). It does NOT read ``AZURE_STORAGE_CONNECTION_STRING``: with only a connection
  string every range answers ``INVALID_PARAMETERS``.
- It always dials ``https://<account>.<suffix>``. The suffix may carry a port:
  ``AZURE_STORAGE_ENDPOINT_SUFFIX=blob.localhost:PORT`` works, so no port 443 and no network
  namespace are needed.
- It trusts only the system CA bundle compiled into it, ``/etc/ssl/certs/ca-certificates.crt``
  (and ``/etc/ssl/certs``): ``SSL_CERT_FILE``, ``CURL_CA_BUNDLE`` and ``REQUESTS_CA_BUNDLE``
  are ignored; an untrusted server answers ``FILE_ACCESS_ERROR`` for every range.

The trick
---------
1. Per test session, a throwaway CA and a server certificate for ``devstoreaccount1.blob.localhost``
   (+ IP 127.0.0.1) are made with ``cryptography`` in a temp dir.
2. Azurite serves HTTPS with that certificate on ``127.0.0.1:<free port>`` (``--cert/--key``).
   Azurite takes the account from the first label of a non-IP ``Host`` ("production-style URL"),
   so ``https://devstoreaccount1.blob.localhost:PORT/<container>/<blob>`` is what Run:ai uses.
3. The code under test runs in a child started as ``unshare --mount --propagation private``.
   Inside that private mount namespace the child, before exec'ing the test program,
   bind-mounts
     - a copy of the system CA bundle with the test CA appended over
       ``/etc/ssl/certs/ca-certificates.crt`` (if the bundle is absent, a copy of the nearest
       existing dir with the bundle added is bind-mounted over that dir), and
     - a copy of ``/etc/hosts`` plus ``127.0.0.1 devstoreaccount1.blob.localhost`` over
       ``/etc/hosts`` (libcurl resolves ``*.localhost`` itself; Python's ``getaddrinfo`` does not).
   Propagation is private, so the mounts exist only in that namespace and disappear with its
   last process; no file outside is ever written. The network is not namespaced.
4. The child's environment (:attr:`AzureTLSService.env`) gives Run:ai its variables and the
   service's own azure-storage-blob client (listing, metadata pull, header reads) the same
   endpoint through ``AZURE_STORAGE_CONNECTION_STRING`` with ``BlobEndpoint=https://<host>:PORT``.
   ``REQUESTS_CA_BUNDLE`` points at the (namespaced) system bundle because the Python SDK's
   transport (requests) trusts certifi's bundle, not the system one.

Fixture setup (create/upload/delete) talks to Azurite from outside, path-style
(``https://127.0.0.1:PORT/devstoreaccount1``), verifying with the test CA file directly.

Needs Linux, root (CAP_SYS_ADMIN, for ``unshare -m`` and ``mount``) and util-linux ``unshare``;
:func:`skip_reason` says why not. Everything else that goes wrong is an error, not a skip.
"""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import json
import os
import shutil
import ssl
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from .backends import AzureBackend, closed_port_url, unique_bucket_name
from .emulators import AZURITE_ACCOUNT, AZURITE_KEY, HOST, EmulatorError, EmulatorProcess, start_azurite

__all__ = [
    "AzureTLSBackend",
    "AzureTLSService",
    "HOSTS_FILE",
    "SYSTEM_CA_BUNDLE",
    "TestPKI",
    "host_state",
    "make_test_pki",
    "skip_reason",
]

SYSTEM_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
"""The bundle Run:ai's libcurl is built to trust (its compiled-in CURLOPT_CAINFO)."""

HOSTS_FILE = Path("/etc/hosts")

ENDPOINT_SUFFIX_HOST = "blob.localhost"
"""``<account>.blob.localhost``: a name under ``.localhost`` (RFC 6761), so even a leak could
only ever point at loopback."""

SETUP_FAILED = 97
"""Exit status of the namespace bootstrap when a bind mount fails (a harness error)."""

# Runs as the first program inside the new mount namespace: bind-mount, then exec the real
# program (same PID, so a timeout kill reaches it). Keep it to the standard library.
_BOOT = r"""
import ctypes, json, os, sys
MS_BIND = 4096
libc = ctypes.CDLL(None, use_errno=True)
for src, dst in json.loads(sys.argv[1]):
    if libc.mount(src.encode(), dst.encode(), None, MS_BIND, None) != 0:
        err = ctypes.get_errno()
        sys.stderr.write(f"azure_tls: cannot bind-mount {src} over {dst}: {os.strerror(err)}\n")
        sys.stderr.flush()
        os._exit(SETUP_FAILED)
os.execv(sys.argv[2], sys.argv[2:])
""".replace("SETUP_FAILED", str(SETUP_FAILED))

# A TLS handshake from inside the namespace with nothing but the system bundle and the system
# resolver: proves the harness works before any product code runs.
_SELF_CHECK = r"""
import socket, ssl, sys
host, port, bundle = sys.argv[1], int(sys.argv[2]), sys.argv[3]
addr = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_STREAM)[0][4]
ctx = ssl.create_default_context(cafile=bundle)
with socket.create_connection(addr, timeout=10) as raw, ctx.wrap_socket(raw, server_hostname=host) as tls:
    tls.sendall(f"GET /?comp=list HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n\r\n".encode())
    print(tls.recv(64).split(b"\r\n")[0].decode())
"""


def skip_reason() -> str | None:
    """Why the Azure-over-TLS tests cannot run on this machine (``None``: they must run)."""
    if not sys.platform.startswith("linux"):
        return "Azure streaming tests need Linux mount namespaces (unshare -m)"
    if os.geteuid() != 0:
        return (
            "Azure streaming tests need root: Run:ai's Azure reader trusts only the system CA "
            "bundle, which the tests replace inside a private mount namespace (unshare -m + bind mounts)"
        )
    if _unshare_path() is None:
        return "Azure streaming tests need util-linux `unshare` on PATH (for a private mount namespace)"
    return None


def _unshare_path() -> str | None:
    return shutil.which("unshare") or next((p for p in ("/usr/bin/unshare", "/bin/unshare") if os.access(p, os.X_OK)), None)


# --------------------------------------------------------------------------- certificates


@dataclass(frozen=True)
class TestPKI:
    """PEM files: the test CA, and a server certificate + key it signed."""

    __test__ = False  # not a pytest test class

    ca_cert: Path
    server_cert: Path
    server_key: Path


def make_test_pki(directory: Path, hostnames: Sequence[str], ips: Sequence[str] = (HOST,)) -> TestPKI:
    """A CA valid for one day and a server cert for ``hostnames`` and ``ips`` signed by it."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(hours=1), now + datetime.timedelta(days=1)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "streamer-service test CA (throwaway)")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )  # fmt: skip
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )

    key = ec.generate_private_key(ec.SECP256R1())
    sans: list[x509.GeneralName] = [x509.DNSName(h) for h in hostnames]
    sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hostnames[0])]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )

    pki = TestPKI(directory / "test-ca.pem", directory / "server.pem", directory / "server-key.pem")
    pki.ca_cert.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    pki.server_cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pki.server_key.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    pki.server_key.chmod(0o600)
    return pki


# --------------------------------------------------------------------------- host state


def host_state() -> dict[str, object]:
    """What the tests must leave as found: the two files' digests (``None``: absent) and the
    mount points on or under them in this (the outer) mount namespace."""
    paths = (SYSTEM_CA_BUNDLE, HOSTS_FILE)
    digests = {}
    for p in paths:
        try:
            digests[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
        except FileNotFoundError:
            digests[str(p)] = None
    watched = ("/etc/ssl", str(HOSTS_FILE))
    mounts = []
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        for line in f:
            point = line.split()[4]
            if any(point == w or point.startswith(w + "/") for w in watched):
                mounts.append(point)
    return {"files": digests, "mounts": sorted(mounts)}


# --------------------------------------------------------------------------- the service


class AzureTLSService:
    """Azurite over HTTPS for the whole session, and the namespace that trusts it.

    ``env``: the variables for code under test (Run:ai + azure-storage-blob);
    ``run(argv)``: run a program inside a fresh private mount namespace that trusts the test CA;
    ``client``: an SDK client for fixture setup, talking to Azurite directly from outside.
    """

    def __init__(self, log_dir: Path | None = None) -> None:
        reason = skip_reason()
        if reason is not None:
            raise EmulatorError(reason)
        self.account = AZURITE_ACCOUNT
        self.host = f"{self.account}.{ENDPOINT_SUFFIX_HOST}"
        self.root = Path(tempfile.mkdtemp(prefix="azure-tls-", dir=log_dir))
        self.host_state_before = host_state()
        try:
            self.pki = make_test_pki(self.root / "pki", [self.host, f"*.{ENDPOINT_SUFFIX_HOST}"])
            self.binds = self._prepare_binds()
            tls = ssl.create_default_context(cafile=str(self.pki.ca_cert))
            # Without a log dir of the caller's, the emulator's log lives (and goes) with the root.
            self.emulator: EmulatorProcess = start_azurite(
                log_dir=log_dir or self.root, cert=self.pki.server_cert, key=self.pki.server_key, tls=tls
            )
        except BaseException:
            shutil.rmtree(self.root, ignore_errors=True)
            raise
        try:
            self.port = self.emulator.port
            self.endpoint = f"https://{self.host}:{self.port}"
            from azure.storage.blob import BlobServiceClient

            self.client = BlobServiceClient(
                f"https://{HOST}:{self.port}/{self.account}",
                credential={"account_name": self.account, "account_key": AZURITE_KEY},
                connection_verify=str(self.pki.ca_cert),
            )
            self.self_check()
        except BaseException:
            self.emulator.stop()
            shutil.rmtree(self.root, ignore_errors=True)
            raise

    # -- what code under test gets

    @property
    def env(self) -> dict[str, str]:
        return {
            # Run:ai's native reader: https://<ACCOUNT_NAME>.<ENDPOINT_SUFFIX>, shared key.
            "AZURE_STORAGE_ACCOUNT_NAME": self.account,
            "AZURE_STORAGE_ACCOUNT_KEY": AZURITE_KEY,
            "AZURE_STORAGE_ENDPOINT_SUFFIX": f"{ENDPOINT_SUFFIX_HOST}:{self.port}",
            # The service's azure-storage-blob client: the same endpoint, the same account.
            "AZURE_STORAGE_CONNECTION_STRING": (
                "DefaultEndpointsProtocol=https;"
                f"AccountName={self.account};AccountKey={AZURITE_KEY};"
                f"BlobEndpoint={self.endpoint};"
            ),
            # requests (under azure-core) trusts certifi, not the system bundle, unless told.
            "REQUESTS_CA_BUNDLE": str(SYSTEM_CA_BUNDLE),
        }

    def new_backend(self) -> AzureTLSBackend:
        return AzureTLSBackend(self)

    # -- the namespace

    def _prepare_binds(self) -> list[tuple[str, str]]:
        """Copies to bind-mount inside the namespace: (source here, target on the system)."""
        binds: list[tuple[str, str]] = []
        ca_pem = self.pki.ca_cert.read_bytes()

        if SYSTEM_CA_BUNDLE.is_file():
            bundle = self.root / "ca-certificates.crt"
            system = SYSTEM_CA_BUNDLE.read_bytes()
            bundle.write_bytes(system + (b"" if system.endswith(b"\n") or not system else b"\n") + ca_pem)
            binds.append((str(bundle), str(SYSTEM_CA_BUNDLE)))
        else:
            # No bundle (ca-certificates not installed): cover the nearest existing dir with a
            # copy of it that has the bundle. Never higher than /etc/ssl.
            target = next((d for d in (SYSTEM_CA_BUNDLE.parent, SYSTEM_CA_BUNDLE.parent.parent) if d.is_dir()), None)
            if target is None:
                raise EmulatorError(
                    f"neither {SYSTEM_CA_BUNDLE.parent} nor {SYSTEM_CA_BUNDLE.parent.parent} exists: "
                    "install the ca-certificates package (Run:ai's Azure reader only trusts that bundle)"
                )
            copy = self.root / "ssl-dir"
            shutil.copytree(target, copy, symlinks=True)
            dest = copy / SYSTEM_CA_BUNDLE.relative_to(target)
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(ca_pem)
            binds.append((str(copy), str(target)))

        if not HOSTS_FILE.is_file():
            raise EmulatorError(f"{HOSTS_FILE} does not exist: cannot add {self.host} for the namespace")
        hosts = self.root / "hosts"
        original = HOSTS_FILE.read_text(encoding="utf-8", errors="surrogateescape")
        sep = "" if original.endswith("\n") or not original else "\n"
        hosts.write_text(
            f"{original}{sep}{HOST} {self.host}  # streamer-service tests, this namespace only\n",
            encoding="utf-8",
            errors="surrogateescape",
        )
        binds.append((str(hosts), str(HOSTS_FILE)))
        return binds

    def namespaced(self, argv: Sequence[str], *, trust: bool = True) -> list[str]:
        """``argv`` wrapped to run in a new private mount namespace with the trust in place
        (``trust=False``: only the hosts entry, the system CA bundle as it is -- a control)."""
        unshare = _unshare_path()
        if unshare is None:  # pragma: no cover - checked by skip_reason
            raise EmulatorError("unshare not found")
        binds = self.binds if trust else [b for b in self.binds if b[1] == str(HOSTS_FILE)]
        return [
            unshare, "--mount", "--propagation", "private", "--",
            sys.executable, "-c", _BOOT, json.dumps(binds), *[str(a) for a in argv],
        ]  # fmt: skip

    def run(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        timeout: float = 120,
        cwd: Path | None = None,
        trust: bool = True,
    ) -> subprocess.CompletedProcess:
        """Run ``argv`` in the namespace with ``env`` (default: ``os.environ`` + :attr:`env`).

        A failed bind mount or ``unshare`` is a harness error (:class:`EmulatorError`), so the
        test fails with that reason rather than with a product-looking failure."""
        from .emulators import _child_setup, _prctl  # PR_SET_PDEATHSIG: no orphan if pytest dies

        full_env = dict(os.environ if env is None else env)
        if env is None:
            full_env.update(self.env)
        result = subprocess.run(
            self.namespaced(argv, trust=trust),
            env=full_env,
            cwd=str(cwd) if cwd else None,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            preexec_fn=_child_setup if _prctl is not None else None,
        )
        if result.returncode == SETUP_FAILED or result.stderr.startswith("unshare:"):
            raise EmulatorError(
                f"could not build the private mount namespace (exit {result.returncode}): "
                f"{result.stderr.strip()[-2000:]}; it needs root with CAP_SYS_ADMIN "
                "(in a container: --privileged or --cap-add SYS_ADMIN)"
            )
        return result

    def python(self, code: str, *args: str, **kw) -> subprocess.CompletedProcess:
        """``python -c code args...`` in the namespace (see :meth:`run`)."""
        return self.run([sys.executable, "-c", code, *args], **kw)

    def self_check(self) -> None:
        """A TLS handshake to Azurite from inside the namespace with only the system bundle and
        the system resolver: the setup is proven before any product code runs."""
        result = self.python(_SELF_CHECK, self.host, str(self.port), str(SYSTEM_CA_BUNDLE), env=dict(os.environ), timeout=60)
        if result.returncode != 0 or not result.stdout.startswith("HTTP/1.1"):
            raise EmulatorError(
                f"Azurite at {self.endpoint} is not trusted/resolvable inside the namespace: "
                f"rc={result.returncode} {result.stdout.strip()} {result.stderr.strip()[-2000:]}"
            )

    def stop(self) -> None:
        try:
            self.client.close()
        except Exception:
            pass
        try:
            self.emulator.stop()
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


class AzureTLSBackend(AzureBackend):
    """A fresh container on :class:`AzureTLSService` with the :class:`~.backends.Backend` API.

    No counting proxy (the traffic is TLS end to end). ``env`` is the service's; run code under
    test with ``run``/``python`` so it sees the namespace's trust and hosts entry.
    """

    name = "azure-tls"

    def __init__(self, service: AzureTLSService) -> None:  # noqa: D107 - no proxy, see above
        self.service = service
        self.bucket = unique_bucket_name()
        self._create()
        self.proxy = None
        self.env = dict(service.env)

    def unreachable_env(self) -> dict[str, str]:
        """``env`` with both Run:ai's and the SDK's endpoint on a closed 127.0.0.1 port."""
        closed = closed_port_url().rsplit(":", 1)[1]
        port = str(self.service.port)
        return {
            **self.env,
            "AZURE_STORAGE_ENDPOINT_SUFFIX": f"{ENDPOINT_SUFFIX_HOST}:{closed}",
            "AZURE_STORAGE_CONNECTION_STRING": self.env["AZURE_STORAGE_CONNECTION_STRING"].replace(f":{port};", f":{closed};"),
        }

    def run(self, argv: Sequence[str], **kw) -> subprocess.CompletedProcess:
        return self.service.run(argv, **kw)

    def python(self, code: str, *args: str, **kw) -> subprocess.CompletedProcess:
        return self.service.python(code, *args, **kw)
