"""The Dockerfile and the Kubernetes manifests under deploy/ checked against the service itself.

Nothing here needs a cluster or a Docker engine: the manifests are parsed with PyYAML and held
against ``Settings`` (every STREAMER_/TRTLLM_ variable is a real setting and its value parses),
the CLI parser (every daemon command line and probe parses), and each other (the engine mounts
the daemon's socket, shm and cache volumes at the daemon's paths, runs as its UID, and reads only
URIs under its ``--allow`` prefixes). ``kubectl kustomize`` runs where kubectl is installed.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

from streamer_client._settings import SETTINGS
from streamer_client.errors import SettingsError
from streamer_service import cli
from streamer_service.settings import Settings, get_settings
from streamer_service.uri import parse_uri

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"

PROG = "streamer-service"
# Memory a daemon container needs beyond STREAMER_SHM_BUDGET + STREAMER_RETENTION_BUDGET: one
# oversized tensor (the largest tensor of the models served; 4Gi covers today's) and the process.
DAEMON_HEADROOM = (4 * 2**30, 16 * 2**30)
WORKLOAD_KINDS = {"Pod", "Deployment", "DaemonSet", "StatefulSet", "ReplicaSet", "Job", "CronJob"}
# Variables of ours (Settings) and of the environment the settings read besides STREAMER_*.
OWN_PREFIXES = ("STREAMER_", "TRTLLM_")
SETTING_ENV_PREFIXES = ("STREAMER_", "TRTLLM_", "AZURE_STORAGE_", "TORCHELASTIC_")


# --------------------------------------------------------------------------- valid names


VALID_NAMES = {name for row in SETTINGS for name in row.env}
"""Env names the service and the client read: the settings table's (streamer_client._settings)."""


def test_valid_names_are_derived():
    assert {"STREAMER_SOCKET", "STREAMER_SHM_DIR", "STREAMER_SHM_BUDGET", "STREAMER_CACHE_DIR",
            "TRTLLM_OBJECT_STORAGE_FORCE_PULL", "STREAMER_CONNECT_TIMEOUT_S"} <= VALID_NAMES  # fmt: skip
    assert "STREAMER_NO_SUCH_THING" not in VALID_NAMES


# --------------------------------------------------------------------------- settings under an env


@pytest.fixture
def settings_env(monkeypatch: pytest.MonkeyPatch):
    """``apply(env)``: the process environment holds exactly ``env``'s setting variables."""

    def apply(env: dict[str, str]) -> None:
        for name in list(os.environ):
            if name.startswith(SETTING_ENV_PREFIXES):
                monkeypatch.delenv(name)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        get_settings.cache_clear()

    yield apply
    get_settings.cache_clear()


def _effective(argv: list[str], env: dict[str, str], settings_env) -> tuple[Any, Settings]:
    """What ``streamer-service ARGV`` under ``env`` runs with: its parsed args and the settings
    (environment + flags, validated) that cli._settings builds for it."""
    assert argv and argv[0] == PROG, f"not a {PROG} command line: {argv}"
    settings_env(env)
    try:
        args = cli.build_parser().parse_args(argv[1:])
    except SystemExit:
        pytest.fail(f"the CLI refuses {shlex.join(argv)}")
    try:
        return args, cli._settings(args)
    except SettingsError as exc:
        pytest.fail(f"{shlex.join(argv)} with {env}: invalid settings: {exc}")


# --------------------------------------------------------------------------- manifests


def _yaml_files() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yaml", ".yml"))


def _documents() -> list[tuple[Path, dict]]:
    docs = []
    for path in _yaml_files():
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                docs.append((path, doc))
    return docs


