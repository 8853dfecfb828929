"""The daemon's runtime under hostile and unlucky clients: many open connections, joins held by a
client that then dies, a shm filesystem too small for its budget, SIGTERM mid-load, a reaper that
stops. Real daemon processes, real unix sockets, real rank processes."""

from __future__ import annotations

import json
import logging
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest
from checkpoints import ground_truth, tensor_bytes
from daemon_harness import DaemonProcess, finish, finish_failed, leftovers, wait_until

from streamer_service.sample import rank_selection

OPEN_FILES = 8192  # the daemon's and this test's limit: room for thousands of connections


@pytest.fixture
def open_files():
    """This process may hold ``OPEN_FILES`` descriptors; the limit it had comes back afterwards."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < OPEN_FILES:
        pytest.skip(f"the hard limit of open files is {hard}, below {OPEN_FILES}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, OPEN_FILES), hard))
    yield ["prlimit", f"--nofile={OPEN_FILES}", "--"]  # the daemon gets the same limit
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _names(sample: Path) -> list[str]:
    index = json.loads((sample / "model.safetensors.index.json").read_text())
    return sorted(index["weight_map"])


def _sockets(pid: int) -> int:
    """The process's open sockets (its other descriptors, segment files among them, come and go)."""
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            count += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
        except FileNotFoundError:  # closed while listed
            pass
    return count


def _timed_get(d: DaemonProcess, path: str) -> tuple[float, httpx.Response]:
    started = time.monotonic()
    with d.client() as c:
        reply = c.get(path, timeout=30)
    return time.monotonic() - started, reply


# --------------------------------------------------------------------------- the reaper


def test_a_rank_killed_while_2000_connections_are_open_is_reclaimed_at_once(sample, tmp_path, open_files):
    """Descriptor numbers past 1024 (2,000 idle connections): the reaper still sees a dead rank."""
    names = _names(sample)
    selections = [rank_selection(names, r, 2) for r in range(2)]
    d = DaemonProcess(
        tmp_path, {"STREAMER_SLOT_SIZE": "1MiB", "STREAMER_RANK_TIMEOUT_S": "600"}, "--shm-budget", "3MiB", wrap=open_files
    ).start()  # fmt: skip
    held = []
    try:
        for _ in range(2000):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(str(d.socket))
            held.append(s)
        wait_until(lambda: _sockets(d.proc.pid) >= 2000, 120, "the daemon to accept 2,000 connections")
        ranks = [d.start_rank(str(sample), r, 2, sample, selections[r]) for r in range(2)]
        victim = ranks[1]
        assert victim.stderr.readline().startswith("got ")  # it holds leases now
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        started = time.monotonic()
        result = finish(ranks[0], timeout=180)  # the rank timeout is 600 s: only the reaper ends the wait
        print(f"survivor finished {time.monotonic() - started:.1f} s after rank 1 was killed")
        assert result["bad"] == [] and len(result["got"]) == len(selections[0])
        assert d.finished()[-1]["ranks"]["1"]["status"] == "reclaimed"
        assert "rank 1 its process is gone" in d.log.read_text()
        assert _timed_get(d, "/readyz")[1].status_code == 200
    finally:
        for s in held:
            s.close()
        d.stop()


def test_a_reaper_that_stops_makes_the_daemon_not_ready_and_says_why(tmp_path, caplog):
    """Whatever ends the reaper thread, /readyz answers 503 with the reason and the log says it."""
    from starlette.testclient import TestClient

    from streamer_service.daemon.api import create_app
    from streamer_service.settings import Settings

    app = create_app(Settings(segment_idle_s=0))
    with (
        caplog.at_level(logging.CRITICAL, logger="streamer_service.daemon.core"),
        TestClient(app, client=("", 0)) as c,
    ):  # as over the unix socket
        assert c.get("/readyz").status_code == 200
        daemon = app.state.daemon

        def broken(now: float) -> None:  # a fault injected into the reaper's round
            raise RuntimeError("injected fault")

        daemon.pool.trim = broken
        reply = wait_until(lambda: (r := c.get("/readyz")).status_code == 503 and r, 30, "/readyz to say not ready")
        assert reply.json()["status"] == "not ready"
        assert reply.json()["reasons"] == ["the reaper stopped (RuntimeError: injected fault)"]
        assert c.get("/healthz").status_code == 200  # the process is up: readiness says what is wrong
    logged = [r for r in caplog.records if r.levelno == logging.CRITICAL]
    assert len(logged) == 1 and "the reaper stopped (RuntimeError: injected fault)" in logged[0].getMessage()
    assert "no longer reclaimed" in logged[0].getMessage() and logged[0].exc_info is not None


