"""`streamer-service bench`: the quick mode end to end (real rank processes, a real daemon, a real
SeaweedFS), its verdict, and the scenarios' selections. Speed is never asserted here: the bench
prints it, and its exit status says only whether the run was correct (unless --check-targets)."""

import dataclasses
import json
import os
import signal
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from streamer_service.bench.report import (
    TIME_TARGETS,
    RatioRow,
    missed_byte_ratios,
    missed_time_targets,
    verdict,
)
from streamer_service.bench.runner import RunResult
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
        # moto counts no bytes: nothing to miss.
        RatioRow("moto", "replicated", 2, time_b_over_a=0.7, time_target=None, bytes_b_over_a=None, bytes_target=0.5),
    ]
    assert missed_time_targets(rows) == [
        "local disjoint N=2: time B÷A 2.24, target ≤ 1.05",
        "seaweed replicated N=4: time B÷A -, target ≤ 0.30",
    ]
    assert missed_time_targets(rows, "reference")[0] == "local disjoint N=2: time B÷A 2.24, reference ≤ 1.05"
    assert missed_byte_ratios(rows) == ["seaweed replicated N=2: bytes B÷A 0.520, target = 0.500"]


def test_time_targets_hold_only_for_their_machine_class_and_checkpoint_size():
    assert (TIME_TARGETS.machine, TIME_TARGETS.cpus, TIME_TARGETS.checkpoint) == ("16-core GPU host", 16, "2 GiB")
    assert TIME_TARGETS.hold_for(16, 2 * 2**30) and TIME_TARGETS.hold_for(128, 4 * 2**30)
    assert not TIME_TARGETS.hold_for(2, 4 * 2**30)  # a small machine
    assert not TIME_TARGETS.hold_for(16, 32 * 10**6)  # a small checkpoint (--quick)
    assert not TIME_TARGETS.hold_for(None, 4 * 2**30)  # cores unknown
    assert TIME_TARGETS.for_row("disjoint", 3) == 1.05 and TIME_TARGETS.for_row("tp", 2) is None


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


@pytest.fixture(scope="module")
def quick_twice(tmp_path_factory) -> list[tuple[subprocess.CompletedProcess, dict]]:
    """`bench --quick` twice in a row, as a user runs it, each in a fresh work dir: its output
    and its JSON report."""
    runs = []
    for i in range(2):
        tmp = tmp_path_factory.mktemp(f"quick-{i}")
        out = tmp / "bench.json"
        result = _run_bench(["--quick", "--json", str(out), "--work-dir", str(tmp / "work")], timeout=600)
        assert out.exists(), result.stdout[-3000:] + result.stderr[-3000:]
        runs.append((result, json.loads(out.read_text())))
    return runs


# The tests of the two quick runs share one worker (scripts/test: --dist loadgroup), which runs
# them first; the runs count against the time limit of whichever of them runs first.
QUICK_RUNS = pytest.mark.xdist_group("bench-quick")


def _verdict_lines(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in result.stdout.splitlines() if line.startswith("bench: ")]


@pytest.mark.timeout(1260)
@QUICK_RUNS
def test_quick_mode_twice_in_a_row_exits_0_with_its_time_targets_as_references(quick_twice):
    """On this machine (2 cores, a 32 MB checkpoint) the time ratios cross their targets with
    noise: the bench shows them as references, and its exit status says the runs were correct."""
    for result, report in quick_twice:
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        assert report["ok"] is True and report["correct"] is True and report["missed_byte_ratios"] == []
        assert report["time_targets"] == {"set_for": "16-core GPU host, 2 GiB", "hold": False, "shown_as": "reference"}
        assert "| source | scenario | N | time B÷A | reference (16-core GPU host, 2 GiB) | bytes B÷A | target |" in result.stdout
        lines = _verdict_lines(result)
        assert lines[-1] == "bench: OK, every run's bytes matched safetensors, every storage-byte ratio was exact"
        missed = report["missed_time_targets"]
        assert missed == missed_time_targets([RatioRow(**r) for r in report["ratios"]], "reference")
        if missed:  # one closing line, naming the runs the targets are set for, and this one
            cpus, gb = report["machine"]["cpus"], report["config"]["checkpoint_bytes"] / 1e9
            assert lines[:-1] == [
                "bench: time B÷A over its reference, set for a 16-core GPU host and a 2 GiB checkpoint "
                f"(a reference, not a verdict; this run: {cpus} CPUs, {gb:.2f} GB): " + "; ".join(missed)
            ]
        else:
            assert lines[:-1] == []
        assert "FAILED" not in result.stdout


@pytest.mark.timeout(1260)
@QUICK_RUNS
def test_quick_mode_completes_byte_exact_and_reads_less_through_the_daemon(quick_twice):
    result, report = quick_twice[0]
    assert "| source | scenario | N | contender |" in result.stdout
    assert set(report) >= {
        "machine",
        "config",
        "summary",
        "ratios",
        "runs",
        "ok",
        "correct",
        "verified",
        "missed_byte_ratios",
        "missed_time_targets",
        "time_targets",
        "loadavg_before",
        "loadavg_after",
    }
    assert report["verified"] is True, result.stdout[-3000:] + result.stderr[-3000:]
    assert report["config"]["check_targets"] is False
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


def _real_rows(report: dict) -> tuple[list[RunResult], list[RatioRow]]:
    return [RunResult(**r) for r in report["runs"]], [RatioRow(**r) for r in report["ratios"]]


