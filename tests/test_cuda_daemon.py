"""Daemon mode to CUDA: ranks copy from pinned shared memory; every tensor equals the CPU truth.

Skipped without CUDA. Run on a GPU machine (docs/benchmarks.md has the command).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from daemon_harness import DaemonProcess

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# check(uri, stream, device) -> (tensors seen, names not bit-equal to safetensors' CPU truth)
CHECK = textwrap.dedent(
    """
    import json, torch
    from safetensors import safe_open
    def check(uri, stream, device):
        index = json.load(open(uri + "/model.safetensors.index.json"))["weight_map"]
        files, bad, n = {}, [], 0
        for name, t in stream:
            assert t.device == torch.device(device), t.device
            shard = index[name]
            files.setdefault(shard, safe_open(uri + "/" + shard, "pt"))
            want = files[shard].get_tensor(name)
            if not torch.equal(t.cpu().reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)):
                bad.append(name)
            n += 1
        return n, bad
    """
)

RANK = CHECK + textwrap.dedent(
    """
    import sys, streamer_client
    uri, rank, world = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    device = f"cuda:{rank % torch.cuda.device_count()}"
    n, bad = check(uri, streamer_client.stream(uri, rank=rank, world_size=world, device=device), device)
    print(json.dumps({"rank": rank, "n": n, "bad": bad}))
    """
)


@pytest.fixture(scope="module")
def big_checkpoint(tmp_path_factory):
    """~2 GB of random bf16 with a 320 MiB tensor (larger than the daemon's 256 MiB slots)."""
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("gpu-ckpt")
    g = torch.Generator().manual_seed(0)
    tensors = {"embed.weight": torch.randn(40960, 4096, generator=g).to(torch.bfloat16)}
    for i in range(24):
        tensors[f"layers.{i}.w"] = torch.randn(4096, 4096, generator=g).to(torch.bfloat16)
        tensors[f"layers.{i}.norm"] = torch.randn(4096, generator=g).to(torch.bfloat16)
    names = list(tensors)
    weight_map = {}
    for k, chunk in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
        shard = f"model-{k + 1:05d}-of-00002.safetensors"
        save_file({n: tensors[n] for n in chunk}, str(root / shard))
        weight_map.update({n: shard for n in chunk})
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return root


@pytest.mark.parametrize("world", [1, 2, 4])
def test_daemon_ranks_on_gpus_byte_exact(big_checkpoint, tmp_path, world):
    # Rank r copies to cuda:(r mod GPUs): with fewer GPUs than ranks, several ranks share one.
    d = DaemonProcess(tmp_path, {}, "--shm-budget", "1GiB").start()
    try:
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", RANK, str(big_checkpoint), str(r), str(world)],
                env=d.rank_env(),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )  # fmt: skip
            for r in range(world)
        ]
        results = []
        for p in procs:
            out, err = p.communicate(timeout=600)
            assert p.returncode == 0, err[-3000:]
            results.append(json.loads(out.strip().splitlines()[-1]))
        assert all(r["bad"] == [] and r["n"] == 49 for r in results), results
        stats = d.stats()
        total = sum(f.stat().st_size for f in big_checkpoint.glob("*.safetensors"))
        assert stats["bytes_read"] <= total  # each byte once for the node, however many ranks
        assert stats["shm_peak"] <= 1024**3 + 320 * 2**20
    finally:
        d.stop()
    assert list(d.shm_dir.iterdir()) == []
    # Several CUDA ranks page-lock a ring kept to the 4 slots of 256 MiB a load starts with; one
    # rank alone stages through a ring the budget sizes.
    assert ("slots (at most 4: its ranks page-lock)" in d.log.read_text()) == (world > 1)


