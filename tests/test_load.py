"""Load: 8 ranks x 3 concurrent sessions for different checkpoints on one daemon, round after round.

Every tensor of every round is compared with safetensors' own reading; after each round the
test samples the daemon's RSS and the shm dir. Memory must stay flat: no shm file outlives its
round, and the RSS after the last round is within a small slack of the RSS after the first
(which paid the imports, the thread pool and the allocator's first growth).

Default: 3 rounds (~1 min). ``pytest -m soak tests/test_load.py``: 20 rounds.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from daemon_harness import DaemonProcess, leftovers

from streamer_service.sample import build_sample, rank_selection

WORLD = 8
CHECKPOINTS = 3
RSS_SLACK = 24 * 1024 * 1024

# One process per rank for all rounds (a process per round would spend the run importing torch).
# After each round it prints its result and waits for a line on stdin: the test's barrier.
LOAD_RANK = textwrap.dedent(
    """
    import json, sys, torch, streamer_client
    from safetensors.torch import load_file
    uri, rank, world, truth_dir, rounds, select = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5]), json.loads(sys.argv[6])
    index = json.load(open(truth_dir + "/model.safetensors.index.json"))["weight_map"]
    truth = {}
    for shard in set(index.values()):
        truth.update(load_file(truth_dir + "/" + shard))
    for r in range(rounds):
        got, bad = [], []
        for name, t in streamer_client.stream(uri, select=select, rank=rank, world_size=world, session=f"load-{uri}-{r}"):
            want = truth[name]
            if not (want.dtype == t.dtype and want.shape == t.shape and torch.equal(want, t)):
                bad.append(name)
            got.append(name)
        print(json.dumps({"round": r, "got": got, "bad": bad}), flush=True)
        sys.stdin.readline()
    """
)


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _run_rounds(tmp_path: Path, rounds: int) -> None:
    samples = []
    for i in range(CHECKPOINTS):
        src = tmp_path / f"ckpt{i}"
        build_sample(src, size_mb=3, seed=i)
        samples.append(src)
    names = [sorted(json.loads((s / "model.safetensors.index.json").read_text())["weight_map"]) for s in samples]
    # Three sessions share a budget smaller than their union: they wait on each other's releases.
    d = DaemonProcess(tmp_path, {"STREAMER_SLOT_SIZE": "256KiB", "STREAMER_RANK_TIMEOUT_S": "30"}, "--shm-budget", "4MiB").start()
    procs = []
    try:
        for i, src in enumerate(samples):
            for r in range(WORLD):
                select = rank_selection(names[i], r, WORLD)
                procs.append(
                    (i, r, select, subprocess.Popen(
                        [sys.executable, "-c", LOAD_RANK, str(src), str(r), str(WORLD), str(src), str(rounds), json.dumps(select)],
                        env=d.rank_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                    ))
                )  # fmt: skip
        rss, shm_files = [], []
        for round_ in range(rounds):
            for i, r, select, p in procs:
                line = p.stdout.readline()
                assert line, f"checkpoint {i} rank {r} died: {p.stderr.read()[-3000:]}"
                result = json.loads(line)
                assert result["round"] == round_ and result["bad"] == []
                assert sorted(result["got"]) == sorted(select)
            rss.append(_rss(d.proc.pid))
            shm_files.append(len(leftovers(d, tmp_path / "cache", timeout=10)[0]))
            for *_, p in procs:
                p.stdin.write("next\n")
                p.stdin.flush()
        for *_, p in procs:
            p.wait(timeout=60)
            assert p.returncode == 0, p.stderr.read()[-3000:]
        print(f"daemon RSS per round (MiB): {[round(x / 2**20, 1) for x in rss]}; shm files: {shm_files}")
        assert shm_files == [0] * rounds
        assert rss[-1] - rss[0] <= RSS_SLACK, [round(x / 2**20, 1) for x in rss]
        finished = d.finished(rounds * CHECKPOINTS)
        assert len(finished) == rounds * CHECKPOINTS and {s["state"] for s in finished} == {"done"}
        assert d.stats()["shm_in_use"] == 0 and d.healthy()
    finally:
        for *_, p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        d.stop()


@pytest.mark.timeout(900)  # 24 rank processes start torch: minutes on a loaded 2-core machine
def test_eight_ranks_three_sessions_three_rounds(tmp_path):
    _run_rounds(tmp_path, rounds=3)


@pytest.mark.soak
@pytest.mark.timeout(3600)
def test_eight_ranks_three_sessions_twenty_rounds(tmp_path):
    _run_rounds(tmp_path, rounds=20)