@dataclass
class Pod:
    path: Path
    kind: str
    name: str
    spec: dict

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)} {self.kind}/{self.name}"

    def containers(self) -> Iterator[tuple[dict, bool]]:
        """(container, is_init) for every container of the pod, init containers first."""
        for c in self.spec.get("initContainers") or []:
            yield c, True
        for c in self.spec.get("containers") or []:
            yield c, False

    def volume(self, name: str) -> dict:
        for v in self.spec.get("volumes") or []:
            if v["name"] == name:
                return v
        raise AssertionError(f"{self.where}: no volume {name!r}")

    def source(self, name: str) -> tuple:
        """What a volume is, for 'the same volume': a host path is the same across pods; any
        other volume only within its pod, by name."""
        v = self.volume(name)
        if "hostPath" in v:
            return ("hostPath", str(PurePosixPath(v["hostPath"]["path"])))
        return ("pod", id(self), name)

    def security(self, c: dict, key: str) -> Any:
        """A securityContext field as it applies to container ``c`` (container wins over pod)."""
        sc = c.get("securityContext") or {}
        if key in sc:
            return sc[key]
        return (self.spec.get("securityContext") or {}).get(key)


def _pods() -> list[Pod]:
    pods = []
    for path, doc in _documents():
        kind = doc.get("kind")
        if kind not in WORKLOAD_KINDS:
            continue
        name = doc["metadata"]["name"]
        if kind == "Pod":
            spec = doc["spec"]
        elif kind == "CronJob":
            spec = doc["spec"]["jobTemplate"]["spec"]["template"]["spec"]
        else:
            spec = doc["spec"]["template"]["spec"]
        pods.append(Pod(path, kind, name, spec))
    return pods


def _argv(c: dict) -> list[str]:
    return [str(a) for a in (c.get("command") or []) + (c.get("args") or [])]


def _is_daemon(c: dict) -> bool:
    argv = _argv(c)
    return argv[:2] == [PROG, "serve"]


def _env(c: dict) -> dict[str, str]:
    return {e["name"]: str(e["value"]) for e in c.get("env") or [] if "value" in e}


def _env_names(c: dict) -> list[str]:
    return [e["name"] for e in c.get("env") or []]


def _mount(c: dict, path: str | PurePosixPath) -> dict | None:
    target = PurePosixPath(path)
    for m in c.get("volumeMounts") or []:
        if PurePosixPath(m["mountPath"]) == target:
            return m
    return None


_SIZE = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15,
         "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50}  # fmt: skip


