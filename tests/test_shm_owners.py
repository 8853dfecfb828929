"""Whose segments a daemon may remove: real daemons as real processes, some in PID namespaces of
their own (as in containers), sharing one shm dir; bytes compared with safetensors."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from daemon_harness import DaemonProcess, finish, wait_until
from test_daemon_edges import _catalog, _inside

# Segments kept idle (the standing ring made at start) for the whole test.
KEEP = {"STREAMER_SLOT_SIZE": "1MiB", "STREAMER_SHM_BUDGET": "4MiB", "STREAMER_SEGMENT_IDLE_S": "600"}


def _names(shm_dir: Path) -> set[str]:
    return {p.name for p in shm_dir.iterdir()}


def _own(d: DaemonProcess, before: set[str]) -> set[str]:
    """The segments ``d`` made once it started (its standing ring), beside those ``before`` it."""

    def prepared() -> bool:
        with d.client() as c:
            body = c.get("/readyz").json()
        return body["segments_prepared"] > 0 and body["segments_preparing"] == 0

    wait_until(prepared, what="the daemon's standing ring")
    return _names(d.shm_dir) - before


def _sharing(root: Path, shm_dir: Path) -> DaemonProcess:
    """A daemon on a socket of its own under ``root`` and on ``shm_dir``, another daemon's."""
    root.mkdir()
    d = DaemonProcess(root, KEEP)
    d.shm_dir.rmdir()
    d.shm_dir = shm_dir
    d.env["STREAMER_SHM_DIR"] = str(shm_dir)
    return d


def _in_pid_namespace(d: DaemonProcess) -> subprocess.Popen:
    """``serve`` as PID 1 of a PID namespace of its own, as in a container."""
    cmd = ["unshare", "-p", "-f", "--mount-proc", sys.executable, "-m", "streamer_service", "serve", "--socket", str(d.socket)]
    proc = subprocess.Popen(cmd, env=d.env, stdout=open(d.log, "ab"), stderr=subprocess.STDOUT)
    wait_until(lambda: proc.poll() is not None or d.healthy(), timeout=120, what="the PID-1 daemon")
    assert proc.poll() is None, d.log.read_text()[-3000:]
    return proc


def _stop(proc: subprocess.Popen | None, sig: int = signal.SIGTERM) -> None:
    if proc is not None and proc.poll() is None:
        os.kill(_inside(proc), sig)  # unshare does not pass signals on
        proc.wait(timeout=30)


@pytest.mark.skipif(os.geteuid() != 0, reason="unshare --pid needs root")
def test_a_daemon_in_another_pid_namespace_sweeps_only_the_dead_daemons_segments(sample, tmp_path):
    """Three daemons on one shm dir: one live on the host, one killed -9 as PID 1 of its
    namespace, and a new PID-1 daemon that starts last. The new one removes the dead one's
    segments and none of the live one's, which then loads byte-exact and stays ready."""
    (tmp_path / "live").mkdir()
    live = DaemonProcess(tmp_path / "live", KEEP).start()
    dead = second = None
    try:
        live_segments = _own(live, set())
        dead_daemon = _sharing(tmp_path / "dead", live.shm_dir)
        dead = _in_pid_namespace(dead_daemon)
        dead_segments = _own(dead_daemon, live_segments)
        assert all(n.startswith("streamer-1-") for n in dead_segments)  # named after PID 1
        os.kill(_inside(dead), signal.SIGKILL)  # its namespace dies with it
        dead.wait(timeout=30)
        assert _names(live.shm_dir) == live_segments | dead_segments  # SIGKILL cleans nothing

        second_daemon = _sharing(tmp_path / "second", live.shm_dir)
        second = _in_pid_namespace(second_daemon)
        second_segments = _own(second_daemon, live_segments | dead_segments)
        now = _names(live.shm_dir)
        assert live_segments <= now, f"the live daemon's {sorted(live_segments - now)} were removed"
        assert not dead_segments & now, f"the dead daemon's {sorted(dead_segments & now)} were left"
        assert second_segments, "the second daemon made its own standing ring"

        names = [t.name for t in _catalog(sample).tensors]
        result = finish(live.start_rank(str(sample), 0, 1, sample, names))
        assert result["bad"] == [] and result["got"] == names
        with live.client() as c:
            ready = c.get("/readyz")
        assert ready.status_code == 200, ready.text
        result = finish(second_daemon.start_rank(str(sample), 0, 1, sample, names))
        assert result["bad"] == [] and result["got"] == names

        _stop(second)  # a daemon that stops removes its own segments, none of the live one's
        assert _names(live.shm_dir) == live_segments
    finally:
        _stop(dead, signal.SIGKILL)
        _stop(second)
        live.stop()
    assert _names(live.shm_dir) == set()


def test_a_daemon_whose_segments_are_removed_is_not_ready_and_says_why(sample, tmp_path):
    """Someone removes a live daemon's segment file: /readyz answers 503 naming it,
    ``health --ready`` exits 1 with the reason, and the log says it once."""
    d = DaemonProcess(tmp_path, KEEP).start()
    try:
        segments = sorted(_own(d, set()))
        with d.client() as c:
            assert c.get("/readyz").status_code == 200
        (d.shm_dir / segments[0]).unlink()
        with d.client() as c:
            ready = c.get("/readyz")
        assert ready.status_code == 503
        reasons = ready.json()["reasons"]
        assert reasons == [
            f"1 of this daemon's shared-memory segments were removed from {d.shm_dir} by another process "
            f"({segments[0]}): loads handed them fail; restart the daemon"
        ]
        health = subprocess.run([sys.executable, "-m", "streamer_service", "health", "--ready"], env=d.rank_env(),
                                capture_output=True, text=True, timeout=120)  # fmt: skip
        assert health.returncode == 1 and f"/readyz answered 503: {reasons[0]}" in health.stderr, health.stderr
        wait_until(lambda: "by another process" in d.log.read_text(), what="the log line")
        line = [ln for ln in d.log.read_text().splitlines() if "by another process" in ln]
        assert len(line) == 1 and segments[0] in line[0] and "restart the daemon" in line[0]
    finally:
        d.stop()
    assert _names(d.shm_dir) == set()
