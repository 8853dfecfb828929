"""The metrics listener, the metric names, and deploy/monitoring held against a real daemon.

One daemon (``serve --metrics-port``) loads a real checkpoint with two rank processes and refuses
one bad request; its metrics listener is then scraped over TCP. Every metric that the Grafana
dashboard, the PrometheusRule alerts and docs/daemon.md name must be one it exported. promtool
(tests/test_monitoring.py skips those checks where it is missing; scripts/bootstrap puts it in
.tools/promtool from Debian's prometheus package) checks the rules, runs their unit tests and
lints the exposition.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml
from daemon_harness import DaemonProcess, finish
from prometheus_client.parser import text_string_to_metric_families

from streamer_service.daemon.scrape import MetricsListener

ROOT = Path(__file__).resolve().parent.parent
MONITORING = ROOT / "deploy" / "monitoring"
DASHBOARD = MONITORING / "grafana-dashboard.json"
RULES = MONITORING / "prometheusrule.yaml"
DAEMON_DOC = ROOT / "docs" / "daemon.md"
NOT_OURS = {"up"}  # Prometheus' own series about a target


def _promtool() -> str | None:
    local = ROOT / ".tools" / "promtool" / "promtool"
    return str(local) if local.exists() else shutil.which("promtool")


needs_promtool = pytest.mark.skipif(_promtool() is None, reason="promtool not installed (scripts/bootstrap)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- a real daemon, scraped


@pytest.fixture(scope="module")
def scraped(tmp_path_factory) -> dict:
    """``{"text": exposition, "families": {name: type}, "samples": {(name, labels): value}}`` of a
    daemon's metrics listener after a real two-rank load and one refused request."""
    from streamer_service.sample import build_sample

    root = tmp_path_factory.mktemp("monitored")
    src = root / "ckpt"
    build_sample(src, size_mb=12)
    port = _free_port()
    with pytest.MonkeyPatch.context() as mp:
        for name in list(os.environ):
            if name.startswith(("STREAMER_", "AWS_", "GOOGLE_", "AZURE_")) and not name.startswith("STREAMER_TEST_"):
                mp.delenv(name)
        env = {"STREAMER_CACHE_DIR": str(root / "cache"), "STREAMER_RANK_TIMEOUT_S": "300"}
        d = DaemonProcess(root, env, "--metrics-port", str(port), "--metrics-host", "127.0.0.1", "--shm-budget", "8MiB").start()
        try:
            ranks = [d.start_rank(str(src), r, 2, src, None) for r in range(2)]
            for p in ranks:
                assert finish(p)["bad"] == []
            with d.client() as c:  # one refused request: a selection that matches nothing
                reply = c.post("/v1/sessions/join", json={"uri": str(src), "session": "s", "rank": 0, "world_size": 1,
                                                           "select": ["no.such.tensor"]})  # fmt: skip
                assert reply.json()["error"]["type"] == "SelectionError"
            base = f"http://127.0.0.1:{port}"
            reply = httpx.get(f"{base}/metrics", timeout=10)
            assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/plain; version=0.0.4")
            extra = {
                "healthz": httpx.get(f"{base}/healthz", timeout=10),
                "stats": httpx.get(f"{base}/v1/stats", timeout=10),
                "readyz": httpx.get(f"{base}/readyz", timeout=10),
                "post": httpx.post(f"{base}/metrics", timeout=10),
                "join": httpx.post(f"{base}/v1/sessions/join", json={}, timeout=10),
            }
        finally:
            d.stop()
    families = {f.name: f.type for f in text_string_to_metric_families(reply.text)}
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(reply.text) for s in f.samples
    }
    return {"text": reply.text, "families": families, "samples": samples, "unique": _union_bytes(src), **extra}


def _union_bytes(src: Path) -> int:
    from streamer_service.checkpoint.catalog import build_catalog
    from streamer_service.settings import Settings
    from streamer_service.storage import open_storage
    from streamer_service.uri import parse_uri

    return sum(t.nbytes for t in build_catalog(open_storage(parse_uri(str(src)), Settings())).tensors)


_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "info": ("_info",),
             "gauge": ("",), "summary": ("_sum", "_count"), "unknown": ("",)}  # fmt: skip


def _series_names(families: dict[str, str]) -> set[str]:
    """Every series name a scrape of these families can hold (``x_total``, ``x_bucket``, ...)."""
    return {name + suffix for name, kind in families.items() for suffix in _SUFFIXES[kind]}


