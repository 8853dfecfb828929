"""Stopping a daemon whose reads storage does not answer: a real daemon process, reading from an S3
emulator through a proxy that stalls every tensor read."""

from __future__ import annotations

import signal
import struct
import threading
import time

import pytest
from daemon_harness import finish_failed
from harness.proxy import Fault
from test_daemon_edges import _catalog, _upload

GRACE_S = 1


@pytest.mark.parametrize("retention", ["0", "64MiB"], ids=["ring", "retained"])
@pytest.mark.parametrize("backend", ["s3"], indirect=True)
def test_sigterm_while_storage_stalls_the_reads_exits_within_the_grace_leaving_no_segment(backend, sample, daemon, retention):
    """SIGTERM while Run:ai waits on reads that never come, into ring slots or into segments kept
    for retention: the daemon abandons them (its segment files unlinked, their memory left mapped
    for the reads), exits 0 within the grace plus 5 s, and the rank is told why."""
    uri = _upload(backend, sample)
    names = [t.name for t in _catalog(sample).tensors]
    env = {**backend.env, "STREAMER_SLOT_SIZE": "1MiB", "STREAMER_RANK_TIMEOUT_S": "600", "STREAMER_STOP_GRACE_S": str(GRACE_S),
           "STREAMER_RETENTION_BUDGET": retention}  # fmt: skip
    d = daemon(env, "--shm-budget", "4MiB")
    stalled = threading.Event()
    # Where each shard's tensor bytes start: header reads pass, Run:ai's tensor reads stall.
    data_start = {p.name: 8 + struct.unpack("<Q", p.read_bytes()[:8])[0] for p in sample.glob("*.safetensors")}

    def stall_tensor_reads(request):
        shard = request.path.rpartition("/")[2]
        if request.method == "GET" and request.range and shard in data_start:
            if int(request.range.removeprefix("bytes=").split("-")[0]) >= data_start[shard]:
                stalled.set()
                return Fault.stalled(600)
        return None

    backend.proxy.fault = stall_tensor_reads
    rank = d.start_rank(uri, 0, 1, sample, names)
    try:
        assert stalled.wait(120), "no tensor read reached storage"
        assert list(d.shm_dir.iterdir())  # the reads' segments
        time.sleep(0.5)  # the stalled body is in Run:ai's hands
        sent = time.monotonic()
        d.proc.send_signal(signal.SIGTERM)
        code = d.proc.wait(timeout=120)
        took = time.monotonic() - sent
        log = d.log.read_text()
        assert code == 0, log[-3000:]
        assert took <= GRACE_S + 5, f"exit took {took:.1f} s"
        assert list(d.shm_dir.iterdir()) == []
        assert not d.socket.exists()
        assert "the reads are abandoned" in log
        result = finish_failed(rank, timeout=60)
        assert result["got"] == []
        error = result["error"]
        assert (error["type"], "the daemon is stopping" in error["message"]) == ("SessionError", True), error
    finally:
        backend.proxy.fault = None
        backend.proxy.release_stalls()
        rank.kill()
        rank.communicate()