def test_warm_reload_to_gpu_from_the_resident_copy(big_checkpoint, tmp_path):
    """A second launch reads nothing from storage; its tensors, copied from resident segments, are exact."""
    d = DaemonProcess(tmp_path, {}, "--shm-budget", "1GiB", "--retention-budget", "4GiB").start()
    try:
        for launch in ("cold", "warm"):
            p = subprocess.run([sys.executable, "-c", RANK, str(big_checkpoint), "0", "1"],
                               env=d.rank_env(STREAMER_LAUNCH_ID=launch), capture_output=True, text=True, timeout=600)  # fmt: skip
            assert p.returncode == 0, p.stderr[-3000:]
            result = json.loads(p.stdout.strip().splitlines()[-1])
            assert result["bad"] == [] and result["n"] == 49, result
        cold, warm = d.finished(2)[-2:]
        total = sum(f.stat().st_size for f in big_checkpoint.glob("*.safetensors"))
        assert 0 < cold["bytes_read"] <= total and cold["bytes_from_memory"] == 0
        assert warm["bytes_read"] == 0 and warm["bytes_from_memory"] == cold["bytes_read"]
    finally:
        d.stop()
    assert list(d.shm_dir.iterdir()) == []


RELOAD = CHECK + textwrap.dedent(
    """
    import os, sys, streamer_client
    from streamer_client._segments import segment_maps
    uri = sys.argv[1]
    maps = segment_maps(os.environ["STREAMER_SHM_DIR"])
    out = []
    for launch in ("cold", "warm", "again"):
        n, bad = check(uri, streamer_client.stream(uri, device="cuda:0", launch_id=launch), "cuda:0")
        s = maps.stats
        out.append({"n": n, "bad": bad, "mapped": s.mapped, "pinned": s.pinned, "reused": s.reused})
    print(json.dumps(out))
    """
)


def _three_loads(tmp_path, checkpoint, *daemon_args) -> tuple[list[dict], list[dict]]:
    """Three loads of ``checkpoint`` in one fresh rank process (STREAMER_PIN_SEGMENTS=auto), each
    byte-exact, on a daemon that keeps idle segments for the next load: the rank's segment counts
    after each, and the daemon's account of each load."""
    d = DaemonProcess(tmp_path, {"STREAMER_SEGMENT_IDLE_S": "30"}, "--shm-budget", "4GiB", *daemon_args).start()
    try:
        p = subprocess.run([sys.executable, "-c", RELOAD, str(checkpoint)], env=d.rank_env(),
                           capture_output=True, text=True, timeout=600)  # fmt: skip
        assert p.returncode == 0, p.stderr[-3000:]
        loads = json.loads(p.stdout.strip().splitlines()[-1])
        assert all(load["bad"] == [] and load["n"] == 49 for load in loads)
        finished = d.finished(3)
    finally:
        d.stop()
    assert list(d.shm_dir.iterdir()) == []
    return loads, finished


def test_a_reload_the_daemon_streams_pins_its_segments_once(big_checkpoint, tmp_path):
    """Without retention every load is streamed into the ring's segments, the last load's first
    (tests/test_segments.py): a process's first load stages them (pins nothing), its second
    page-locks them, and no segment is page-locked twice."""
    (cold, warm, again), finished = _three_loads(tmp_path, big_checkpoint)
    assert all(f["bytes_read"] > 0 for f in finished)
    assert cold["pinned"] == 0 and warm["pinned"] > 0
    assert again["pinned"] <= again["mapped"]  # each segment mapped once and page-locked at most once
    assert again["reused"] > warm["reused"]  # the third load found segments this process had mapped


def test_loads_served_from_the_resident_copy_are_staged_and_map_nothing_again(big_checkpoint, tmp_path):
    """With retention the second and third loads come whole from the daemon's resident copy: every
    load is staged (no segment page-locked), and the later ones map no segment the first did not."""
    (cold, warm, again), finished = _three_loads(tmp_path, big_checkpoint, "--retention-budget", "4GiB")
    assert finished[0]["bytes_read"] > 0 and finished[1]["bytes_read"] == finished[2]["bytes_read"] == 0
    assert cold["pinned"] == warm["pinned"] == again["pinned"] == 0
    assert cold["mapped"] == warm["mapped"] == again["mapped"]  # the resident copy: the first load's segments


CLOSED_MIDWAY = CHECK + textwrap.dedent(
    """
    import sys, streamer_client
    uri = sys.argv[1]
    stream = streamer_client.stream(uri, device="cuda:0", launch_id="first")
    taken = [t for _, (_, t) in zip(range(20), stream)]
    stream.close()  # mid-load: a window may still be held in the ring, being filled from a segment
    torch.cuda.synchronize()
    n, bad = check(uri, streamer_client.stream(uri, device="cuda:0", launch_id="second"), "cuda:0")
    print(json.dumps({"taken": len(taken), "n": n, "bad": bad}))
    """
)