def _metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects, from its parsed form."""
    import promql_parser

    tree = promql_parser.parse(expr)  # raises on a syntax error
    return set(re.findall(r'VectorSelector \{\s*name: Some\(\s*"([^"]+)"', repr(tree)))


def test_listener_serves_the_daemons_metrics_after_a_load(scraped):
    s = scraped["samples"]
    unique = scraped["unique"]
    assert s[("streamer_storage_read_bytes_total", (("scheme", "file"),))] == unique
    assert s[("streamer_load_unique_bytes_total", (("scheme", "file"),))] == unique
    assert s[("streamer_rank_delivered_bytes_total", (("rank", "0"),))] == unique  # no selection: everything
    assert s[("streamer_sessions_total", (("outcome", "done"),))] == 1
    assert s[("streamer_errors_total", (("type", "SelectionError"),))] == 1
    assert s[("streamer_load_duration_seconds_count", (("scheme", "file"),))] == 1
    assert s[("streamer_time_to_first_tensor_seconds_count", (("scheme", "file"),))] == 1
    assert s[("streamer_shm_in_use_bytes", ())] == 0
    assert s[("streamer_shm_budget_bytes", ())] == 8 * 1024**2
    build = next(labels for (name, labels), _ in s.items() if name == "streamer_build_info")
    assert dict(build)["version"] == "0.1.0" and dict(build)["runai_version"] == "0.17.0"
    assert s[("process_resident_memory_bytes", ())] > 0  # the standard process metrics
    assert any(name == "python_info" for name, _ in s)


def test_listener_is_read_only_and_knows_two_paths(scraped):
    assert scraped["healthz"].status_code == 200 and scraped["healthz"].json() == {"status": "ready"}
    for what in ("stats", "readyz"):
        assert scraped[what].status_code == 404, what
    for what in ("post", "join"):  # no method but GET and HEAD
        assert scraped[what].status_code == 501, what


def test_healthz_says_unavailable_when_the_api_does_not_answer(tmp_path):
    listener = MetricsListener("127.0.0.1", _free_port(), lambda: None, tmp_path / "nobody.sock")
    listener.start()
    try:
        host, port = listener.address
        health = httpx.get(f"http://{host}:{port}/healthz", timeout=10)
        metrics = httpx.get(f"http://{host}:{port}/metrics", timeout=10)
    finally:
        listener.close()
    assert health.status_code == 503
    assert health.json()["status"] == "unavailable" and "nobody.sock" in health.json()["error"]
    assert metrics.status_code == 503  # the daemon has not started: nothing to report yet


def test_a_metrics_port_in_use_is_a_config_error(tmp_path):
    from streamer_client.errors import ConfigError

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=rf"cannot listen for metrics on 127.0.0.1:{port}"):
            MetricsListener("127.0.0.1", port, lambda: None, tmp_path / "d.sock")


def test_metric_names_follow_prometheus_conventions(scraped):
    ours = {name: kind for name, kind in scraped["families"].items() if name.startswith("streamer_")}
    assert len(ours) >= 20, sorted(ours)
    for name in ours:
        # A base unit, once, at the end: streamer_shm_in_use_bytes, not streamer_shm_bytes_in_use.
        for unit in ("bytes", "seconds"):
            assert f"_{unit}_" not in name + "_" or name.endswith(f"_{unit}") or name.endswith(f"_{unit}_per_second"), name
        assert not re.search(r"_(kb|mb|gb|ms|millis|milliseconds)(_|$)", name), name


@needs_promtool
def test_promtool_lints_the_exposition(scraped):
    result = subprocess.run([_promtool(), "check", "metrics"], input=scraped["text"], capture_output=True, text=True, timeout=60)
    problems = [line for line in (result.stdout + result.stderr).splitlines() if line.startswith("streamer_")]
    assert result.returncode == 0 and not problems, result.stdout + result.stderr


# --------------------------------------------------------------------------- dashboard, rules, docs


def _dashboard_queries() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    queries = []
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            queries.append((panel["title"], target["expr"]))
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            m = re.fullmatch(r"label_values\((\w+), *\w+\)", var["definition"])
            assert m, var["definition"]
            queries.append((f"variable {var['name']}", m.group(1)))
    return queries


def _grafana_to_promql(expr: str) -> str:
    """A dashboard query with Grafana's variables replaced by what Grafana would put there."""
    return expr.replace("$__rate_interval", "1m").replace("$__range", "1h").replace("$instance", ".*")


def _rules() -> list[dict]:
    doc = yaml.safe_load(RULES.read_text())
    assert doc["kind"] == "PrometheusRule"
    return [rule for group in doc["spec"]["groups"] for rule in group["rules"]]


def test_dashboard_shows_what_an_operator_asks_first():
    titles = " | ".join(title for title, _ in _dashboard_queries()).lower()
    for needed in ("load duration", "time to first tensor", "throughput", "storage bytes / unique bytes",
                   "shared memory: in use vs budget", "resident", "failures"):  # fmt: skip
        assert needed in titles, needed


def test_dashboard_queries_name_only_exported_metrics(scraped):
    exported = _series_names(scraped["families"]) | NOT_OURS
    for title, expr in _dashboard_queries():
        names = _metric_names(_grafana_to_promql(expr))
        assert names, f"{title}: {expr} selects no metric"
        assert names <= exported, f"dashboard panel {title!r}: {sorted(names - exported)} not exported by the daemon"


