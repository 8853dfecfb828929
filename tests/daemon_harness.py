"""Start a real `streamer-service serve` process and real rank processes for daemon tests."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx

# RANK_STALL_AFTER=n: after n tensors the rank says "stalled" on stderr and hangs (a test kills it);
# RANK_SLOW_S=s: it sleeps s seconds after each tensor, before comparing it (a slow consumer);
# RANK_AWAIT_GO=1: once imported it says "ready" on stderr and waits for a line on stdin before it
# loads; RANK_PAUSE_AFTER=n: after n tensors it says "paused" on stderr and waits for a line on
# stdin; RANK_BORROWED=1: it asks for borrowed views; RANK_DEVICE=cuda:0: its tensors go to that
# device (compared with safetensors' on the CPU); RANK_SLICES={name: [[dim, start, stop], ...]}: it
# asks for those slices (compared with safetensors' tensor narrowed and concatenated by torch).
RANK_SCRIPT = textwrap.dedent(
    """
    import json, os, sys, time, torch, streamer_client
    from safetensors import safe_open
    uri, rank, world, truth_dir, select = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], json.loads(sys.argv[5])
    stall_after, slow_s = int(os.environ.get("RANK_STALL_AFTER", "-1")), float(os.environ.get("RANK_SLOW_S", "0"))
    pause_after, borrowed = int(os.environ.get("RANK_PAUSE_AFTER", "-1")), bool(os.environ.get("RANK_BORROWED"))
    device = os.environ.get("RANK_DEVICE", "cpu")
    slices = json.loads(os.environ.get("RANK_SLICES", "null"))
    index = json.load(open(truth_dir + "/model.safetensors.index.json"))["weight_map"]
    if os.environ.get("RANK_AWAIT_GO"):
        print("ready", flush=True, file=sys.stderr)
        sys.stdin.readline()
    files = {}
    got, bad, received = [], [], 0
    try:
        for name, t in streamer_client.stream(uri, select=select, rank=rank, world_size=world, borrowed=borrowed, device=device, slices=slices):
            if len(got) == stall_after:
                print("stalled", flush=True, file=sys.stderr)
                time.sleep(3600)
            if len(got) == pause_after:
                print("paused", flush=True, file=sys.stderr)
                sys.stdin.readline()
            time.sleep(slow_s)
            shard = index[name]
            if shard not in files:
                files[shard] = safe_open(truth_dir + "/" + shard, "pt")
            want, t = files[shard].get_tensor(name), t.cpu()
            if slices and name in slices:
                want = torch.cat([want.narrow(d, a, b - a) for d, a, b in slices[name]], slices[name][0][0])
            received += t.nelement() * t.element_size()
            if not (want.dtype == t.dtype and want.shape == t.shape and torch.equal(want.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))):
                bad.append(name)
            got.append(name)
            print("got", name, flush=True, file=sys.stderr)
    except streamer_client.errors.StreamerError as exc:  # what was delivered before it, and the error
        error = {"type": type(exc).__name__, "message": str(exc), "uri": exc.uri, "key": exc.key}
        print(json.dumps({"rank": rank, "got": got, "bad": bad, "received": received, "error": error}))
        sys.exit(3)
    print(json.dumps({"rank": rank, "got": got, "bad": bad, "received": received}))
    """
)


START_TIMEOUT_S = 120


class DaemonProcess:
    """``streamer-service serve`` on a socket under ``root``, segments in ``root/shm``.

    ``tmpfs`` ({dir: size}) runs the daemon in a private mount namespace (``unshare -m``, root
    only) where each dir is a tmpfs of that size: a full disk or shm filesystem without touching
    the machine. A size may carry more tmpfs options (``"96m,huge=always"``: huge pages), and
    ``"hugetlbfs:pagesize=2M"`` mounts hugetlbfs instead (its pool is the machine's, left as it is). Ranks then join that namespace (``nsenter``); :meth:`view` reads its files.
    """

    def __init__(
        self, root: Path, env: dict[str, str], *extra: str, tmpfs: dict[Path, str] | None = None, wrap: list[str] | None = None
    ) -> None:
        self.socket = root / "daemon.sock"
        self.shm_dir = root / "shm"
        self.shm_dir.mkdir(exist_ok=True)
        self.log = root / "daemon.log"
        # Segments unlinked as soon as a session ends, so tests can assert an empty shm dir;
        # test_segments_are_reused_across_sessions turns the pool on.
        self.env = {**os.environ, "STREAMER_SEGMENT_IDLE_S": "0", **env, "STREAMER_SHM_DIR": str(self.shm_dir)}
        self.extra = extra
        self.tmpfs = dict(tmpfs or {})
        self.wrap = list(wrap or [])  # a command the daemon's command line is appended to (e.g. joining a cgroup)
        self.proc: subprocess.Popen | None = None

    def start(self) -> DaemonProcess:
        cmd = [sys.executable, "-m", "streamer_service", "serve", "--socket", str(self.socket), *self.extra]
        if self.tmpfs:
            mounts = " && ".join(_mount(d, spec) for d, spec in self.tmpfs.items())
            cmd = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", f'{mounts} && exec "$@"', "sh", *cmd]
        cmd = [*self.wrap, *cmd]
        self.proc = subprocess.Popen(cmd, env=self.env, stdout=open(self.log, "ab"), stderr=subprocess.STDOUT)
        # Generous: at a load average of 12-14 on two cores a daemon took 29.8 s to answer (torch,
        # FastAPI and Run:ai imports), and a 30 s deadline failed tests now and then.
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited {self.proc.returncode}: {self.log.read_text()[-3000:]}")
            if self.healthy():
                return self
            time.sleep(0.05)
        self.stop(signal.SIGKILL)  # a daemon that never came up must not outlive the test
        raise RuntimeError(f"daemon not healthy in {START_TIMEOUT_S} s: {self.log.read_text()[-3000:]}")

    def client(self) -> httpx.Client:
        return httpx.Client(transport=httpx.HTTPTransport(uds=str(self.socket)), base_url="http://d", timeout=10)

    def healthy(self) -> bool:
        try:
            with self.client() as c:
                return c.get("/healthz").json() == {"status": "ok"}
        except (httpx.HTTPError, ValueError):
            return False

    def stats(self) -> dict:
        with self.client() as c:
            return c.get("/v1/stats").json()

    def finished(self, count: int = 1, timeout: float = 60) -> list[dict]:
        """Summaries of the ended sessions, newest last, once at least ``count`` have ended: a rank
        can exit before the daemon's session thread has filed its session."""

        def ended() -> list[dict] | None:
            summaries = self.stats()["finished"]
            return summaries if len(summaries) >= count else None

        return wait_until(ended, timeout, f"{count} ended session(s)")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def view(self, path: Path) -> Path:
        """``path`` as the daemon sees it (through its mount namespace while it runs)."""
        if not self.tmpfs:
            return path
        return Path(f"/proc/{self.proc.pid}/root") / Path(path).relative_to("/")

    def _prefix(self) -> list[str]:
        return ["nsenter", "-t", str(self.proc.pid), "-m", "--"] if self.tmpfs else []

    def rank_env(self, **extra: str) -> dict[str, str]:
        return {**self.env, "STREAMER_SOCKET": str(self.socket), **extra}

    def start_rank(self, uri: str, rank: int, world: int, truth_dir: Path, select, wrap=(), **env: str) -> subprocess.Popen:
        return subprocess.Popen(
            [*wrap, *self._prefix(), sys.executable, "-c", RANK_SCRIPT, uri, str(rank), str(world), str(truth_dir), json.dumps(select)],
            env=self.rank_env(**env), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip


def _mount(directory: Path, spec: str) -> str:
    fstype, _, options = spec.rpartition(":")
    if not fstype:
        fstype, options = "tmpfs", f"size={options}"
    return f"mount -t {fstype} -o {shlex.quote(options)} {fstype} {shlex.quote(str(directory))}"


def segment_files(shm_dir: Path) -> list[Path]:
    """The segments in a shm dir: its files but the generations table a daemon keeps beside them
    while it has any (an empty dir stays empty: the table goes with the last segment)."""
    return [p for p in shm_dir.iterdir() if not p.name.endswith(".generations")]


def wait_until(predicate, timeout: float = 60, what: str = "condition"):
    """Poll ``predicate`` until it returns something true (returned), or fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.05)


def finish(proc: subprocess.Popen, timeout: float = 300) -> dict:
    out, err = proc.communicate(timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"rank exited {proc.returncode}: {out[-1000:]} {err[-3000:]}")
    return json.loads(out.strip().splitlines()[-1])


def finish_failed(proc: subprocess.Popen, timeout: float = 300) -> dict:
    """The result of a rank whose load failed with a StreamerError: ``got``, ``bad`` and ``error``."""
    out, err = proc.communicate(timeout=timeout)
    if proc.returncode != 3:
        raise AssertionError(f"rank exited {proc.returncode}, not with a StreamerError: {out[-1000:]} {err[-3000:]}")
    return json.loads(out.strip().splitlines()[-1])


def leftovers(d: DaemonProcess, cache_dir: Path, timeout: float = 10) -> tuple[list[str], list[str]]:
    """What a scenario left behind once the daemon settled: (shm files, half-filled cache dirs)."""
    shm_dir, cache_dir = d.view(d.shm_dir), d.view(cache_dir)
    deadline = time.monotonic() + timeout
    while list(shm_dir.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.05)
    shm = sorted(p.name for p in shm_dir.iterdir())
    half = sorted(p.name for p in cache_dir.glob(".*") if p.name.startswith((".tmp-", ".old-"))) if cache_dir.exists() else []
    if cache_dir.exists():
        half += sorted(
            p.name
            for p in cache_dir.iterdir()
            if p.is_dir() and not (p / ".runai_complete").exists() and not p.name.startswith(".")
        )
    return shm, half


class ShmSampler:
    """Samples the shm dir's total segment size and every file's mode while a load runs (independent
    of the daemon). The daemon's generations table is no segment: 1 MiB sparse, outside the budget."""

    def __init__(self, shm_dir: Path) -> None:
        self.shm_dir = shm_dir
        self.peak = 0
        self.modes: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            total = 0
            for p in list(self.shm_dir.iterdir()):
                try:
                    st = p.stat()
                except FileNotFoundError:
                    continue
                total += st.st_size if not p.name.endswith(".generations") else 0
                self.modes.add(st.st_mode & 0o777)
            self.peak = max(self.peak, total)
            time.sleep(0.002)

    def __enter__(self) -> ShmSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