def _quantity(value: str | int) -> int:
    """A Kubernetes memory quantity in bytes (``20Gi``, ``512M``, ``1000``)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kMGTP]i?|Ki)?", str(value))
    assert m, f"not a memory quantity: {value!r}"
    return int(float(m.group(1)) * _SIZE[m.group(2) or ""])


def _shell_invocations(c: dict) -> list[list[str]]:
    """``streamer-service ...`` command lines inside a ``sh -c SCRIPT`` container command."""
    argv = _argv(c)
    if len(argv) < 3 or PurePosixPath(argv[0]).name not in ("sh", "bash") or argv[1] != "-c":
        return []
    found = []
    for part in re.split(r"[;&|\n]|\bdo\b|\bthen\b|\buntil\b|\bwhile\b|\bif\b", argv[2]):
        words = shlex.split(part)
        if words and words[0] == PROG:
            found.append(words)
    return found


@dataclass
class Daemon:
    pod: Pod
    container: dict
    args: Any
    settings: Settings
    clients: list[tuple[Pod, dict, bool]] = field(default_factory=list)


@pytest.fixture
def daemons(settings_env) -> list[Daemon]:
    """Every streamer daemon container in deploy/, with its effective settings and the
    containers that use it (same pod, or any pod in the same directory for a DaemonSet)."""
    pods = _pods()
    found: list[Daemon] = []
    for pod in pods:
        for c, _ in pod.containers():
            if _is_daemon(c):
                args, settings = _effective(_argv(c), _env(c), settings_env)
                found.append(Daemon(pod, c, args, settings))
    for pod in pods:
        clients = [(c, init) for c, init in pod.containers() if not _is_daemon(c) and "STREAMER_SOCKET" in _env(c)]
        if not clients:
            continue
        local = [d for d in found if d.pod is pod]
        node = [d for d in found if d.pod.kind == "DaemonSet" and d.pod.path.parent == pod.path.parent]
        partners = local or node
        assert len(partners) == 1, f"{pod.where}: its clients need exactly one daemon in the pod or one DaemonSet beside it"
        partners[0].clients.extend((pod, c, init) for c, init in clients)
    return found


# --------------------------------------------------------------------------- tests: manifests


def test_every_manifest_parses():
    files = _yaml_files()
    assert files, "no YAML under deploy/"
    for path in files:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
        assert docs, f"{path}: empty"
        for doc in docs:
            assert isinstance(doc, dict) and doc.get("apiVersion") and doc.get("kind"), f"{path}: not a resource"


def test_both_topologies_exist(daemons):
    kinds = {(d.pod.path.parent.name, d.pod.kind) for d in daemons}
    assert ("sidecar", "Deployment") in kinds and ("daemonset", "DaemonSet") in kinds, kinds


def test_kustomizations_reference_every_manifest():
    referenced: set[Path] = set()
    for kfile in DEPLOY.rglob("kustomization.yaml"):
        k = yaml.safe_load(kfile.read_text())
        for res in k.get("resources") or []:
            target = (kfile.parent / res).resolve()
            assert target.exists(), f"{kfile}: resource {res} does not exist"
            if target.is_dir():
                assert (target / "kustomization.yaml").exists(), f"{kfile}: {res} is no kustomization"
            else:
                referenced.add(target)
    for path in _yaml_files():
        if path.name == "kustomization.yaml" or ".example." in path.name:
            continue
        assert path.resolve() in referenced, f"{path} is in no kustomization (name it *.example.yaml if on purpose)"


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
def test_kustomize_builds():
    for kfile in sorted(DEPLOY.rglob("kustomization.yaml")):
        result = subprocess.run(
            ["kubectl", "kustomize", str(kfile.parent)], check=False, capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 0, f"kubectl kustomize {kfile.parent}: {result.stderr}"
        assert list(yaml.safe_load_all(result.stdout))


def test_env_names_are_real_settings():
    """Every STREAMER_*/TRTLLM_* name a manifest sets (env, or keys of a Secret/ConfigMap) is read
    by the service or the client."""
    seen = 0
    for pod in _pods():
        for c, _ in pod.containers():
            for name in _env_names(c):
                if name.startswith(OWN_PREFIXES):
                    seen += 1
                    assert name in VALID_NAMES, f"{pod.where} container {c['name']}: {name} is no setting"
    for path, doc in _documents():
        if doc.get("kind") in ("Secret", "ConfigMap"):
            for name in list(doc.get("data") or {}) + list(doc.get("stringData") or {}):
                if name.startswith(OWN_PREFIXES):
                    assert name in VALID_NAMES, f"{path}: {name} is no setting"
    assert seen, "no STREAMER_* variable in any manifest"


def test_every_container_env_parses(settings_env):
    for pod in _pods():
        for c, _ in pod.containers():
            env = _env(c)
            settings_env(env)
            try:
                Settings()
            except Exception as exc:  # noqa: BLE001 - report which manifest
                pytest.fail(f"{pod.where} container {c['name']}: its environment does not parse: {exc}")


def test_envfrom_references_are_optional_or_defined():
    defined = {(d["kind"], d["metadata"]["name"]) for _, d in _documents() if d.get("kind") in ("Secret", "ConfigMap")}
    for pod in _pods():
        for c, _ in pod.containers():
            for ref in c.get("envFrom") or []:
                for key, kind in (("secretRef", "Secret"), ("configMapRef", "ConfigMap")):
                    if key in ref:
                        assert ref[key].get("optional") or (kind, ref[key]["name"]) in defined, (
                            f"{pod.where}: {kind} {ref[key]['name']} neither defined nor optional"
                        )


def test_daemon_command_lines_parse(daemons):
    assert daemons
    for d in daemons:
        assert d.args.command == "serve"
        assert d.settings.socket is not None, f"{d.pod.where}: set STREAMER_SOCKET (or --socket) explicitly"
        assert d.settings.allow, f"{d.pod.where}: the daemon should be limited with --allow prefixes"
        for prefix in d.settings.allow:
            parse_uri(prefix)  # what the daemon does with each prefix at start


def test_other_streamer_command_lines_parse(settings_env):
    """Containers of the streamer image that are not the daemon (init containers) run
    streamer-service command lines that parse, or no streamer-service at all."""
    for pod in _pods():
        for c, _ in pod.containers():
            if _is_daemon(c):
                continue
            for argv in _shell_invocations(c) + ([_argv(c)] if _argv(c)[:1] == [PROG] else []):
                _effective(argv, _env(c), settings_env)


def test_shm_volume_holds_the_budget(daemons):
    for d in daemons:
        # Ring segments and the checkpoints kept resident both live in the shm dir.
        budget = int(d.settings.shm_budget) + int(d.settings.retention_budget)
        mount = _mount(d.container, d.settings.shm_dir)
        assert mount, f"{d.pod.where}: STREAMER_SHM_DIR {d.settings.shm_dir} is not a volume mount"
        volume = d.pod.volume(mount["name"])
        if "emptyDir" in volume:
            ed = volume["emptyDir"] or {}
            assert ed.get("medium") == "Memory", f"{d.pod.where}: the shm emptyDir must be medium: Memory"
            assert "sizeLimit" in ed, f"{d.pod.where}: size the shm emptyDir (sizeLimit)"
            size = _quantity(ed["sizeLimit"])
            assert budget < size, (
                f"{d.pod.where}: STREAMER_SHM_BUDGET + STREAMER_RETENTION_BUDGET {budget} must stay below sizeLimit {size}"
            )
        else:
            assert "hostPath" in volume, f"{d.pod.where}: shm must be a memory emptyDir or a hostPath"
            host = PurePosixPath(volume["hostPath"]["path"])
            assert host.is_relative_to("/dev/shm"), f"{d.pod.where}: a hostPath shm dir belongs on the host's /dev/shm tmpfs"
            size = budget
        # tmpfs pages are charged to the memory cgroup of the process that touches them first:
        # the daemon, which allocates every segment (docs/deploy.md, "Memory sizing").
        resources = d.container.get("resources") or {}
        limit = (resources.get("limits") or {}).get("memory")
        assert limit, f"{d.pod.where}: give the daemon a memory limit (its segments are charged to it)"
        assert _quantity(limit) > size, f"{d.pod.where}: memory limit {limit} must exceed the shm size {size}"
        # The limit follows from the budgets: ring + resident copies + one oversized tensor and
        # the process (DAEMON_HEADROOM); more than that is memory nobody accounted for.
        headroom = _quantity(limit) - budget
        assert DAEMON_HEADROOM[0] <= headroom <= DAEMON_HEADROOM[1], (
            f"{d.pod.where}: memory limit {limit} is STREAMER_SHM_BUDGET + STREAMER_RETENTION_BUDGET + {headroom / 2**30:g}Gi; "
            f"make the headroom (one oversized tensor + the process) {DAEMON_HEADROOM[0] // 2**30}-{DAEMON_HEADROOM[1] // 2**30}Gi"
        )
        assert (resources.get("requests") or {}).get("memory") == limit, f"{d.pod.where}: request the memory the limit allows"


def test_engines_request_cpu_and_memory(daemons):
    """The engine's own memory: what it maps of the daemon's segments is charged to the daemon."""
    for d in daemons:
        for pod, c, init in d.clients:
            if init:
                continue
            requests = (c.get("resources") or {}).get("requests") or {}
            assert requests.get("cpu") and requests.get("memory"), f"{pod.where} {c['name']}: CPU and memory requests"


def test_node_daemons_have_a_priority_class_of_their_own(daemons):
    classes = {doc["metadata"]["name"]: doc for _, doc in _documents() if doc.get("kind") == "PriorityClass"}
    node = [d for d in daemons if d.pod.kind == "DaemonSet"]
    assert node
    for d in node:
        name = d.pod.spec.get("priorityClassName")
        assert name, f"{d.pod.where}: set a priorityClassName (preempt, not wait, on a full node)"
        assert name.startswith("system-") or name in classes, f"{d.pod.where}: PriorityClass {name} is not defined in deploy/"
        if name in classes:
            assert classes[name]["value"] >= 1_000_000 and not classes[name].get("globalDefault"), name


def test_daemon_paths_are_volumes(daemons):
    for d in daemons:
        socket_dir = PurePosixPath(d.settings.socket).parent
        for what, path in (("socket dir", socket_dir), ("shm dir", d.settings.shm_dir), ("cache dir", d.settings.cache_dir)):
            assert _mount(d.container, path), f"{d.pod.where}: the daemon's {what} {path} is not a volume mount"
        if d.pod.security(d.container, "readOnlyRootFilesystem"):
            assert _mount(d.container, "/tmp"), f"{d.pod.where}: read-only root needs a /tmp volume"


def test_clients_share_the_daemon_volumes_and_values(daemons):
    for d in daemons:
        assert d.clients, f"{d.pod.where}: no inference container uses this daemon"
        dsocket = PurePosixPath(d.settings.socket)
        paths = {
            "STREAMER_SOCKET": (str(dsocket), dsocket.parent),
            "STREAMER_SHM_DIR": (str(d.settings.shm_dir), PurePosixPath(d.settings.shm_dir)),
            "STREAMER_CACHE_DIR": (str(d.settings.cache_dir), PurePosixPath(d.settings.cache_dir)),
        }
        engines = 0
        for pod, c, init in d.clients:
            env = _env(c)
            where = f"{pod.where} container {c['name']}"
            for name, (value, mount_path) in paths.items():
                if name == "STREAMER_SOCKET" or name in env:
                    assert env.get(name) == value, f"{where}: {name}={env.get(name)!r}, the daemon's is {value!r}"
                    mine, theirs = _mount(c, mount_path), _mount(d.container, mount_path)
                    assert mine, f"{where}: {mount_path} ({name}) is not mounted"
                    assert pod.source(mine["name"]) == d.pod.source(theirs["name"]), (
                        f"{where}: {mount_path} is not the daemon's volume"
                    )
            if not init:
                engines += 1
                # pull_metadata returns a dir in the daemon's cache: the engine reads it there.
                for name in paths:
                    assert name in env, f"{where}: set {name} as the daemon has it"
        assert engines, f"{d.pod.where}: no engine container sets the daemon's variables"


def test_clients_run_as_the_daemon_uid(daemons):
    """The socket (0600 by default) and the segment files (0600) are the daemon's: the
    engine runs as the same UID (docs/deploy.md, "Socket and segment permissions")."""
    for d in daemons:
        uid = d.pod.security(d.container, "runAsUser")
        gid = d.pod.security(d.container, "runAsGroup")
        assert uid is not None
        for pod, c, _ in d.clients:
            assert pod.security(c, "runAsUser") == uid, f"{pod.where} {c['name']}: runAsUser must be the daemon's {uid}"
            assert pod.security(c, "runAsGroup") == gid, f"{pod.where} {c['name']}: runAsGroup must be the daemon's {gid}"


def test_clients_read_only_allowed_uris(daemons):
    for d in daemons:
        allowed = [parse_uri(p).normalized for p in d.settings.allow]
        for pod, c, _ in d.clients:
            for arg in _argv(c):
                if re.match(r"^(s3|gs|az)://", arg):
                    uri = parse_uri(arg).normalized
                    assert any(uri == p or uri.startswith(p.rstrip("/") + "/") for p in allowed), (
                        f"{pod.where} {c['name']}: {arg} is under no --allow prefix of its daemon {allowed}"
                    )


def _container_port(c: dict, port: int | str) -> int | None:
    """The container port a probe's or monitor's ``port`` (a number or a port name) refers to."""
    if isinstance(port, int):
        return port
    return next((p["containerPort"] for p in c.get("ports") or [] if p.get("name") == port), None)


def test_daemon_probes_ask_healthz_on_the_metrics_port_or_run_the_health_command(daemons, settings_env):
    """kubelet's HTTP probe on the metrics listener's /healthz (cheap: no process started), or an
    exec probe running `streamer-service health` against the daemon's own socket."""
    for d in daemons:
        env = _env(d.container)
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = d.container.get(kind)
            assert probe is not None, f"{d.pod.where}: the daemon needs a {kind}"
            assert len(set(probe) & {"exec", "httpGet", "tcpSocket", "grpc"}) == 1, f"{d.pod.where} {kind}"
            if "httpGet" in probe:
                get = probe["httpGet"]
                assert get["path"] == "/healthz", f"{d.pod.where} {kind}: the metrics listener answers probes at /healthz"
                assert d.settings.metrics_port is not None, f"{d.pod.where} {kind}: an HTTP probe needs --metrics-port"
                assert _container_port(d.container, get["port"]) == d.settings.metrics_port, (
                    f"{d.pod.where} {kind}: port {get['port']} is not the metrics port {d.settings.metrics_port}"
                )
                continue
            assert "exec" in probe, f"{d.pod.where} {kind}: the API is on a unix socket: httpGet on the metrics port, or exec"
            assert probe.get("timeoutSeconds", 1) >= 5, f"{d.pod.where} {kind}: the CLI needs seconds to start (timeoutSeconds)"
            args, settings = _effective([str(a) for a in probe["exec"]["command"]], env, settings_env)
            assert args.command == "health", f"{d.pod.where} {kind}: {probe['exec']['command']}"
            assert settings.socket == d.settings.socket, f"{d.pod.where} {kind}: asks another socket"


