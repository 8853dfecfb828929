"""What the daemon's cache and allow-list let another user reach: real daemons, a second UID
(``setpriv``: uid 65534 in the daemon's group, gid 0), strace on the daemon for its syscalls."""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest
from daemon_harness import DaemonProcess, finish

from streamer_service.sample import build_sample

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="a second UID needs root (setpriv)")

AS_GROUP_MEMBER = ["setpriv", "--reuid", "65534", "--regid", "0", "--clear-groups"]

ASK = """
import httpx, json, sys
with httpx.Client(transport=httpx.HTTPTransport(uds=sys.argv[1]), base_url="http://d", timeout=60) as c:
    print(json.dumps(c.post("/v1/metadata", json={"uri": sys.argv[2]}).json()))
"""


@pytest.fixture
def shared_root():
    """A dir every user can traverse (pytest's tmp dirs are root's only): the second UID reaches
    the socket and the cache only as their modes allow."""
    root = Path(tempfile.mkdtemp(prefix="streamer-access-"))
    root.chmod(0o755)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def source(tmp_path) -> Path:
    """A checkpoint with a root-only config (0600), a world-readable tokenizer (0644) and a
    group-readable file in a subdir (0640)."""
    src = tmp_path / "ckpt"
    build_sample(src, size_mb=1)
    (src / "config.json").chmod(0o600)
    (src / "tokenizer.json").write_text('{"secret": "no"}')
    (src / "tokenizer.json").chmod(0o644)
    (src / "sub").mkdir()
    (src / "sub" / "chat_template.jinja").write_text("{{ x }}")
    (src / "sub" / "chat_template.jinja").chmod(0o640)
    return src


def _modes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): stat.S_IMODE(p.lstat().st_mode) for p in [root, *root.rglob("*")]}


@pytest.mark.parametrize("group_access", [False, True], ids=["private", "group-access"])
def test_cached_metadata_is_never_wider_than_the_daemons_mode_or_its_source(source, shared_root, group_access):
    cache = shared_root / "cache"
    flags = ["--allow", str(source), *(["--group-access"] if group_access else [])]
    d = DaemonProcess(shared_root, {"STREAMER_CACHE_DIR": str(cache)}, *flags).start()
    try:
        result = finish(d.start_rank(str(source), 0, 1, source, None))  # metadata, catalog and a load
        assert result["bad"] == [] and result["got"]
    finally:
        d.stop()
    file_mode, dir_mode = (0o640, 0o750) if group_access else (0o600, 0o700)
    modes = _modes(cache)
    files = {name: mode for name, mode in modes.items() if not stat.S_ISDIR((cache / name).lstat().st_mode)}
    dirs = {name: mode for name, mode in modes.items() if name not in files}
    assert files and all(dirs[name] == dir_mode for name in dirs), modes
    assert all(mode & ~file_mode == 0 for mode in files.values()), modes
    [entry] = [p for p in cache.iterdir() if p.is_dir()]
    cached = {str(p.relative_to(entry)): stat.S_IMODE(p.stat().st_mode) for p in entry.rglob("*") if p.is_file()}
    # Never wider than the source: the 0600 config stays 0600, the 0644 tokenizer gets the daemon's mode.
    assert cached["config.json"] == 0o600
    assert cached["tokenizer.json"] == file_mode
    assert cached["sub/chat_template.jinja"] == file_mode & 0o640
    assert cached[".runai_complete"] == file_mode


def test_a_group_member_reads_through_the_cache_only_what_the_group_may_read(source, shared_root):
    cache = shared_root / "cache"
    d = DaemonProcess(shared_root, {"STREAMER_CACHE_DIR": str(cache)}, "--group-access", "--allow", str(source)).start()
    try:
        asked = subprocess.run([*AS_GROUP_MEMBER, sys.executable, "-c", ASK, str(d.socket), str(source)],
                               capture_output=True, text=True, timeout=120)  # fmt: skip
        assert asked.returncode == 0, asked.stderr
        path = Path(json.loads(asked.stdout)["path"])
        assert path.parent == cache
    finally:
        d.stop()

    def read_as_member(name: str) -> subprocess.CompletedProcess:
        return subprocess.run([*AS_GROUP_MEMBER, "cat", str(path / name)], capture_output=True, text=True, timeout=60)

    denied = read_as_member("config.json")
    assert denied.returncode != 0 and "Permission denied" in denied.stderr and denied.stdout == ""
    shared = read_as_member("tokenizer.json")
    assert shared.returncode == 0 and shared.stdout == '{"secret": "no"}'


