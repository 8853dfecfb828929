"""The node daemon with real rank processes: each byte once per node, bounded shm, failures."""

from __future__ import annotations

import mmap
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from daemon_harness import DaemonProcess, ShmSampler, finish, segment_files, wait_until

from streamer_service.checkpoint.catalog import build_catalog
from streamer_service.sample import rank_selection
from streamer_service.settings import Settings
from streamer_service.storage import open_storage
from streamer_service.uri import parse_uri

WORLD = 4


def _catalog(src: Path):
    return build_catalog(open_storage(parse_uri(str(src)), Settings()))


def _upload(backend, src: Path) -> str:
    backend.put_tree("ckpt", {p.name: p.read_bytes() for p in src.iterdir()})
    return backend.uri("ckpt")


def _scrape(d: DaemonProcess) -> dict:
    """``/metrics`` parsed: {(sample name, sorted labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    with d.client() as c:
        text = c.get("/metrics").text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _range_bytes(backend) -> int:
    """Tensor-file bytes the storage served, from the proxy's log of Range headers."""
    total = 0
    for r in backend.proxy.requests:
        if r.method == "GET" and r.range and r.path.endswith(".safetensors"):
            a, b = map(int, re.fullmatch(r"bytes=(\d+)-(\d+)", r.range).groups())
            total += b - a + 1
    return total


@pytest.mark.parametrize("backend", ["local", "s3"], indirect=True)
def test_four_ranks_overlapping_selections_read_each_byte_once(backend, sample, daemon):
    uri = _upload(backend, sample)
    catalog = _catalog(sample)
    names = [t.name for t in catalog.tensors]
    selections = [rank_selection(names, r, WORLD) for r in range(WORLD)]
    unique = sum(catalog[n].nbytes for n in set().union(*map(set, selections)))
    requested = sum(catalog[n].nbytes for s in selections for n in s)
    assert requested > 2 * unique  # the selections really overlap

    d = daemon(backend.env, "--shm-budget", "8MiB")
    if backend.proxy is not None:
        backend.proxy.reset()
    with ShmSampler(d.shm_dir) as shm:
        ranks = [d.start_rank(uri, r, WORLD, sample, selections[r]) for r in range(WORLD)]
        results = [finish(p) for p in ranks]
    for r, result in enumerate(results):
        assert result["bad"] == []
        assert result["got"] == [n for n in names if n in set(selections[r])]  # checkpoint order

    stats = d.stats()
    assert stats["bytes_read"] == unique
    scheme = "file" if backend.proxy is None else "s3"
    metrics = _scrape(d)
    assert metrics[("streamer_storage_read_bytes_total", (("scheme", scheme),))] == unique
    # The dashboard's "storage bytes / unique bytes": 1.0, each needed byte read once for the node.
    assert metrics[("streamer_load_unique_bytes_total", (("scheme", scheme),))] == unique
    assert metrics[("streamer_load_duration_seconds_count", (("scheme", scheme),))] == 1
    assert metrics[("streamer_time_to_first_tensor_seconds_count", (("scheme", scheme),))] == 1
    first = metrics[("streamer_time_to_first_tensor_seconds_sum", (("scheme", scheme),))]
    assert 0 < first <= metrics[("streamer_load_duration_seconds_sum", (("scheme", scheme),))]
    for r in range(WORLD):
        want = sum(catalog[n].nbytes for n in selections[r])
        assert metrics[("streamer_rank_delivered_bytes_total", (("rank", str(r)),))] == want
    assert metrics[("streamer_sessions_total", (("outcome", "done"),))] == 1
    assert metrics[("streamer_shm_in_use_bytes", ())] == 0
    if backend.proxy is not None:
        served = _range_bytes(backend)
        assert unique <= served <= unique * 1.001, (served, unique)
    assert stats["shm_in_use"] == 0
    assert shm.modes <= {0o600}
    assert list(d.shm_dir.iterdir()) == []
    assert stat.S_IMODE(d.socket.stat().st_mode) == 0o600