def test_daemons_serve_metrics_that_a_pod_monitor_scrapes(daemons):
    monitors = [doc for _, doc in _documents() if doc.get("kind") == "PodMonitor"]
    assert monitors, "no PodMonitor in deploy/"
    for d in daemons:
        assert d.settings.metrics_port is not None, f"{d.pod.where}: serve --metrics-port (Prometheus cannot reach the socket)"
        labels = _template_labels(d.pod)
        scraping = [m for m in monitors if _selects(m["spec"]["selector"], labels)]
        assert len(scraping) == 1, f"{d.pod.where}: {len(scraping)} PodMonitors select this pod (labels {labels})"
        for endpoint in scraping[0]["spec"]["podMetricsEndpoints"]:
            assert endpoint.get("path", "/metrics") == "/metrics"
            assert _container_port(d.container, endpoint["port"]) == d.settings.metrics_port, (
                f"{d.pod.where}: PodMonitor port {endpoint['port']} is not the daemon's metrics port"
            )


def _template_labels(pod: Pod) -> dict[str, str]:
    for path, doc in _documents():
        if path == pod.path and doc.get("kind") == pod.kind and doc["metadata"]["name"] == pod.name:
            meta = doc["metadata"] if pod.kind == "Pod" else doc["spec"]["template"]["metadata"]
            return meta.get("labels") or {}
    raise AssertionError(pod.where)


