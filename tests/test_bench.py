"""`streamer-service bench`: the quick mode end to end (real rank processes, a real daemon, a real
SeaweedFS), and the scenarios' selections. Speed is never asserted here: the bench prints it."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from streamer_service.bench.scenarios import Scenario, selections
from streamer_service.header import TensorInfo
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
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "bench: OK, every run's bytes matched safetensors" in result.stdout
    assert "| source | scenario | N | contender |" in result.stdout

    report = json.loads(out.read_text())
    assert set(report) >= {"machine", "config", "summary", "ratios", "runs", "ok", "loadavg_before", "loadavg_after"}
    assert report["ok"] is True
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