def test_budget_four_times_smaller_than_the_union(sample, daemon):
    catalog = _catalog(sample)
    names = [t.name for t in catalog.tensors]
    selections = [rank_selection(names, r, 2) for r in range(2)]
    unique = sum(catalog[n].nbytes for n in set().union(*map(set, selections)))
    budget = unique // 4
    largest = max(t.nbytes for t in catalog.tensors)
    d = daemon({"STREAMER_SLOT_SIZE": str(budget // 4)}, "--shm-budget", str(budget))
    with ShmSampler(d.shm_dir) as shm:
        results = [finish(p) for p in [d.start_rank(str(sample), r, 2, sample, selections[r]) for r in range(2)]]
    assert all(r["bad"] == [] and len(r["got"]) == len(selections[r["rank"]]) for r in results)
    stats = d.stats()
    # One oversized tensor's segment may exceed the budget: the tensor plus its page-alignment pad.
    bound = budget + largest + mmap.PAGESIZE
    assert 0 < stats["shm_peak"] <= bound
    assert 0 < shm.peak <= bound
    assert list(d.shm_dir.iterdir()) == []


def test_a_daemon_that_served_a_load_holds_no_torch(sample, daemon):
    # Run:ai's wrapper is imported without its package's __init__, which imports torch (about
    # 240 MiB of RSS and 2.3 s on a 2-core VM) and boto3; the daemon needs neither.
    d = daemon()
    names = [t.name for t in _catalog(sample).tensors]
    result = finish(d.start_rank(str(sample), 0, 1, sample, names))
    assert result["bad"] == [] and len(result["got"]) == len(names)
    maps = Path(f"/proc/{d.proc.pid}/maps").read_text()
    assert "libstreamer" in maps  # Run:ai's library did the reading
    assert "libtorch" not in maps


@pytest.mark.parametrize(
    ("allow", "prepared"),
    [(["s3://models-bucket/llama"], "s3"), ([], "az, gs, s3"), (["LOCAL"], "none (local dirs only)")],
    ids=["s3-allowed", "any-uri", "local-only"],
)
def test_a_daemon_prepares_the_storage_sdks_of_what_it_may_read_at_start_and_sends_nothing(tmp_path, daemon, allow, prepared):
    # A fresh daemon's first load would otherwise import the SDK and build its first client (the
    # catalog's, the version checks') while its loading thread waits for the GIL.
    with socket.socket() as endpoint:
        endpoint.bind(("127.0.0.1", 0))
        endpoint.listen()
        endpoint.setblocking(False)
        url = f"http://127.0.0.1:{endpoint.getsockname()[1]}"
        flags = [f"--allow={str(tmp_path) if prefix == 'LOCAL' else prefix}" for prefix in allow]
        d = daemon({"AWS_ENDPOINT_URL": url, "STORAGE_EMULATOR_HOST": url, "STREAMER_LOG_LEVEL": "INFO"}, *flags)
        line = _prepared_line(d)
        assert (line.group(1), line.group(2)) == (prepared, "")
        with pytest.raises(BlockingIOError):
            endpoint.accept()  # no connection: placeholder credentials, no request
    assert d.healthy()


def test_a_storage_sdk_that_cannot_be_imported_leaves_the_others_prepared_and_is_named(tmp_path, daemon):
    shadow = tmp_path / "shadow" / "azure"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text('raise ImportError("no Azure SDK in this image")\n')
    path = os.pathsep.join(filter(None, [str(shadow.parent), os.environ.get("PYTHONPATH")]))
    d = daemon({"PYTHONPATH": path, "STREAMER_LOG_LEVEL": "INFO"})
    line = _prepared_line(d)
    assert (line.group(1), line.group(2)) == ("gs, s3", "; not az: ImportError: no Azure SDK in this image")
    assert d.healthy()


def _prepared_line(d: DaemonProcess) -> re.Match:
    pattern = re.compile(r"storage backends prepared at start \([0-9.]+ s\): (.*?)((?:; not .*)?)$", re.MULTILINE)
    return wait_until(lambda: pattern.search(d.log.read_text()), what="the daemon's line of what it prepared")


def test_rank_killed_mid_load_others_finish_and_shm_is_reclaimed(sample, daemon):
    # The daemon knows the rank's PID from the unix socket and sees its process gone,
    # so the others go on at once; with this 600 s rank timeout they would otherwise wait that long.
    catalog = _catalog(sample)
    names = [t.name for t in catalog.tensors]
    selections = [rank_selection(names, r, 3) for r in range(3)]
    d = daemon({"STREAMER_SLOT_SIZE": "1MiB", "STREAMER_RANK_TIMEOUT_S": "600"}, "--shm-budget", "3MiB")
    ranks = [d.start_rank(str(sample), r, 3, sample, selections[r]) for r in range(3)]
    victim = ranks[1]
    assert victim.stderr.readline().startswith("got ")  # it holds leases now
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    for p in (ranks[0], ranks[2]):
        result = finish(p, timeout=120)
        assert result["bad"] == [] and len(result["got"]) == len(selections[result["rank"]])
    deadline = time.monotonic() + 10
    while list(d.shm_dir.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert list(d.shm_dir.iterdir()) == []
    finished = d.finished()[-1]
    assert finished["ranks"]["1"]["status"] == "reclaimed"
    assert "rank 1 its process is gone" in d.log.read_text()
    assert d.healthy()


KILL_SCRIPT = """
import sys, time, streamer_client
from streamer_client.errors import DaemonError
it = streamer_client.stream(sys.argv[1], world_size=1)
next(it)
print("first", flush=True)
sys.stdin.readline()  # holding the first tensor's batch until the daemon is gone
started = time.monotonic()
try:
    for _ in it:
        pass
except DaemonError as exc:
    print("DaemonError", time.monotonic() - started, exc, flush=True)
"""


def test_daemon_killed_mid_load_clients_fail_fast_and_restart_sweeps(sample, daemon):
    # Deterministic: the rank holds its first batch, and so a segment, until the
    # daemon is gone (before, it went on consuming, and a loaded machine let the 2 s rank timeout
    # reclaim it, and its segments, before the test looked); no rank is reclaimed here.
    env = {"STREAMER_SLOT_SIZE": "1MiB", "STREAMER_RANK_TIMEOUT_S": "600"}
    d = daemon(env, "--shm-budget", "2MiB")
    rank = subprocess.Popen(
        [sys.executable, "-c", KILL_SCRIPT, str(sample)], env=d.rank_env(),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert rank.stdout.readline().strip() == "first", rank.stderr.read()
    leftovers = list(d.shm_dir.iterdir())
    assert leftovers  # the ring is mapped while the rank holds a batch
    d.stop(signal.SIGKILL)
    rank.stdin.write("go\n")
    rank.stdin.flush()
    out, err = rank.communicate(timeout=60)
    line = [text for text in out.splitlines() if text.startswith("DaemonError")]
    assert line, out + err
    # At once: the socket resets (not after a read timeout, let alone a rank timeout).
    assert float(line[0].split()[1]) < 5.0
    assert "unreachable or gone" in line[0]
    # SIGKILL left the segments; a new daemon sweeps them at start.
    assert sorted(d.shm_dir.iterdir()) == sorted(leftovers)
    d2 = daemon(env, "--shm-budget", "2MiB")
    assert list(d2.shm_dir.iterdir()) == []
    # The restarted daemon serves the same load whole, and leaves nothing behind.
    names = [t.name for t in _catalog(sample).tensors]
    result = finish(d2.start_rank(str(sample), 0, 1, sample, names))
    assert result["bad"] == [] and result["got"] == names
    assert list(d2.shm_dir.iterdir()) == [] and d2.healthy()


def test_uri_outside_allow_is_refused_and_daemon_stays_up(sample, tmp_path, daemon):
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    d = daemon({}, "--allow", str(allowed))
    result = subprocess.run(
        [sys.executable, "-c", "import streamer_client,sys; list(streamer_client.stream(sys.argv[1]))", str(sample)],
        env=d.rank_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode != 0
    assert "StorageAccessDeniedError" in result.stderr and "not under any --allow prefix" in result.stderr
    assert str(sample) in result.stderr
    assert d.healthy()


def test_group_access_opens_socket_and_segments_to_the_group(sample, daemon):
    d = daemon({}, "--group-access", "--shm-budget", "8MiB", "--allow", str(sample))
    names = [t.name for t in _catalog(sample).tensors]
    with ShmSampler(d.shm_dir) as shm:
        assert finish(d.start_rank(str(sample), 0, 1, sample, names))["bad"] == []
    assert shm.modes == {0o640}
    assert stat.S_IMODE(d.socket.stat().st_mode) == 0o660


def _join(c: httpx.Client, uri: str, **kw) -> httpx.Response:
    body = {"uri": uri, "session": "s", "rank": 0, "world_size": 1, **kw}
    return c.post("/v1/sessions/join", json=body, timeout=60)


def test_api_bad_input_is_a_clear_error(sample, daemon):
    d = daemon({"STREAMER_JOIN_TIMEOUT_S": "1"})
    with d.client() as c:
        r = c.post("/v1/sessions/join", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 422 and r.json()["error"]["type"] == "ConfigError"
        r = c.post("/v1/sessions/join", json={"uri": str(sample), "session": "s", "rank": "zero", "world_size": 1})
        assert r.status_code == 422 and "rank" in r.json()["error"]["message"]
        r = _join(c, str(sample), select=["no.such.tensor"])
        assert r.status_code == 400 and r.json()["error"]["type"] == "SelectionError"
        assert "'no.such.tensor'" in r.json()["error"]["message"]
        r = _join(c, "hdfs://x/y")
        assert r.status_code == 400 and r.json()["error"]["type"] == "InvalidURIError"
        r = c.post("/v1/sessions/nope/ranks/0/next", json={})
        assert r.status_code == 409 and r.json()["error"]["type"] == "SessionError"
        # Two ranks of world_size 2; only one joins: the join times out with the missing rank named.
        r = _join(c, str(sample), session="lonely", world_size=2)
        assert r.status_code == 409 and "only 1 of 2 ranks joined" in r.json()["error"]["message"]
        assert "missing ranks [1]" in r.json()["error"]["message"]
        r = c.post("/v1/sessions/join", json={"uri": "x" * 5000, "session": "s", "rank": 0, "world_size": 1})
        assert r.status_code == 422
        assert c.get("/healthz").json() == {"status": "ok"}
        assert _scrape(d)[("streamer_errors_total", (("type", "SelectionError"),))] == 1
        paths = set(c.get("/openapi.json").json()["paths"])
        assert {"/healthz", "/readyz", "/v1/stats", "/v1/metadata", "/v1/sessions/join"} <= paths
        assert {"/v1/sessions/{session_id}/ranks/{rank}/next", "/v1/sessions/{session_id}/ranks/{rank}/leave"} <= paths
    for args, word in ((["health"], "ok"), (["health", "--ready"], "ready")):
        probe = subprocess.run(
            [sys.executable, "-m", "streamer_service", *args, "--socket", str(d.socket)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert (probe.returncode, probe.stdout.strip(), probe.stderr) == (0, word, "")
    assert list(d.shm_dir.iterdir()) == []


def test_pull_metadata_through_the_daemon(sample, daemon, tmp_path):
    d = daemon()
    code = "import streamer_client,sys; print(streamer_client.pull_metadata(sys.argv[1]))"
    result = subprocess.run(
        [sys.executable, "-c", code, str(sample)], env=d.rank_env(), capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    path = Path(result.stdout.strip())
    assert (path / "config.json").is_file() and (path / ".runai_complete").is_file()
    assert "pulled 2 metadata files" in d.log.read_text()  # the daemon pulled it, not the rank
    again = subprocess.run(
        [sys.executable, "-c", code, str(sample)], env=d.rank_env(), capture_output=True, text=True, timeout=60
    )
    assert again.returncode == 0 and Path(again.stdout.strip()) == path
    # The socket as an argument, as stream() takes it; require_daemon: no in-process fallback.
    env = {k: v for k, v in d.rank_env().items() if k != "STREAMER_SOCKET"}
    by_argument = (
        "import streamer_client,sys; print(streamer_client.pull_metadata(sys.argv[1], socket=sys.argv[2], require_daemon=True))"
    )
    third = subprocess.run(
        [sys.executable, "-c", by_argument, str(sample), str(d.socket)], env=env, capture_output=True, text=True, timeout=60
    )
    assert third.returncode == 0 and Path(third.stdout.strip()) == path, third.stderr
    metrics = _scrape(d)
    assert metrics[("streamer_metadata_pulls_total", (("result", "miss"),))] == 1
    assert metrics[("streamer_metadata_pulls_total", (("result", "hit"),))] == 2


def test_tcp_listener_is_loopback_and_needs_the_token(sample, daemon):
    import socket as socket_mod

    with socket_mod.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = daemon({"STREAMER_TOKEN": "s3cr3t-t0ken"}, "--tcp-port", str(port), "--allow", str(sample))
    base = f"http://127.0.0.1:{port}"
    assert httpx.get(f"{base}/healthz").status_code == 401
    assert httpx.get(f"{base}/healthz", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(f"{base}/healthz", headers={"Authorization": "Bearer s3cr3t-t0ken"}).json() == {"status": "ok"}
    # A rank on this node can use it too, with the token from its environment.
    code = "import streamer_client,sys; print(len(streamer_client.load_state_dict(sys.argv[1])))"
    env = {**d.rank_env(), "STREAMER_SOCKET": f"tcp://127.0.0.1:{port}", "STREAMER_TOKEN": "s3cr3t-t0ken"}
    result = subprocess.run([sys.executable, "-c", code, str(sample)], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert int(result.stdout.strip()) == len(_catalog(sample).tensors)
    assert d.finished()[-1]["state"] == "done"  # it went through the daemon
    assert "s3cr3t-t0ken" not in d.log.read_text()


def test_tcp_without_a_token_refuses_to_start(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "streamer_service", "serve", "--socket", str(tmp_path / "s.sock"), "--shm-dir", str(tmp_path), "--tcp-port", "1"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2  # a start-up refusal, before anything is bound
    assert result.stderr == "streamer-service serve: error: --tcp-port needs a bearer token in STREAMER_TOKEN\n"
    assert not (tmp_path / "s.sock").exists()


def test_segments_are_reused_across_sessions_then_trimmed(sample, daemon):
    # The second rank process is started (torch imported) before the first load ends and waits
    # for "go": on a loaded machine its start-up alone outlasted the idle time.
    # No standing ring (tests/test_first_load.py has it): every idle segment goes once idle.
    d = daemon(
        {"STREAMER_SEGMENT_IDLE_S": "10", "STREAMER_SLOT_SIZE": "4MiB", "STREAMER_SEGMENT_PREPARE": "false"},
        "--shm-budget", "16MiB",
    )  # fmt: skip
    names = [t.name for t in _catalog(sample).tensors]
    waiting = d.start_rank(str(sample), 0, 1, sample, names, RANK_AWAIT_GO="1", STREAMER_LAUNCH_ID="second")
    assert waiting.stderr.readline().strip() == "ready"
    first = finish(d.start_rank(str(sample), 0, 1, sample, names, STREAMER_LAUNCH_ID="first"))
    d.finished()
    kept = sorted(p.name for p in segment_files(d.shm_dir))
    assert first["bad"] == [] and kept  # idle segments stay mapped for the next load
    stats = d.stats()
    assert stats["segments_idle"] == len(kept) and stats["shm_in_use"] == len(kept) * 4 * 2**20
    waiting.stdin.write("go\n")
    waiting.stdin.flush()
    second = finish(waiting)
    assert second["bad"] == []
    assert d.stats()["segments_reused"] >= len(kept)
    assert set(kept) <= {p.name for p in segment_files(d.shm_dir)}  # the same files served the second load
    deadline = time.monotonic() + 30
    while list(d.shm_dir.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert list(d.shm_dir.iterdir()) == []  # trimmed once idle for STREAMER_SEGMENT_IDLE_S
    assert d.stats()["shm_in_use"] == 0


KEEP_BORROWED = """
import sys, streamer_client
from streamer_client.errors import BorrowedTensorError
kept = []
try:
    for name, t in streamer_client.stream(sys.argv[1], borrowed=True):
        kept.append(t)  # against the rule: a borrowed view lives until the next item only
except BorrowedTensorError as exc:
    print("refused:", exc)
"""


def test_keeping_borrowed_daemon_tensors_is_refused_not_overwritten(sample, daemon):
    d = daemon({"STREAMER_SLOT_SIZE": "2MiB"}, "--shm-budget", "8MiB")
    result = subprocess.run(
        [sys.executable, "-c", KEEP_BORROWED, str(sample)], env=d.rank_env(), capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "refused:" in result.stdout and "borrowed=True tensor is valid only until the next item" in result.stdout
    deadline = time.monotonic() + 1.5  # well inside the 2 s rank timeout these daemons use
    while not d.stats()["finished"] and time.monotonic() < deadline:
        time.sleep(0.02)
    session = d.stats()["finished"][-1]
    assert session["ranks"]["0"]["status"] == "left"  # it left at once, not reclaimed after a timeout
    assert d.healthy()


@pytest.mark.parametrize("backend", ["local", "s3"], indirect=True)
def test_force_pull_means_the_same_through_the_daemon(backend, sample, daemon, monkeypatch):
    """pull_metadata must send ``force`` to the daemon: with TRTLLM_OBJECT_STORAGE_FORCE_PULL=1 it must not
    return the stale config while stream() forces a new generation of the weights."""
    import json

    import streamer_client

    uri = _upload(backend, sample)
    d = daemon(backend.env)
    monkeypatch.setenv("STREAMER_SOCKET", str(d.socket))
    old = streamer_client.pull_metadata(uri, launch_id="launch-1")
    config = json.loads((old / "config.json").read_text())
    backend.put("ckpt/config.json", json.dumps({**config, "changed": True}).encode())
    monkeypatch.setenv("TRTLLM_OBJECT_STORAGE_FORCE_PULL", "1")
    monkeypatch.setenv("STREAMER_LAUNCH_ID", "launch-2")
    pulled = streamer_client.pull_metadata(uri)
    assert json.loads((pulled / "config.json").read_text())["changed"] is True
    marker = json.loads((pulled / ".runai_complete").read_text())
    assert marker["launch_id"] == "launch-2"
    # stream() of the same launch uses that very pull: config and weights of one generation.
    state = streamer_client.load_state_dict(uri)
    assert len(state) == len(_catalog(sample))
    assert json.loads((pulled / ".runai_complete").read_text())["pulled_at"] == marker["pulled_at"]
    assert d.finished()[-1]["state"] == "done"


@pytest.mark.parametrize("backend", ["s3"], indirect=True)
def test_a_daemon_reads_its_next_load_through_the_reader_of_its_last(backend, sample, daemon):
    """The daemon keeps the Run:ai reader of a load for its next one (``readers.kept``)."""
    uri = _upload(backend, sample)
    tensor_bytes = sum(p.stat().st_size for p in sample.glob("*.safetensors"))
    d = daemon({**backend.env, "STREAMER_SEGMENT_IDLE_S": "60"})
    served = []
    for _ in range(2):
        backend.proxy.reset()
        result = finish(d.start_rank(uri, 0, 1, sample, None))
        assert result["bad"] == [] and result["got"]
        served.append(_range_bytes(backend))
    lines = [line for line in d.log.read_text().splitlines() if " bytes read from storage" in line]
    assert len(lines) == 2
    assert "read through a reader kept from an earlier load" not in lines[0]
    assert "read through a reader kept from an earlier load" in lines[1]
    # Each load read every tensor byte once (and the headers), the second as the first.
    assert all(tensor_bytes * 0.9 < s <= tensor_bytes * 1.001 for s in served), (served, tensor_bytes)