def _selects(selector: dict, labels: dict[str, str]) -> bool:
    """A Kubernetes label selector (matchLabels, matchExpressions In/NotIn/Exists/DoesNotExist)."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        key, op, values = e["key"], e["operator"], e.get("values") or []
        ok = {"In": labels.get(key) in values, "NotIn": labels.get(key) not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]  # fmt: skip
        if not ok:
            return False
    return True


def test_containers_run_as_non_root():
    for pod in _pods():
        for c, init in pod.containers():
            where = f"{pod.where} container {c['name']}"
            caps = (c.get("securityContext") or {}).get("capabilities") or {}
            assert "ALL" in (caps.get("drop") or []), f"{where}: drop ALL capabilities"
            assert pod.security(c, "allowPrivilegeEscalation") is False, f"{where}: allowPrivilegeEscalation: false"
            assert not pod.security(c, "privileged"), f"{where}: privileged"
            uid = pod.security(c, "runAsUser")
            if uid == 0:
                # The one exception: an init container handing kubelet-created host dirs to the
                # daemon's UID, with CAP_CHOWN alone.
                assert init and c.get("restartPolicy") != "Always", f"{where}: runs as root"
                assert set(caps.get("add") or []) <= {"CHOWN"}, f"{where}: root with more than CAP_CHOWN"
                argv = _argv(c)
                assert argv[:2] == ["sh", "-c"] and re.fullmatch(r"chown \d+:\d+( /[\w./-]+)+", argv[2]), (
                    f"{where}: root does more than chown"
                )
                continue
            assert pod.security(c, "runAsNonRoot") is True, f"{where}: runAsNonRoot: true"
            assert isinstance(uid, int) and uid > 0, f"{where}: set a non-zero runAsUser"
            assert not caps.get("add"), f"{where}: adds capabilities"


def test_daemons_have_a_read_only_root_and_a_cloud_identity(daemons):
    for d in daemons:
        assert d.pod.security(d.container, "readOnlyRootFilesystem") is True, f"{d.pod.where}: readOnlyRootFilesystem"
        assert d.pod.spec.get("serviceAccountName"), f"{d.pod.where}: run the daemon under the ServiceAccount"


def test_service_account_carries_each_clouds_identity():
    accounts = [d for _, d in _documents() if d.get("kind") == "ServiceAccount"]
    assert accounts
    annotations = accounts[0]["metadata"].get("annotations") or {}
    for key in ("eks.amazonaws.com/role-arn", "iam.gke.io/gcp-service-account", "azure.workload.identity/client-id"):
        assert key in annotations, key
    for pod in _pods():
        if any(_is_daemon(c) for c, _ in pod.containers()):
            sa = pod.spec["serviceAccountName"]
            assert sa in {a["metadata"]["name"] for a in accounts}, f"{pod.where}: ServiceAccount {sa} undefined"
    for path, doc in _documents():
        if doc.get("kind") in ("Deployment", "DaemonSet"):
            spec = doc["spec"]["template"]["spec"]
            if any(_is_daemon(c) for c in (spec.get("initContainers") or []) + spec["containers"]):
                labels = doc["spec"]["template"]["metadata"].get("labels") or {}
                assert labels.get("azure.workload.identity/use") == "true", f"{path}: Azure workload identity label"


# --------------------------------------------------------------------------- Dockerfile


@dataclass
class Instruction:
    keyword: str
    rest: str


def _dockerfile() -> list[Instruction]:
    """Instructions of the Dockerfile: continuation lines joined, comments dropped."""
    out: list[Instruction] = []
    pending = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        keyword, _, rest = line.partition(" ")
        out.append(Instruction(keyword.upper(), rest.strip()))
    assert not pending, "Dockerfile ends inside a continuation"
    return out


def _stages() -> list[list[Instruction]]:
    stages: list[list[Instruction]] = []
    for ins in _dockerfile():
        if ins.keyword == "FROM":
            stages.append([])
        if stages:
            stages[-1].append(ins)
    return stages


def _global_args() -> dict[str, str]:
    args = {}
    for ins in _dockerfile():
        if ins.keyword == "FROM":
            break
        if ins.keyword == "ARG" and "=" in ins.rest:
            k, v = ins.rest.split("=", 1)
            args[k] = v
    return args


def _subst(text: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), text)


def _stage_args(stage: list[Instruction]) -> dict[str, str]:
    args = dict(_global_args())
    for ins in stage:
        if ins.keyword == "ARG" and "=" in ins.rest:
            k, v = ins.rest.split("=", 1)
            args[k] = v
    return args


def _env_of(stage: list[Instruction]) -> dict[str, str]:
    env: dict[str, str] = {}
    for ins in stage:
        if ins.keyword != "ENV":
            continue
        words = shlex.split(ins.rest)
        if words and "=" not in words[0]:  # legacy `ENV NAME value`
            env[words[0]] = " ".join(words[1:])
            continue
        for word in words:
            k, _, v = word.partition("=")
            env[k] = v
    return env


def _exec_form(text: str) -> list[str]:
    argv = json.loads(text)
    assert isinstance(argv, list) and all(isinstance(a, str) for a in argv), f"not the exec form: {text}"
    return argv


def test_dockerfile_is_multi_stage_on_slim_python():
    stages = _stages()
    assert len(stages) >= 2, "build in one stage, run from a clean one"
    base = _subst(stages[0][0].rest.split()[0], _global_args())
    assert base.startswith("python:3.11-slim"), base
    final = stages[-1]
    assert any(i.keyword == "COPY" and "--from=" in i.rest for i in final), "the runtime stage copies the built venv"
    assert "download.pytorch.org/whl/cpu" in DOCKERFILE.read_text(), "CPU torch: the daemon never needs CUDA"


def test_image_torch_matches_bootstrap():
    """The image's torch (requirements.lock, from requirements.in) is the CPU build of the version
    the tests run with."""
    pinned = re.search(r"torch==([\w.]+)", (ROOT / "scripts" / "bootstrap").read_text())
    locked = re.search(r"^torch==(\S+) ", (ROOT / "requirements.lock").read_text(), re.M)
    assert pinned and locked and locked.group(1) == f"{pinned.group(1)}+cpu", (locked, pinned)


def test_dockerfile_runs_as_a_fixed_non_root_uid():
    final = _stages()[-1]
    users = [i.rest for i in final if i.keyword == "USER"]
    assert users, "no USER in the runtime stage"
    user = _subst(users[-1], _stage_args(final))
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) > 0, f"USER {user}: a numeric non-root UID (runAsNonRoot checks it)"
    assert not gid or (gid.isdigit() and int(gid) > 0), f"USER {user}"
    # The manifests run the daemon as the image's UID.
    for pod in _pods():
        for c, _ in pod.containers():
            if _is_daemon(c):
                assert pod.security(c, "runAsUser") == int(uid), f"{pod.where}: runAsUser is not the image's {uid}"


def test_dockerfile_env_names_and_values(settings_env):
    env = _env_of(_stages()[-1])
    own = {k: v for k, v in env.items() if k.startswith(OWN_PREFIXES)}
    assert {"STREAMER_SOCKET", "STREAMER_SHM_DIR", "STREAMER_CACHE_DIR"} <= set(own), own
    for name in own:
        assert name in VALID_NAMES, f"Dockerfile ENV {name} is no setting"
    settings_env(own)
    Settings()


def test_dockerfile_entrypoint_serves(settings_env):
    final = _stages()[-1]
    entry = [_exec_form(i.rest) for i in final if i.keyword == "ENTRYPOINT"]
    cmd = [_exec_form(i.rest) for i in final if i.keyword == "CMD"]
    argv = (entry[-1] if entry else []) + (cmd[-1] if cmd else [])
    own = {k: v for k, v in _env_of(final).items() if k.startswith(SETTING_ENV_PREFIXES)}
    args, settings = _effective(argv, own, settings_env)
    assert args.command == "serve", argv
    # The dirs the daemon writes exist in the image, made in the runtime stage (for its user).
    made = " ".join(i.rest for i in final if i.keyword == "RUN")
    for path in (PurePosixPath(settings.socket).parent, settings.cache_dir):
        assert str(path) in made, f"the runtime stage does not create {path}"


def test_dockerfile_healthcheck_asks_readiness(settings_env):
    final = _stages()[-1]
    checks = [i.rest for i in final if i.keyword == "HEALTHCHECK"]
    assert checks, "no HEALTHCHECK"
    m = re.search(r"\bCMD\s+(\[.*\])\s*$", checks[-1])
    assert m, f"HEALTHCHECK needs CMD in the exec form: {checks[-1]}"
    own = {k: v for k, v in _env_of(final).items() if k.startswith(SETTING_ENV_PREFIXES)}
    args, _ = _effective(_exec_form(m.group(1)), own, settings_env)
    assert args.command == "health" and args.ready


def _ignore_patterns() -> list[str]:
    lines = [ln.strip() for ln in DOCKERIGNORE.read_text().splitlines()]
    return [ln for ln in lines if ln and not ln.startswith("#")]


def test_dockerignore_keeps_the_context_small_but_complete():
    patterns = [p.rstrip("/") for p in _ignore_patterns()]
    for needed in (".venv", ".git", ".tools", ".whl", ".pytest_cache", ".hypothesis"):
        assert needed in patterns, f".dockerignore should exclude {needed}"
    assert any(p.endswith("*.whl") for p in patterns)
    assert not any(p.startswith("!") for p in patterns)  # keep it a plain deny list
    for stage in _stages():
        for ins in stage:
            if ins.keyword != "COPY" or "--from=" in ins.rest:
                continue
            *sources, _dest = shlex.split(ins.rest)
            for src in sources:
                src = src.rstrip("/")
                assert (ROOT / src).exists(), f"COPY {src}: not in the repository"
                for pattern in patterns:
                    assert not fnmatch.fnmatch(src, pattern.removeprefix("**/")), f"COPY {src} is excluded by {pattern}"