def test_joins_refused_while_opening_keep_nothing_per_uri(tmp_path):
    """Joins whose checkpoint cannot be opened are refused naming the URI, and the daemon keeps
    nothing for those URIs afterwards (a client that sends many distinct URIs grows nothing)."""
    from starlette.testclient import TestClient

    from streamer_service.daemon.api import create_app
    from streamer_service.settings import Settings

    app = create_app(Settings(segment_idle_s=0))
    with TestClient(app, client=("", 0)) as c:
        for i in range(20):
            empty = tmp_path / f"empty-{i}"  # a directory with no checkpoint in it
            empty.mkdir()
            reply = c.post("/v1/sessions/join", json={"uri": str(empty), "session": f"s{i}", "rank": 0, "world_size": 1})
            assert reply.status_code == 404, reply.text
            error = reply.json()["error"]
            assert error["type"] == "ObjectNotFoundError" and str(empty) in error["message"], error
        daemon = app.state.daemon
        assert daemon._opening == {} and daemon.sessions == {}


# --------------------------------------------------------------------------- pending joins

HOLD_JOINS = """
import json, os, resource, socket, sys
path, uri, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(resource.RLIMIT_NOFILE)[1],) * 2)
held = []
for i in range(count):
    body = json.dumps({"uri": uri, "session": f"held-{i}", "rank": 0, "world_size": 2}).encode()
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    s.sendall(b"POST /v1/sessions/join HTTP/1.1\\r\\nHost: d\\r\\nContent-Type: application/json\\r\\n"
              b"Content-Length: %d\\r\\n\\r\\n" % len(body) + body)
    held.append(s)
print("sent", flush=True)
sys.stdin.readline()
os._exit(0)  # every connection closes with the process
"""


