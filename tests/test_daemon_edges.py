"""Daemon edges: loads nobody reads, stopping, crashes in containers, refused
and dead ranks, one ordering rule. Real daemon and rank processes; bytes counted at the storage."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from daemon_harness import DaemonProcess, finish, finish_failed, wait_until

from streamer_service.checkpoint.catalog import build_catalog
from streamer_service.checkpoint.plan import select as plan_select
from streamer_service.settings import Settings
from streamer_service.storage import open_storage
from streamer_service.uri import parse_uri


def _catalog(src: Path):
    return build_catalog(open_storage(parse_uri(str(src)), Settings()))


def _upload(backend, src: Path) -> str:
    backend.put_tree("ckpt", {p.name: p.read_bytes() for p in src.iterdir()})
    return backend.uri("ckpt")


def _tensor_bytes_served(backend) -> int:
    total = 0
    for r in backend.proxy.requests:
        if r.method == "GET" and r.range and r.path.endswith(".safetensors"):
            a, b = map(int, r.range.removeprefix("bytes=").split("-"))
            total += b - a + 1
    return total


# A rank that takes TAKE tensors, closes its iterator (it leaves) and stays alive until stdin closes.
LEAVE_EARLY = textwrap.dedent(
    """
    import sys, streamer_client
    it = streamer_client.stream(sys.argv[1], rank=int(sys.argv[2]), world_size=int(sys.argv[3]))
    for _ in range(int(sys.argv[4])):
        next(it)
    it.close()
    print("left", flush=True)
    sys.stdin.read()
    """
)


@pytest.mark.parametrize("backend", ["s3"], indirect=True)
def test_a_load_every_rank_left_stops_reading_from_storage(backend, sample, daemon):
    """Once no rank reads a load, nothing more is read for it, and its segments go."""
    uri = _upload(backend, sample)
    total = sum(t.nbytes for t in _catalog(sample).tensors)
    d = daemon({**backend.env, "STREAMER_SLOT_SIZE": "1MiB", "STREAMER_RANK_TIMEOUT_S": "600"}, "--shm-budget", "2MiB")
    backend.proxy.reset()
    ranks = [
        subprocess.Popen([sys.executable, "-c", LEAVE_EARLY, uri, str(r), "2", "3"], env=d.rank_env(),
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in range(2)
    ]  # fmt: skip
    try:
        for p in ranks:
            assert p.stdout.readline().strip() == "left", p.stderr.read()
        session = d.finished()[-1]
        assert session["state"] == "failed" and {r["status"] for r in session["ranks"].values()} == {"left"}
        served = _tensor_bytes_served(backend)
        time.sleep(1.0)  # anything still being read for nobody would show up now
        assert _tensor_bytes_served(backend) == served
        # What was read: what the ranks took, plus at most the ring's worth in flight (2 MiB) and
        # the one oversized tensor beyond it (4 MiB). The old code read all of it, for nobody.
        assert served < 8 * 2**20 < total
        assert list(d.shm_dir.iterdir()) == []
        assert d.stats()["shm_in_use"] == 0
    finally:
        for p in ranks:
            p.communicate(timeout=60)


@pytest.mark.parametrize("backend", ["s3"], indirect=True)
def test_sigterm_mid_load_stops_reading_removes_everything_and_exits_0(backend, sample, daemon):
    """Daemon stop: SIGTERM while a rank holds a batch."""
    uri = _upload(backend, sample)
    names = [t.name for t in _catalog(sample).tensors]
    total = sum(t.nbytes for t in _catalog(sample).tensors)
    d = daemon({**backend.env, "STREAMER_SLOT_SIZE": "1MiB", "STREAMER_RANK_TIMEOUT_S": "600"}, "--shm-budget", "2MiB")
    backend.proxy.reset()
    rank = d.start_rank(uri, 0, 1, sample, names, RANK_STALL_AFTER="3")
    try:
        assert wait_until(lambda: "stalled" in rank.stderr.readline(), what="the rank to stall")
        assert list(d.shm_dir.iterdir())  # it holds a batch
        d.proc.send_signal(signal.SIGTERM)
        assert d.proc.wait(timeout=60) == 0
        assert list(d.shm_dir.iterdir()) == []
        assert not d.socket.exists()
        served = _tensor_bytes_served(backend)
        assert served < 8 * 2**20 < total
        assert "the daemon is stopping" in d.log.read_text()
    finally:
        rank.kill()
        rank.communicate()


KILL_PID1 = """
import sys, streamer_client
it = streamer_client.stream(sys.argv[1], world_size=1)
next(it)
print("first", flush=True)
sys.stdin.read()
"""


def _pid1_daemon(tmp_path: Path, d: DaemonProcess) -> subprocess.Popen:
    """``serve`` as PID 1 of a PID namespace of its own, as in the container image."""
    cmd = ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-m", "streamer_service", "serve",
           "--socket", str(d.socket)]  # fmt: skip
    proc = subprocess.Popen(cmd, env=d.env, stdout=open(d.log, "ab"), stderr=subprocess.STDOUT)
    wait_until(lambda: proc.poll() is not None or d.healthy(), what="the PID-1 daemon")
    assert proc.poll() is None, d.log.read_text()[-3000:]
    return proc


def _inside(unshare: subprocess.Popen) -> int:
    """The PID (here) of the process that ``unshare --fork`` started."""
    return int(Path(f"/proc/{unshare.pid}/task/{unshare.pid}/children").read_text().split()[0])


@pytest.mark.skipif(os.geteuid() != 0, reason="unshare --pid needs root")
def test_a_pid1_daemon_killed_holding_a_batch_is_swept_by_the_next_pid1_daemon(sample, tmp_path):
    """Every daemon is PID 1 in its container; liveness is its lock, not its PID."""
    d = DaemonProcess(tmp_path, {"STREAMER_SLOT_SIZE": "1MiB", "STREAMER_SHM_BUDGET": "2MiB", "STREAMER_RANK_TIMEOUT_S": "600"})
    first = _pid1_daemon(tmp_path, d)
    rank = subprocess.Popen([sys.executable, "-c", KILL_PID1, str(sample)], env=d.rank_env(),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    second = None
    try:
        assert rank.stdout.readline().strip() == "first", rank.stderr.read()
        dead = sorted(p.name for p in d.shm_dir.iterdir())
        assert dead and all(n.startswith("streamer-1-") for n in dead)  # named after PID 1
        os.kill(_inside(first), signal.SIGKILL)  # the daemon, PID 1 inside; its namespace dies with it
        first.wait(timeout=30)
        wait_until(lambda: not d.healthy(), what="the daemon to be gone")
        assert sorted(p.name for p in d.shm_dir.iterdir()) == dead  # SIGKILL cleans nothing
        second = _pid1_daemon(tmp_path, d)
        assert list(d.shm_dir.iterdir()) == []
        names = [t.name for t in _catalog(sample).tensors]
        result = finish(d.start_rank(str(sample), 0, 1, sample, names))
        assert result["bad"] == [] and result["got"] == names
    finally:
        rank.kill()
        rank.communicate()
        for p in (first, second):
            if p is not None and p.poll() is None:
                os.kill(_inside(p), signal.SIGTERM)  # unshare does not pass signals on
                p.wait(timeout=30)


def test_ranks_learn_the_shm_dir_from_the_daemon(sample, tmp_path, daemon):
    """A rank without STREAMER_SHM_DIR, against ``serve --shm-dir /x``."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    d = daemon({}, "--shm-dir", str(elsewhere))
    env = {k: v for k, v in d.rank_env().items() if k != "STREAMER_SHM_DIR"}
    code = "import streamer_client,sys; print(len(streamer_client.load_state_dict(sys.argv[1])))"
    result = subprocess.run([sys.executable, "-c", code, str(sample)], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert int(result.stdout) == len(_catalog(sample).tensors)
    assert d.finished()[-1]["state"] == "done"
    # STREAMER_SHM_DIR still wins (a rank that mounts the dir elsewhere): a wrong one fails clearly.
    bad = subprocess.run([sys.executable, "-c", code, str(sample)], env={**env, "STREAMER_SHM_DIR": str(tmp_path)},
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert bad.returncode != 0 and "shared-memory segment" in bad.stderr and str(tmp_path) in bad.stderr


def test_a_rank_that_cannot_map_its_segments_is_failed_not_delivered(sample, tmp_path, daemon):
    """Stats and metrics say failed."""
    from test_daemon import _scrape

    d = daemon()
    one = _catalog(sample).tensors[0].name  # all of it in the first reply
    wrong = tmp_path / "not-the-shm-dir"
    wrong.mkdir()
    result = finish_failed(d.start_rank(str(sample), 0, 1, sample, [one], STREAMER_SHM_DIR=str(wrong)))
    assert result["error"]["type"] == "DaemonError" and "not found" in result["error"]["message"]
    session = d.finished()[-1]
    assert session["state"] == "failed"
    assert session["ranks"]["0"]["status"] == "failed"
    assert "DaemonError" in session["ranks"]["0"]["error"] and "rank 0 failed" in session["error"]
    metrics = _scrape(d)
    assert metrics[("streamer_sessions_total", (("outcome", "failed"),))] == 1
    assert ("streamer_sessions_total", (("outcome", "done"),)) not in metrics
    assert metrics.get(("streamer_rank_delivered_bytes_total", (("rank", "0"),)), 0) == 0
    assert metrics[("streamer_session_failures_total", (("type", "SessionError"),))] == 1
    assert list(d.shm_dir.iterdir()) == []


# Rank 1 of 2: joins, then gives its iterator up before asking for a tensor (HOW), and stays
# alive until stdin closes (the daemon must not learn it from the process's end).
UNSTARTED = textwrap.dedent(
    """
    import gc, sys, streamer_client
    uri, how = sys.argv[1], sys.argv[2]

    def load():
        it = streamer_client.stream(uri, rank=1, world_size=2, progress=how.endswith("-tracked"))
        if how.startswith("close"):
            it.close()
        elif how == "drop":
            del it
        elif how == "cycle":  # only the cycle collector frees it
            holder = [it]
            holder.append(holder)
            del it, holder
            gc.collect()
        elif how == "raise":  # the caller fails between stream() and the first next()
            raise RuntimeError("the engine refused its config")

    try:
        load()
    except RuntimeError:
        pass
    print("abandoned", flush=True)
    sys.stdin.read()
    """
)


@pytest.mark.parametrize("how", ["close", "close-tracked", "drop", "cycle", "raise"])
def test_a_rank_that_gives_up_its_iterator_unstarted_leaves_at_once(sample, daemon, how):
    """Rank 1 joins, then closes, drops or loses its iterator (a cycle the collector frees, an
    exception of its caller) before its first item, and lives on; rank 0 shares a ring of 3 slots
    with it, so it finishes only once rank 1's batches go back: at once, not after the 60 s rank
    timeout. Every tensor of rank 0 equals safetensors'."""
    d = daemon({"STREAMER_SLOT_SIZE": "1MiB", "STREAMER_RANK_TIMEOUT_S": "60", "STREAMER_PROGRESS": "on"}, "--shm-budget", "3MiB")
    names = [t.name for t in _catalog(sample).tensors]
    survivor = d.start_rank(str(sample), 0, 2, sample, None)
    quitter = subprocess.Popen(
        [sys.executable, "-c", UNSTARTED, str(sample), how],
        env=d.rank_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert quitter.stdout.readline() == "abandoned\n", quitter.stderr.read()[-3000:]
        abandoned = time.monotonic()  # both joined: rank 0 is loading now
        result = finish(survivor, timeout=120)
        took = time.monotonic() - abandoned
        assert result["bad"] == [] and result["got"] == names
        assert took < 10, f"rank 0 finished {took:.1f} s after rank 1 gave its iterator up"
        session = d.finished()[-1]
        assert session["state"] == "done" and session["ranks"]["1"]["status"] == "left", session
        assert quitter.poll() is None  # alive all along: it left, it was not found gone
    finally:
        quitter.stdin.close()
        quitter.wait(timeout=60)
    assert wait_until(lambda: not list(d.shm_dir.iterdir()), 10, "an empty shm dir")


def test_a_checkpoint_of_zero_tensors_loads_through_the_daemon(tmp_path, daemon):
    """0 tensors, as in-process, not 'unknown or finished session'."""
    from safetensors.torch import save_file

    src = tmp_path / "empty"
    src.mkdir()
    save_file({}, str(src / "model.safetensors"))
    (src / "config.json").write_text("{}")
    d = daemon()
    code = "import streamer_client,sys; print(len(streamer_client.load_state_dict(sys.argv[1])))"
    result = subprocess.run([sys.executable, "-c", code, str(src)], env=d.rank_env(), capture_output=True, text=True, timeout=120)
    assert (result.returncode, result.stdout.strip()) == (0, "0"), result.stderr[-2000:]
    assert d.finished()[-1]["state"] == "done"


@pytest.mark.parametrize("bad_first", [True, False], ids=["refused-first", "refused-last"])
def test_one_ranks_bad_selection_fails_the_others_at_once(sample, daemon, bad_first):
    """The others learn which rank was refused and why, not 'missing ranks [1]' after
    the join timeout (600 s here: the test would time out first)."""
    names = [t.name for t in _catalog(sample).tensors]
    d = daemon({"STREAMER_JOIN_TIMEOUT_S": "600"})
    good = lambda: d.start_rank(str(sample), 0, 2, sample, names, STREAMER_LAUNCH_ID="l1")  # noqa: E731
    bad = lambda: d.start_rank(str(sample), 1, 2, sample, ["no.such.tensor"], STREAMER_LAUNCH_ID="l1")  # noqa: E731
    if bad_first:
        refused = finish_failed(bad())
        other = finish_failed(good(), timeout=120)
    else:
        waiting = good()
        wait_until(lambda: d.stats()["sessions"], what="rank 0 to wait in its join")
        refused = finish_failed(bad())
        other = finish_failed(waiting, timeout=120)
    assert refused["error"]["type"] == "SelectionError" and "'no.such.tensor'" in refused["error"]["message"]
    assert other["error"]["type"] == "SessionError" and other["got"] == []
    message = other["error"]["message"]
    assert "rank 1 of session" in message and "was refused (SelectionError:" in message and "'no.such.tensor'" in message
    # Fixed, the same launch loads: the refusal is not remembered against it.
    again = [d.start_rank(str(sample), r, 2, sample, names, STREAMER_LAUNCH_ID="l1") for r in range(2)]
    assert all(finish(p)["got"] == names for p in again)


PRIORITY_RANK = """
import json, sys, streamer_client
select, priority = json.loads(sys.argv[2]), json.loads(sys.argv[3])
print(json.dumps([n for n, _ in streamer_client.stream(sys.argv[1], select=select, priority=priority)]))
"""


def test_priority_order_through_the_daemon_is_the_embedded_order(sample, daemon):
    """Priority entries in the order given, not in checkpoint order, in both modes."""
    names = [t.name for t in _catalog(sample).tensors]
    priority = ["model.layers.3.", "model.norm.weight", "model.layers.2.self_attn."]
    select = None
    embedded = subprocess.run([sys.executable, "-c", PRIORITY_RANK, str(sample), json.dumps(select), json.dumps(priority)],
                              capture_output=True, text=True, timeout=120)  # fmt: skip
    assert embedded.returncode == 0, embedded.stderr[-2000:]
    d = daemon()
    through = subprocess.run([sys.executable, "-c", PRIORITY_RANK, str(sample), json.dumps(select), json.dumps(priority)],
                             env=d.rank_env(), capture_output=True, text=True, timeout=120)  # fmt: skip
    assert through.returncode == 0, through.stderr[-2000:]
    want = [t.name for t in plan_select(_catalog(sample).tensors, select, priority)]
    assert want[0].startswith("model.layers.3.") and want != names
    assert json.loads(embedded.stdout) == want
    assert json.loads(through.stdout) == want
    assert d.finished()[-1]["state"] == "done"