@pytest.mark.timeout(1260)
@QUICK_RUNS
def test_check_targets_fails_a_run_whose_time_ratio_is_over_its_target(quick_twice):
    """The verdict over a real quick run's rows: a time ratio over its target fails the run only
    with --check-targets; the same ratio on the targets' own machine class is named as a target."""
    report = quick_twice[0][1]
    runs, rows = _real_rows(report)
    cpus, size = report["machine"]["cpus"], report["config"]["checkpoint_bytes"]
    real = verdict(runs, rows, cpus=cpus, checkpoint_bytes=size, check_targets=True)
    assert real.correct and real.ok is (real.missed_time_targets == [])

    row = next(i for i, r in enumerate(rows) if (r.source, r.scenario, r.ranks) == ("local", "disjoint", 2))
    assert rows[row].time_target == pytest.approx(1.05)
    met = [dataclasses.replace(r, time_b_over_a=r.time_target / 2) if r.time_target else r for r in rows]
    over = [*met[:row], dataclasses.replace(met[row], time_b_over_a=1.85), *met[row + 1 :]]

    checked = verdict(runs, met, cpus=cpus, checkpoint_bytes=size, check_targets=True)
    assert checked.ok and checked.lines() == [
        "bench: OK, every run's bytes matched safetensors, every storage-byte ratio was exact and every time B÷A met its target"
    ]
    checked = verdict(runs, over, cpus=cpus, checkpoint_bytes=size, check_targets=True)
    assert checked.correct and not checked.ok
    assert checked.lines() == [
        "bench: FAILED: time B÷A over its target, set for a 16-core GPU host and a 2 GiB checkpoint "
        f"(--check-targets; this run: {cpus} CPUs, {size / 1e9:.2f} GB): local disjoint N=2: time B÷A 1.85, target ≤ 1.05"
    ]
    unchecked = verdict(runs, over, cpus=cpus, checkpoint_bytes=size)
    assert unchecked.ok and unchecked.time_word == "reference"
    assert unchecked.lines()[0].endswith("(a reference, not a verdict; this run: "
                                         f"{cpus} CPUs, {size / 1e9:.2f} GB): local disjoint N=2: time B÷A 1.85, reference ≤ 1.05")  # fmt: skip
    on_its_machine = verdict(runs, over, cpus=16, checkpoint_bytes=2 * 2**30)
    assert on_its_machine.ok and on_its_machine.time_word == "target"
    assert on_its_machine.lines() == [
        "bench: time B÷A over its target, set for a 16-core GPU host and a 2 GiB checkpoint "
        "(not a verdict without --check-targets): local disjoint N=2: time B÷A 1.85, target ≤ 1.05",
        "bench: OK, every run's bytes matched safetensors, every storage-byte ratio was exact",
    ]
    assert not verdict(runs, over, cpus=16, checkpoint_bytes=2 * 2**30, check_targets=True).ok


@pytest.mark.timeout(1260)
@QUICK_RUNS
def test_a_storage_byte_ratio_off_exact_fails_the_run_without_check_targets(quick_twice):
    """A real quick run's rows with the daemon's replicated bytes as many as plain Run:ai's."""
    report = quick_twice[0][1]
    runs, rows = _real_rows(report)
    at = next(i for i, r in enumerate(rows) if (r.source, r.scenario) == ("seaweed", "replicated"))
    rows[at] = dataclasses.replace(rows[at], bytes_b_over_a=1.0)
    judged = verdict(runs, rows, cpus=report["machine"]["cpus"], checkpoint_bytes=report["config"]["checkpoint_bytes"])
    assert not judged.correct and not judged.ok
    assert (
        judged.lines()[-1]
        == "bench: FAILED: storage bytes off their exact ratio: seaweed replicated N=2: bytes B÷A 1.000, target = 0.500"
    )


def _flip_first_tensor_byte(shard: Path) -> str:
    """Invert the first byte of the shard's first tensor (its data at offset 0); its name."""
    with open(shard, "r+b") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
        name = next(n for n, t in header.items() if n != "__metadata__" and t["data_offsets"][0] == 0)
        f.seek(8 + length)
        byte = f.read(1)[0]
        f.seek(8 + length)
        f.write(bytes([byte ^ 0xFF]))
    return name


@pytest.mark.timeout(660)
def test_bytes_that_do_not_match_the_checkpoint_fail_the_run(tmp_path):
    """A checkpoint kept in --work-dir and changed after the bench took its samples of it: the
    ranks read the changed byte, the bench's check finds it, the run fails (exit 1)."""
    work = tmp_path / "work"
    args = ["--source", "local", "--size", "8MB", "--ranks", "1", "--scenarios", "replicated", "--modes", "A",
            "--reps", "1", "--warmup", "0", "--work-dir", str(work)]  # fmt: skip
    first = _run_bench([*args, "--check-targets", "--json", str(tmp_path / "first.json")], timeout=300)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert _verdict_lines(first)[-1].endswith("every storage-byte ratio was exact and every time B÷A met its target")

    (shard,) = work.glob("checkpoint-*/model-00001-of-00002.safetensors")
    name = _flip_first_tensor_byte(shard)
    second = _run_bench([*args, "--json", str(tmp_path / "second.json")], timeout=300)
    assert second.returncode == 1, second.stdout[-3000:] + second.stderr[-3000:]
    assert _verdict_lines(second) == ["bench: FAILED: runs that failed or bytes that did not match safetensors (see the table)"]
    report = json.loads((tmp_path / "second.json").read_text())
    assert report["ok"] is False and report["correct"] is False and report["verified"] is False
    (run,) = report["runs"]
    assert run["verified"] is False and run["check"] == "sample"
    assert run["errors"] == [f"rank 0: 1 tensors differ or are missing, e.g. ('{name}',)"]
    assert "| local | replicated | 1 | A plain Run:ai per rank |" in second.stdout and "| FAILED (1), sample |" in second.stdout


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