def test_a_staged_load_closed_midway_leaves_at_once_and_the_next_load_is_exact(big_checkpoint, tmp_path):
    """Both loads stage (``STREAMER_PIN_SEGMENTS=never``); the first is closed after 20 tensors (a
    window of the stream may still be held in the ring): the rank leaves at once (not reclaimed
    after a timeout), and the next load in the same process is bit-exact."""
    d = DaemonProcess(tmp_path, {}, "--shm-budget", "1GiB").start()
    try:
        p = subprocess.run([sys.executable, "-c", CLOSED_MIDWAY, str(big_checkpoint)],
                           env=d.rank_env(STREAMER_PIN_SEGMENTS="never"), capture_output=True, text=True, timeout=600)  # fmt: skip
        assert p.returncode == 0, p.stderr[-3000:]
        assert json.loads(p.stdout.strip().splitlines()[-1]) == {"taken": 20, "n": 49, "bad": []}
        first, second = d.finished(2)[-2:]
        assert first["ranks"]["0"]["status"] == "left"
        assert second["ranks"]["0"]["status"] == "done" and second["error"] is None
        assert d.healthy()
    finally:
        d.stop()
    assert list(d.shm_dir.iterdir()) == []


LEAVE_THEN_ANOTHER_LOAD = CHECK + textwrap.dedent(
    """
    import sys, streamer_client
    from streamer_client._cuda import PinnedCopier
    uri, other = sys.argv[1], sys.argv[2]
    copy_pieces = PinnedCopier.copy_pieces

    def late_copy_pieces(self, host, pieces):  # each batch's copies wait behind a spinning kernel (~0.5 s)
        if not self._issued:
            with torch.cuda.stream(self.stream):
                torch.cuda._sleep(1_000_000_000)
        return copy_pieces(self, host, pieces)

    PinnedCopier.copy_pieces = late_copy_pieces
    got = list(streamer_client.stream(uri, device="cuda:0", launch_id="first"))  # its last copies still queued
    # At once another load, of other bytes, into the segments the first gave back (the last first).
    sevens = streamer_client.load_state_dict(other, launch_id="second")
    torch.cuda.synchronize()
    n, bad = check(uri, iter(got), "cuda:0")
    print(json.dumps({"n": n, "bad": bad, "sevens": all(bool((t == 7).all()) for t in sevens.values())}))
    """
)


def test_a_page_locked_rank_leaves_only_once_its_copies_landed(big_checkpoint, tmp_path):
    """A rank page-locks its segments (``STREAMER_PIN_SEGMENTS=always``) and its copies run late
    (a kernel spins before each batch's on the copy stream); the moment its iteration ends, the
    same process loads another checkpoint (every float 7.0) through the daemon, which writes it
    into the segments the first load gave back. The first load's tensors, checked after both,
    equal safetensors': the rank said leave only once its copies had read the segments."""
    from safetensors.torch import save_file

    other = tmp_path / "sevens"
    other.mkdir()
    save_file({f"w{i}": torch.full((2048, 4096), 7.0) for i in range(8)}, str(other / "model.safetensors"))
    d = DaemonProcess(tmp_path, {"STREAMER_SEGMENT_IDLE_S": "30"}, "--shm-budget", "1GiB").start()
    try:
        p = subprocess.run([sys.executable, "-c", LEAVE_THEN_ANOTHER_LOAD, str(big_checkpoint), str(other)],
                           env=d.rank_env(STREAMER_PIN_SEGMENTS="always"), capture_output=True, text=True, timeout=600)  # fmt: skip
        assert p.returncode == 0, p.stderr[-3000:]
        assert json.loads(p.stdout.strip().splitlines()[-1]) == {"n": 49, "bad": [], "sevens": True}
        first, second = d.finished(2)[-2:]
        assert first["ranks"]["0"]["status"] == "done" and second["state"] == "done"
        assert d.stats()["segments_reused"] > 0  # the second load wrote into segments the first gave back
    finally:
        d.stop()
    assert list(d.shm_dir.iterdir()) == []
