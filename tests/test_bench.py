"""`streamer-service bench`: the quick mode end to end (real rank processes, a real daemon, a real
SeaweedFS), and the scenarios' selections. Speed is never asserted here: the bench prints it."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from streamer_service.bench.report import RatioRow, missed_targets
from streamer_service.bench.scenarios import Scenario, selections
from streamer_service.bench.sources import free_ports
from streamer_service.checkpoint.header import TensorInfo
from streamer_service.sample import rank_selection

CLI = [sys.executable, "-m", "streamer_service", "bench"]


def _tensors(sizes: list[int]) -> list[TensorInfo]:
    out, offset = [], 0
    for i, size in enumerate(sizes):
        name = f"model.layers.{i}.mlp.experts.{i % 4}.w" if i % 2 else f"model.layers.{i}.norm.weight"
        out.append(TensorInfo(name, "BF16", (size // 2,), "model.safetensors", offset, size))
        offset += size
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_disjoint_blocks_cover_the_checkpoint_once_in_order(world):
    tensors = _tensors([100, 5000, 20, 20, 3000, 7000, 10, 400, 900])
    blocks = selections(Scenario.DISJOINT, tensors, world)
    assert len(blocks) == world and all(blocks)
    assert [n for block in blocks for n in block] == [t.name for t in tensors]  # contiguous, in order, each once


def test_disjoint_refuses_more_ranks_than_tensors():
    with pytest.raises(ValueError, match="2 tensors needs at most that many ranks, not 3"):
        selections(Scenario.DISJOINT, _tensors([10, 10]), 3)


def test_replicated_and_tp_selections():
    tensors = _tensors([10] * 8)
    names = [t.name for t in tensors]
    assert selections(Scenario.REPLICATED, tensors, 3) == [names] * 3
    assert selections(Scenario.TP, tensors, 2) == [rank_selection(names, r, 2) for r in range(2)]


def test_a_row_that_misses_its_own_target_is_named():
    rows = [
        RatioRow("local", "disjoint", 2, time_b_over_a=2.24, time_target=1.05, bytes_b_over_a=1.0, bytes_target=None),
        RatioRow("seaweed", "disjoint", 2, time_b_over_a=0.92, time_target=1.05, bytes_b_over_a=1.0, bytes_target=None),
        RatioRow("seaweed", "replicated", 2, time_b_over_a=0.5, time_target=None, bytes_b_over_a=0.52, bytes_target=0.5),
        RatioRow("seaweed", "replicated", 4, time_b_over_a=None, time_target=0.3, bytes_b_over_a=0.251, bytes_target=0.25),
        RatioRow("local", "tp", 2, time_b_over_a=2.17, time_target=None, bytes_b_over_a=0.835, bytes_target=None),
    ]
    assert missed_targets(rows) == [
        "local disjoint N=2: time B÷A 2.24, target ≤ 1.05",
        "seaweed replicated N=2: bytes B÷A 0.520, target = 0.500",
        "seaweed replicated N=4: time B÷A -, target ≤ 0.30",
    ]


def test_seaweed_ports_never_take_another_components_grpc_port():
    # Each weed component listens on its port and on port + 10000; weed refuses to start when one
    # component's port is another's gRPC port, so the bench's picks must never overlap that way.
    for _ in range(50):
        ports = free_ports(6, partner=10000)
        every = [*ports, *(p + 10000 for p in ports)]
        assert len(set(every)) == len(every) == 12


def test_unknown_source_is_a_usage_error(tmp_path):
    result = subprocess.run([*CLI, "--source", "nowhere", "--work-dir", str(tmp_path)], capture_output=True, text=True,
                            timeout=120)  # fmt: skip
    assert result.returncode == 2
    assert "unknown source 'nowhere'; choose from local, moto, seaweed" in result.stderr


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/status").read_text().find("State:\tZ") < 0


def _run_bench(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    """The bench in a process group of its own: one that runs out of time is killed with the
    servers, daemons and ranks it started (killing the bench alone left them running)."""
    proc = subprocess.Popen([*CLI, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)  # the bench and the daemons clean up on SIGTERM
        try:
            stdout, stderr = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
        pytest.fail(f"the bench ran past {timeout:g} s:\n{stdout[-3000:]}{stderr[-3000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


@pytest.mark.timeout(660)
def test_quick_mode_completes_byte_exact_and_reads_less_through_the_daemon(tmp_path):
    out = tmp_path / "bench.json"
    result = _run_bench(["--quick", "--json", str(out), "--work-dir", str(tmp_path / "work")], timeout=600)
    assert "| source | scenario | N | contender |" in result.stdout

    report = json.loads(out.read_text())
    assert set(report) >= {
        "machine",
        "config",
        "summary",
        "ratios",
        "runs",
        "ok",
        "verified",
        "missed_targets",
        "loadavg_before",
        "loadavg_after",
    }
    assert report["verified"] is True, result.stdout[-3000:] + result.stderr[-3000:]
    # The verdict is the targets' (speed on this loaded machine is whatever it is): exit 1 naming
    # each row that missed its own target, exit 0 and OK only when none did.
    assert report["missed_targets"] == missed_targets([RatioRow(**r) for r in report["ratios"]])
    verdicts = [line for line in result.stdout.splitlines() if line.startswith("bench: ")]
    if report["missed_targets"]:
        assert result.returncode == 1 and report["ok"] is False
        assert verdicts == [f"bench: FAILED: missed its target: {m}" for m in report["missed_targets"]]
    else:
        assert result.returncode == 0 and report["ok"] is True, result.stderr[-3000:]
        assert verdicts == ["bench: OK, every run's bytes matched safetensors and every row met its targets"]
    assert report["config"]["runai_env"]["RUNAI_STREAMER_FS_STRATEGY"] == "sync_buffered"
    runs = report["runs"]
    # local + seaweed, 3 scenarios, N=2, A-D, one repetition each.
    assert {(r["source"], r["scenario"], r["mode"]) for r in runs} == {
        (s, sc, m) for s in ("local", "seaweed") for sc in ("replicated", "tp", "disjoint") for m in "ABCD"
    }
    assert all(r["verified"] and r["check"] == "full" and not r["errors"] for r in runs)
    assert all(r["wall_s"] > 0 and r["delivered_bytes"] > 0 for r in runs)

    # Bytes counted at the storage side: the daemon reads a replicated selection once, the ranks of A twice.
    by = {(r["source"], r["scenario"], r["mode"]): r for r in runs}
    for source in ("local", "seaweed"):
        a, b = by[(source, "replicated", "A")], by[(source, "replicated", "B")]
        assert b["delivered_bytes"] == a["delivered_bytes"] == 2 * a["unique_bytes"]
        assert b["storage_bytes"] < a["storage_bytes"], (source, a, b)
    sa, sb = by[("seaweed", "replicated", "A")]["storage_bytes"], by[("seaweed", "replicated", "B")]["storage_bytes"]
    assert sb <= 0.55 * sa  # SeaweedFS's own counter of body bytes: exact, headers only on top
    assert by[("seaweed", "replicated", "D")]["storage_bytes"] >= by[("seaweed", "replicated", "D")]["unique_bytes"]
    ratio = {(r["source"], r["scenario"]): r for r in report["ratios"]}
    assert ratio[("seaweed", "replicated")]["bytes_b_over_a"] == pytest.approx(sb / sa)

    # Nothing the bench started outlives it: servers, daemons, shared memory.
    started = report["started"]
    assert len(started["server_pids"]) == 1 and len(started["daemon_pids"]) == 2
    assert not any(_alive(pid) for pid in started["server_pids"] + started["daemon_pids"])
    assert not any(Path(d).exists() for d in started["daemon_shm_dirs"])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--source", "local", "--latency-ms", "30"], "--latency-ms needs object-storage sources (moto, seaweed), not 'local'"),
        (["--source", "gcs", "--modes", "A,D"], "contender D downloads with boto3: not from the 'gcs' or 'azure' source"),
        (["--source", "azure", "--modes", "A,D"], "contender D downloads with boto3: not from the 'gcs' or 'azure' source"),
        (["--source", "seaweed", "--latency-ms", "-1"], "--latency-ms >= 0"),
    ],
)
def test_latency_and_gcs_usage_errors(tmp_path, args, message):
    result = subprocess.run([*CLI, *args, "--work-dir", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert message in result.stderr


@pytest.mark.timeout(660)
def test_gcs_behind_the_latency_proxy_counts_bytes_and_requests(tmp_path):
    """fake-gcs-server with every request held 30 ms: each run's bytes are checked, the proxy
    counts what storage sent (the daemon reads a replicated selection once, plain Run:ai once per
    rank) and the requests it held; Run:ai runs with its own concurrency; the report names the CPUs."""
    out = tmp_path / "bench.json"
    result = _run_bench(["--source", "gcs", "--size", "8MB", "--ranks", "2", "--scenarios", "replicated", "--modes", "A,B",
                         "--reps", "1", "--warmup", "0", "--full-check", "--latency-ms", "30", "--json", str(out),
                         "--work-dir", str(tmp_path / "work")], timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"{os.cpu_count()} CPUs; checkpoint " in result.stdout
    assert "every storage request held 30 ms (latency proxy)" in result.stdout
    report = json.loads(out.read_text())
    assert report["ok"] is True and report["config"]["latency_ms"] == 30
    assert "RUNAI_STREAMER_CONCURRENCY" not in report["config"]["runai_env"]
    by = {r["mode"]: r for r in report["runs"]}
    assert all(r["verified"] and r["check"] == "full" for r in by.values())
    unique = by["A"]["unique_bytes"]
    assert unique <= by["B"]["storage_bytes"] < 1.2 * unique  # once, plus response headers
    assert 2 * unique <= by["A"]["storage_bytes"] < 2.4 * unique
    assert by["A"]["requests"] > 0 and by["B"]["requests"] > 0
    assert not any(_alive(pid) for pid in report["started"]["server_pids"] + report["started"]["daemon_pids"])


def test_the_azure_source_outside_its_namespace_says_how_to_run_it(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "STREAMER_BENCH_AZURITE_PORT"}
    result = subprocess.run([*CLI, "--source", "azure", "--size", "1MB", "--ranks", "1", "--modes", "A", "--reps", "1",
                             "--warmup", "0", "--work-dir", str(tmp_path)], capture_output=True, text=True, timeout=300, env=env)  # fmt: skip
    assert result.returncode != 0
    assert "run it through benchmarks/azure_bench.py" in result.stdout + result.stderr


@pytest.mark.timeout(660)
def test_azurite_over_https_behind_the_latency_proxy_is_read_exactly(tmp_path):
    """benchmarks/azure_bench.py: Azurite over HTTPS trusted inside a private mount namespace,
    every request held 30 ms; each run's bytes are checked and the proxy counts what storage sent."""
    from tests.harness.azure_tls import skip_reason

    if (reason := skip_reason()) is not None:
        pytest.skip(reason)
    out = tmp_path / "bench.json"
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "azure_bench.py"
    args = ["--size", "8MB", "--ranks", "2", "--scenarios", "replicated", "--modes", "A,B", "--reps", "1", "--warmup", "0",
            "--full-check", "--latency-ms", "30", "--json", str(out), "--work-dir", str(tmp_path / "work")]  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, str(script), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=60)
        pytest.fail(f"the bench ran past 600 s:\n{stdout[-3000:]}{stderr[-3000:]}")
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["ok"] is True and report["config"]["sources"]["azure"].startswith("Azurite over HTTPS")
    by = {r["mode"]: r for r in report["runs"]}
    assert all(r["verified"] and r["check"] == "full" for r in by.values())
    unique = by["A"]["unique_bytes"]
    assert unique <= by["B"]["storage_bytes"] < 1.2 * unique  # once, plus TLS records and headers
    assert 2 * unique <= by["A"]["storage_bytes"] < 2.4 * unique


def test_a_storage_server_that_exits_before_the_upload_is_named_with_its_log(tmp_path):
    """A server that listens, then dies (a port of one of its components taken, say): the bench
    says it exited, with its code and its log, not only that nothing answers on the endpoint."""
    from streamer_service.bench.sources import HOST, _S3Source, free_port

    class ExitingServer(_S3Source):
        name = "exiting"

        def _start(self) -> None:
            port = free_port()
            self.log = self.work / "exiting.log"
            script = (
                "import socket, sys\n"
                f"s = socket.create_server(({HOST!r}, {port}))\n"
                "s.accept()\n"  # the bench saw it listening
                "print('fatal: the filer port is taken', flush=True)\n"
                "sys.exit(3)\n"
            )
            self._spawn([sys.executable, "-c", script])
            self.endpoint = f"http://{HOST}:{port}"
            self._wait_listening(port)

    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    with pytest.raises(RuntimeError) as raised:
        ExitingServer(tmp_path, checkpoint)
    assert str(raised.value).startswith("exiting exited with code 3:\n")
    assert "fatal: the filer port is taken" in str(raised.value)