def test_alert_rules_name_only_exported_metrics(scraped):
    exported = _series_names(scraped["families"]) | NOT_OURS
    alerts = {rule["alert"]: rule for rule in _rules()}
    assert {"StreamerDaemonDown", "StreamerLoadsFailing", "StreamerStorageErrors", "StreamerShmBudgetSaturated"} <= set(alerts)
    for name, rule in alerts.items():
        names = _metric_names(rule["expr"])
        assert names and names <= exported, f"alert {name}: {sorted(names - exported)} not exported by the daemon"
        assert rule["labels"]["severity"] in ("warning", "critical") and rule["annotations"]["summary"], name


def test_docs_list_exactly_the_exported_metrics(scraped):
    """docs/daemon.md, "Metrics": every streamer_ series the daemon exports, and no other."""
    text = DAEMON_DOC.read_text()
    section = text[text.index("## Metrics") :]
    section = section[: section.index("\n## ", 1)]
    documented = set(re.findall(r"`(streamer_\w+)", section))
    exported = {name for name in _series_names(scraped["families"]) if name.startswith("streamer_")}
    base = {name for name, kind in scraped["families"].items() if name.startswith("streamer_")}
    missing = {name for name in base if not any(n.startswith(name) for n in documented)}
    assert not missing, f"exported, not in docs/daemon.md: {sorted(missing)}"
    assert documented <= exported | base, f"in docs/daemon.md, not exported: {sorted(documented - exported - base)}"


def _rule_file(tmp_path: Path, *, annotations: bool = True) -> Path:
    """The PrometheusRule's spec as a plain Prometheus rule file (what promtool reads); without
    the annotations for ``promtool test rules``, which would compare their text too."""
    spec = yaml.safe_load(RULES.read_text())["spec"]
    if not annotations:
        for group in spec["groups"]:
            for rule in group["rules"]:
                rule.pop("annotations", None)
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


@needs_promtool
def test_promtool_checks_the_rules(tmp_path):
    result = subprocess.run(
        [_promtool(), "check", "rules", str(_rule_file(tmp_path))], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(_rules())} rules found" in result.stdout


# Series in, alerts out (promtool test rules): each alert fires on the failure it is about and
# stays quiet on a healthy daemon beside it.
RULE_TESTS = """
rule_files: [rules.yaml]
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      - series: 'up{job="ml/streamer-service", instance="10.0.0.1:9477", pod="streamer-a"}'
        values: '0x10'
      - series: 'up{job="ml/streamer-service", instance="10.0.0.2:9477", pod="streamer-b"}'
        values: '1x10'
      - series: 'streamer_sessions_total{namespace="ml", pod="streamer-a", outcome="failed"}'
        values: '0 0 1 1 1 1 1 1 1 1 1'
      - series: 'streamer_sessions_total{namespace="ml", pod="streamer-b", outcome="done"}'
        values: '0 1 2 3 4 5 6 7 8 9 10'
      - series: 'streamer_errors_total{namespace="ml", pod="streamer-a", type="StorageAccessDeniedError"}'
        values: '0 0 4 4 4 4 4 4 4 4 4'
      - series: 'streamer_errors_total{namespace="ml", pod="streamer-b", type="SelectionError"}'
        values: '0 0 4 4 4 4 4 4 4 4 4'
      - series: 'streamer_shm_in_use_bytes{namespace="ml", pod="streamer-a"}'
        values: '100x40'
      - series: 'streamer_shm_budget_bytes{namespace="ml", pod="streamer-a"}'
        values: '100x40'
      - series: 'streamer_shm_in_use_bytes{namespace="ml", pod="streamer-b"}'
        values: '50x40'
      - series: 'streamer_shm_budget_bytes{namespace="ml", pod="streamer-b"}'
        values: '100x40'
    alert_rule_test:
      - eval_time: 6m
        alertname: StreamerDaemonDown
        exp_alerts:
          - exp_labels: {severity: critical, job: ml/streamer-service, instance: "10.0.0.1:9477", pod: streamer-a}
      - eval_time: 5m
        alertname: StreamerLoadsFailing
        exp_alerts:
          - exp_labels: {severity: warning, namespace: ml, pod: streamer-a}
      - eval_time: 5m
        alertname: StreamerStorageErrors
        exp_alerts:
          - exp_labels: {severity: warning, namespace: ml, pod: streamer-a, type: StorageAccessDeniedError}
      - eval_time: 20m
        alertname: StreamerShmBudgetSaturated
        exp_alerts: []
      - eval_time: 35m
        alertname: StreamerShmBudgetSaturated
        exp_alerts:
          - exp_labels: {severity: warning, namespace: ml, pod: streamer-a}
"""


@needs_promtool
def test_each_alert_fires_on_its_failure_only(tmp_path):
    _rule_file(tmp_path, annotations=False)
    (tmp_path / "tests.yaml").write_text(RULE_TESTS)
    result = subprocess.run(
        [_promtool(), "test", "rules", "tests.yaml"], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_rule_and_dashboard_expressions_parse_without_promtool():
    """The same expressions through a PromQL parser, so a machine without promtool still checks them."""
    for rule in _rules():
        assert _metric_names(rule["expr"]), rule["alert"]
    for title, expr in _dashboard_queries():
        assert _metric_names(_grafana_to_promql(expr)), title