def test_a_thousand_joins_held_by_a_client_that_exits_starve_nothing_and_go_with_it(sample, tmp_path, open_files):
    d = DaemonProcess(tmp_path, {"STREAMER_RANK_TIMEOUT_S": "60"}, wrap=open_files).start()
    client = subprocess.Popen(
        [sys.executable, "-c", HOLD_JOINS, str(d.socket), str(sample), "1000"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert client.stdout.readline().strip() == "sent"

        def joining() -> int:
            return sum(s["state"] == "joining" for s in d.stats()["sessions"])

        wait_until(lambda: joining() == 1000, 240, "1,000 sessions waiting for their rank 1")
        for path in ("/healthz", "/readyz"):
            took, reply = _timed_get(d, path)
            print(f"{path} with 1,000 joins pending: {took:.3f} s")
            assert reply.status_code == 200 and took < 5
        client.stdin.close()
        assert client.wait(timeout=60) == 0
        took, reply = _timed_get(d, "/healthz")
        print(f"/healthz right after the client exited: {took:.3f} s")
        assert reply.status_code == 200 and took < 5
        wait_until(lambda: d.stats()["sessions"] == [], 120, "the dead client's joins to be withdrawn")
        assert "every rank that joined went away" in d.stats()["finished"][-1]["error"]
        started = time.monotonic()
        result = finish(d.start_rank(str(sample), 0, 1, sample, None), timeout=180)
        print(f"a new load (rank process start included): {time.monotonic() - started:.1f} s")
        assert result["bad"] == [] and len(result["got"]) == len(_names(sample))
        assert leftovers(d, tmp_path / "cache") == ([], [])
    finally:
        client.kill()
        client.wait()
        d.stop()


# --------------------------------------------------------------------------- readiness and shm room

namespaces = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("nsenter") is None,
    reason="needs root and util-linux unshare/nsenter for a private mount namespace with a small tmpfs",
)


@namespaces
@pytest.mark.parametrize("size, ready", [("64m", False), ("300m", True)])
def test_readiness_says_whether_the_shm_filesystem_holds_a_loads_ring(tmp_path, size, ready):
    """256 MiB budget, slots of 64 MiB: a load streams through 4 of them (256 MiB)."""
    d = DaemonProcess(tmp_path, {}, "--shm-budget", "256MiB", tmpfs={tmp_path / "shm": size}).start()
    try:
        _, reply = _timed_get(d, "/readyz")
        body = reply.json()
        assert (reply.status_code, body["status"]) == ((200, "ready") if ready else (503, "not ready")), body
        assert body["shm_budget"] == 256 * 2**20 and body["shm_ring"] == 256 * 2**20
        assert body["shm_free"] == int(size[:-1]) * 2**20
        if not ready:
            assert body["reasons"] == [
                f"the shm filesystem at {d.shm_dir} has 64.0 MiB free: less than the 4 slots of 64.0 MiB one "
                "load streams through, while STREAMER_SHM_BUDGET claims 256.0 MiB; give the shm dir more room "
                "(a larger tmpfs or emptyDir sizeLimit) or lower --shm-budget or STREAMER_SLOT_SIZE"
            ]
            health = subprocess.run(
                [sys.executable, "-m", "streamer_service", "health", "--ready", "--socket", str(d.socket)],
                capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            assert health.returncode == 1 and "/readyz answered 503" in health.stderr
        assert d.healthy()
    finally:
        d.stop()


def _one_rank_daemon(tmp_path: Path) -> DaemonProcess:
    """A daemon whose ring of four 1 MiB slots a rank that holds its batches fills, and that
    reclaims no silent rank while a test takes its time."""
    d = DaemonProcess(tmp_path, {"STREAMER_SLOT_SIZE": "1MiB", "STREAMER_RANK_TIMEOUT_S": "600"}, "--shm-budget", "4MiB")
    d.start()
    return d


def _join_alone(c: httpx.Client, sample: Path, session: str) -> str:
    """Join ``sample`` as rank 0 of 1: the path prefix of the rank's requests."""
    body = {"uri": str(sample), "session": session, "rank": 0, "world_size": 1}
    joined = c.post("/v1/sessions/join", json=body, timeout=120).json()
    return f"/v1/sessions/{joined['session_id']}/ranks/0"


def _read(d: DaemonProcess, handles: list, got: dict) -> list[int]:
    """Each handle's bytes, out of its segment (before the batch is released), into ``got``; the
    batches they belong to."""
    for batch, segment, offset, nbytes, name, *_ in handles:
        with open(d.shm_dir / segment, "rb") as f:
            f.seek(offset)
            got[name] = f.read(nbytes)
    return sorted({h[0] for h in handles})


def _assert_every_tensor_and_nothing_left(d: DaemonProcess, sample: Path, got: dict, tmp_path: Path) -> None:
    truth = ground_truth(sample)
    assert sorted(got) == sorted(truth)
    for name, tensor in truth.items():
        assert got[name] == tensor_bytes(tensor), name
    assert d.finished()[-1]["state"] == "done"
    assert leftovers(d, tmp_path / "cache") == ([], [])


def test_requests_for_handles_whose_client_gave_up_lose_nothing(sample, tmp_path):
    """A rank holds the whole ring, sends four long requests for more and closes their connections
    (its client timed out), then goes on on a new connection: the requests it gave up take nothing
    (the newer one answers in their place, and they see their connection closed), so the rank
    gets every tensor byte-exact, the session ends done and its segments go."""
    d = _one_rank_daemon(tmp_path)
    try:
        with d.client() as c:
            base = _join_alone(c, sample, "gave-up")
            got, held = {}, set()
            while True:  # nothing released: the ring fills and the load waits for this rank
                reply = c.post(f"{base}/next", json={"release": [], "wait_s": 1.0 if held else 10.0}, timeout=60).json()
                if not reply["handles"] and held:
                    break
                held |= set(_read(d, reply["handles"], got))
            stats = d.stats()
            assert stats["shm_in_use"] >= stats["shm_budget"]  # the ring is full: nothing more can come
            body = json.dumps({"release": [], "wait_s": 10}).encode()
            given_up = []
            for _ in range(4):
                conn = socket.socket(socket.AF_UNIX)
                conn.connect(str(d.socket))
                conn.sendall(
                    f"POST {base}/next HTTP/1.1\r\nHost: d\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(body)}\r\n\r\n".encode()
                    + body
                )
                given_up.append(conn)
            wait_until(lambda: d.stats()["sessions"][0]["ranks"]["0"]["waiting"] >= 1, 60, "the requests to wait")
            for conn in given_up:
                conn.close()
            release, done = sorted(held), False
            deadline = time.monotonic() + 120
            while not done:
                assert time.monotonic() < deadline, f"{len(got)} of the tensors came; the rest never will"
                reply = c.post(f"{base}/next", json={"release": release, "wait_s": 5.0}, timeout=60).json()
                release, done = _read(d, reply["handles"], got), reply["done"]
            c.post(f"{base}/next", json={"release": release, "wait_s": 0})
            c.post(f"{base}/leave")
        _assert_every_tensor_and_nothing_left(d, sample, got, tmp_path)
    finally:
        d.stop()


# Another process on the node, sending a rank's requests: ``next`` releasing what the rank holds,
# then ``leave`` with an error. Prints its PID and each answer's status, error type and message.
_NOT_THE_RANK = textwrap.dedent(
    """
    import json, os, sys
    import httpx

    socket_path, base, held = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    answers = []
    with httpx.Client(transport=httpx.HTTPTransport(uds=socket_path), base_url="http://d", timeout=30) as c:
        for path, body in ((base + "/next", {"release": held, "wait_s": 0}), (base + "/leave", {"error": "not mine"})):
            error = c.post(path, json=body).json().get("error", {})
            answers.append([error.get("type"), error.get("message")])
    print(json.dumps({"pid": os.getpid(), "answers": answers}))
    """
)


def test_another_process_cannot_release_or_leave_for_a_rank(sample, tmp_path):
    """Rank 0 joins from this process and holds batches; another process sends its ``next``
    (releasing them) and its ``leave``: each is a 409 ``SessionError`` naming both processes, the
    session goes on, and the rank then gets every tensor byte-exact and the session ends done."""
    d = _one_rank_daemon(tmp_path)
    try:
        with d.client() as c:
            base = _join_alone(c, sample, "own")
            got = {}
            held = _read(d, c.post(f"{base}/next", json={"release": [], "wait_s": 10.0}, timeout=60).json()["handles"], got)
            assert held
            other = subprocess.run(
                [sys.executable, "-c", _NOT_THE_RANK, str(d.socket), base, json.dumps(held)],
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert other.returncode == 0, other.stderr
            answer = json.loads(other.stdout)
            refused = (
                f"rank 0 of session 'own' joined from process {os.getpid()}; this request came from process "
                f"{answer['pid']}, and only the rank's own process may ask for its tensors, release them or leave"
            )
            assert answer["answers"] == [["SessionError", refused]] * 2
            assert d.stats()["sessions"][0]["state"] == "streaming"
            release, done = held, False
            while not done:
                reply = c.post(f"{base}/next", json={"release": release, "wait_s": 5.0}, timeout=60).json()
                release, done = _read(d, reply["handles"], got), reply["done"]
            c.post(f"{base}/next", json={"release": release, "wait_s": 0})
            assert c.post(f"{base}/leave").json() == {"left": True}
        _assert_every_tensor_and_nothing_left(d, sample, got, tmp_path)
    finally:
        d.stop()


# --------------------------------------------------------------------------- SIGTERM


# The daemon's command line, with the signal raised inside a finalizer as the named function of
# the start-up is called: the moment a stop can come, made exact. Python's default SIGINT handler
# raises KeyboardInterrupt there, which a finalizer swallows; SIGTERM's default ends the process.
_STOP_WHILE_STARTING = textwrap.dedent(
    """
    import signal, sys
    from streamer_service.cli import main

    moment, sig = sys.argv[1], getattr(signal, sys.argv[2])

    class Dropped:
        def __del__(self):
            signal.raise_signal(sig)

    def hook(frame, event, arg):
        if event == "call" and frame.f_code.co_name == moment:
            sys.setprofile(None)
            Dropped()

    sys.setprofile(hook)
    sys.exit(main(sys.argv[3:]))
    """
)


@pytest.mark.parametrize("sig, code", [("SIGINT", 130), ("SIGTERM", 0)])
@pytest.mark.parametrize(
    "moment",
    [
        "bind_unix_socket",  # before the server would start: it does not
        "capture_signals",  # as uvicorn is about to take the signals over: it starts, then stops
    ],
)
def test_a_stop_that_comes_while_the_daemon_starts_stops_it(tmp_path, moment, sig, code):
    shm, sock = tmp_path / "shm", tmp_path / "d.sock"
    shm.mkdir(exist_ok=True)
    proc = subprocess.Popen(
        [sys.executable, "-c", _STOP_WHILE_STARTING, moment, sig, "serve", "--socket", str(sock), "--shm-dir", str(shm),
         "--shm-budget", "4MiB"],
        env={**os.environ, "STREAMER_SLOT_SIZE": "1MiB"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == code, out[-3000:]
    assert "Exception ignored" not in out, out[-3000:]
    assert ("Application startup complete" in out) == (moment == "capture_signals"), out[-3000:]
    assert list(shm.iterdir()) == [] and not sock.exists()


def test_sigterm_mid_load_tells_every_rank_the_daemon_is_stopping(sample, tmp_path):
    names = _names(sample)
    selections = [rank_selection(names, r, 2) for r in range(2)]
    d = DaemonProcess(
        tmp_path, {"STREAMER_SLOT_SIZE": "1MiB", "STREAMER_RANK_TIMEOUT_S": "600"}, "--shm-budget", "3MiB"
    ).start()  # fmt: skip
    # Slow consumers: the load is in its middle when the daemon is told to stop.
    ranks = [d.start_rank(str(sample), r, 2, sample, selections[r], RANK_SLOW_S="0.2") for r in range(2)]
    try:
        for rank in ranks:
            assert rank.stderr.readline().startswith("got ")
        d.proc.send_signal(signal.SIGTERM)
        for rank in ranks:
            result = finish_failed(rank, timeout=120)
            assert result["error"]["type"] == "SessionError", result["error"]
            assert result["error"]["message"].endswith(": the daemon is stopping"), result["error"]
            assert result["bad"] == [] and 0 < len(result["got"]) < len(selections[result["rank"]])
        assert d.proc.wait(timeout=60) == 0
        assert list(d.shm_dir.iterdir()) == [] and not d.socket.exists()
    finally:
        for rank in ranks:
            rank.kill()
            rank.communicate()
        d.stop()


def test_a_join_waiting_at_sigterm_is_told_the_daemon_is_stopping(sample, tmp_path):
    d = DaemonProcess(tmp_path, {}).start()
    rank = d.start_rank(str(sample), 0, 2, sample, None)  # rank 1 never comes
    try:
        wait_until(lambda: [s["state"] for s in d.stats()["sessions"]] == ["joining"], 120, "rank 0 to wait in its join")
        d.proc.send_signal(signal.SIGTERM)
        result = finish_failed(rank, timeout=120)
        assert result["error"]["type"] == "SessionError" and result["error"]["message"].endswith(": the daemon is stopping")
        assert d.proc.wait(timeout=60) == 0
    finally:
        rank.kill()
        rank.communicate()
        d.stop()