@pytest.mark.parametrize("flags", [["--group-access"], ["--tcp-port", "{port}"]], ids=["group-access", "tcp"])
def test_a_daemon_others_can_ask_does_not_start_without_allow(tmp_path, flags):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        flags = [f.format(port=s.getsockname()[1]) for f in flags]
    sock = tmp_path / "d.sock"
    env = {**os.environ, "STREAMER_TOKEN": "t0ken-for-the-test"}
    cmd = [sys.executable, "-m", "streamer_service", "serve", "--socket", str(sock), "--shm-dir", str(tmp_path), *flags]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert result.returncode == 2, result.stderr
    [line] = result.stderr.splitlines()
    assert line.startswith("streamer-service serve: error: --") and "--allow / STREAMER_ALLOW" in line
    assert not sock.exists()


def test_a_group_access_daemon_allowed_only_object_storage_refuses_every_local_path(source, tmp_path):
    d = DaemonProcess(tmp_path, {}, "--group-access", "--allow", "s3://bucket/models").start()
    try:
        with d.client() as c:
            for path in (source, source / "config.json", tmp_path / "missing", "/"):
                r = c.post("/v1/metadata", json={"uri": str(path)})
                assert r.status_code == 403, r.text
                assert r.json()["error"]["message"] == f"this daemon may not read {path}: not under any --allow prefix"
        assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())
    finally:
        d.stop()


def test_every_uri_outside_allow_gets_one_refusal_before_any_filesystem_call(source, tmp_path):
    token, linked = uuid.uuid4().hex, uuid.uuid4().hex
    allowed = tmp_path / "models" / "m"
    allowed.parent.mkdir()
    shutil.copytree(source, allowed)
    outside = tmp_path / f"outside-{token}"
    shutil.copytree(source, outside)
    (tmp_path / f"file-{token}").write_text("x")
    (tmp_path / f"target-{linked}").mkdir()
    links = allowed.parent / "links"  # beside the checkpoint: a pull of it refuses links out of the prefix
    links.mkdir()
    (links / "escape").symlink_to(tmp_path / f"target-{linked}")
    (links / "dangling").symlink_to(tmp_path / f"missing-{linked}")
    untouched = [  # outside by their text alone: the daemon must not even stat them
        f"/root/missing-{token}",
        f"/root/missing-{token}/deeper",
        str(tmp_path / f"file-{token}"),
        str(outside),
        f"{allowed}/../../outside-{token}",
        f"file://{outside}",
        f"{tmp_path}/models-{token}",  # shares the allowed prefix as a string
        f"s3://bucket-{token}/m",
    ]
    by_links = [str(links / "escape"), str(links / "dangling")]  # inside by their text, outside once resolved
    d = DaemonProcess(tmp_path, {}, "--allow", str(allowed.parent)).start()
    trace = tmp_path / "strace.txt"
    tracer = subprocess.Popen(["strace", "-f", "-qq", "-e", "trace=%file", "-o", str(trace), "-p", str(d.proc.pid)])
    try:
        deadline = time.monotonic() + 60  # attached once the daemon's calls show up
        while time.monotonic() < deadline and not (trace.exists() and trace.stat().st_size):
            with d.client() as c:
                c.get("/readyz")
            time.sleep(0.2)
        with d.client() as c:
            for uri in [*untouched, *by_links]:
                for route, body in (
                    ("/v1/metadata", {"uri": uri}),
                    ("/v1/sessions/join", {"uri": uri, "session": "s", "rank": 0, "world_size": 1}),
                ):
                    r = c.post(route, json=body, timeout=60)
                    assert r.status_code == 403, (uri, route, r.text)
                    assert r.json()["error"] == {
                        "type": "StorageAccessDeniedError",
                        "message": f"this daemon may not read {uri}: not under any --allow prefix",
                        "uri": uri,
                        "key": None,
                    }, uri
            assert c.post("/v1/metadata", json={"uri": str(allowed)}).status_code == 200
    finally:
        time.sleep(0.5)
        tracer.terminate()
        tracer.wait(timeout=30)
        d.stop()
    syscalls = trace.read_text()
    assert str(allowed) in syscalls  # the trace holds the daemon's calls on the allowed dir
    assert token not in syscalls, [line for line in syscalls.splitlines() if token in line][:5]
