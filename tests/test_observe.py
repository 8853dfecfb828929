"""Observability: structured logs of `serve`, progress bars of the CLI and the client."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import struct
import subprocess
import sys
import termios

import pytest
import torch
from checkpoints import ground_truth, make_sharded_checkpoint, mixed_tensors
from daemon_harness import DaemonProcess

import streamer_client

CLI = [sys.executable, "-m", "streamer_service"]


def _serve_log(tmp_path, **env: str) -> list[str]:
    d = DaemonProcess(tmp_path, env).start()
    d.stop()
    return d.log.read_text().splitlines()


def test_serve_writes_json_lines_at_the_configured_level_without_secrets(tmp_path):
    secrets = {"STREAMER_TOKEN": "tok-3f9a1c-secret", "AZURE_STORAGE_ACCOUNT_KEY": "azkey-77b2e0-secret"}
    lines = _serve_log(tmp_path, STREAMER_LOG_FORMAT="json", STREAMER_LOG_LEVEL="DEBUG", **secrets)
    records = [json.loads(line) for line in lines]  # every line is one JSON object
    for r in records:
        assert {"time", "level", "logger", "message"} <= r.keys()
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}\+00:00", r["time"])
    assert any(r["level"] == "DEBUG" for r in records)
    serving = next(r for r in records if r["message"].startswith("serving on unix socket"))
    assert serving["logger"] == "streamer_service.daemon.server" and serving["socket"] == str(tmp_path / "daemon.sock")
    assert any(r["logger"].startswith("uvicorn") for r in records)  # uvicorn's records in our format
    settings = next(r for r in records if r["message"].startswith("settings: "))
    assert json.loads(settings["message"].removeprefix("settings: "))["token"] == "**********"
    text = "\n".join(lines)
    assert not any(secret in text for secret in secrets.values())


def test_serve_log_level_drops_less_severe_records(tmp_path):
    records = [json.loads(line) for line in _serve_log(tmp_path, STREAMER_LOG_FORMAT="json", STREAMER_LOG_LEVEL="WARNING")]
    # Without --allow the daemon warns that it reads any URI, and on a shm dir of small pages that
    # its segments could be huge pages (tests/test_hugepages.py); nothing below WARNING is written.
    messages = [r["message"] for r in records if "KiB pages (" not in r["message"]]
    assert messages == ["no --allow prefixes: this daemon will read any URI its credentials reach"]
    assert all(r["level"] == "WARNING" for r in records)


def test_bad_log_format_is_a_usage_error(tmp_path):
    result = subprocess.run([*CLI, "pull", str(tmp_path)], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "STREAMER_LOG_FORMAT": "xml"})  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.startswith("streamer-service pull: error: STREAMER_LOG_FORMAT='xml': ")


@pytest.fixture
def metadata_dir(tmp_path):
    src = tmp_path / "model"
    src.mkdir()
    (src / "config.json").write_text("{}")
    (src / "tokenizer.json").write_bytes(b"x" * 300_000)
    return src


def _pull_with_stderr_on_a_terminal(src, cache, *flags: str, env=None) -> str:
    """Run `pull` with stderr on a pseudo-terminal; return what was drawn there."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # a terminal's 120 columns
    proc = subprocess.Popen([*CLI, *flags, "pull", str(src), "--cache-dir", str(cache)], stdout=subprocess.PIPE,
                            stderr=slave, env={**os.environ, **(env or {})})  # fmt: skip
    os.close(slave)
    drawn = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        drawn += chunk
    os.close(master)
    assert proc.wait(timeout=60) == 0
    return drawn.decode(errors="replace")


def test_pull_draws_files_and_bytes_on_a_terminal_only(metadata_dir, tmp_path):
    bar = re.compile(r"pull: 100%\|.*\| 300k/300k \[.*, 2/2 files\]")
    on_tty = _pull_with_stderr_on_a_terminal(metadata_dir, tmp_path / "c1")
    assert bar.search(on_tty), on_tty
    off = _pull_with_stderr_on_a_terminal(metadata_dir, tmp_path / "c2", "--no-progress")
    assert "%|" not in off
    env_off = _pull_with_stderr_on_a_terminal(metadata_dir, tmp_path / "c3", env={"STREAMER_PROGRESS": "off"})
    assert "%|" not in env_off
    piped = subprocess.run(
        [*CLI, "pull", str(metadata_dir), "--cache-dir", str(tmp_path / "c4")], capture_output=True, text=True, timeout=60
    )
    assert piped.returncode == 0 and "%|" not in piped.stderr  # not a terminal: quiet
    forced = subprocess.run([*CLI, "--progress", "pull", str(metadata_dir), "--cache-dir", str(tmp_path / "c5")],
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    assert forced.returncode == 0 and bar.search(forced.stderr), forced.stderr


@pytest.fixture
def checkpoint(tmp_path):
    make_sharded_checkpoint(tmp_path / "ckpt", mixed_tensors(), 2)
    return tmp_path / "ckpt"


def test_client_bar_counts_the_bytes_of_the_rank(checkpoint, monkeypatch, capsys):
    monkeypatch.setenv("STREAMER_PROGRESS", "on")
    truth = ground_truth(checkpoint)
    total = sum(t.numel() * t.element_size() for t in truth.values())
    got = dict(streamer_client.stream(checkpoint, progress=True))
    assert got.keys() == truth.keys() and all(torch.equal(got[n], truth[n]) for n in truth)
    assert re.search(rf"100%\|.*\| {total}/{total} ", capsys.readouterr().err)


def test_client_draws_nothing_unless_asked(checkpoint, monkeypatch, capsys):
    monkeypatch.setenv("STREAMER_PROGRESS", "on")
    assert len(streamer_client.load_state_dict(checkpoint)) == len(mixed_tensors())
    assert capsys.readouterr().err == ""


# A rank container without tqdm: the import fails as it would there.
NO_TQDM = """
import sys
class NoTqdm:
    def find_spec(self, name, path=None, target=None):
        if name == "tqdm" or name.startswith("tqdm."):
            raise ModuleNotFoundError("No module named 'tqdm'", name="tqdm")
sys.meta_path.insert(0, NoTqdm())
import streamer_client
from streamer_client.errors import ConfigError
try:
    streamer_client.stream(sys.argv[1], progress=True)
except ConfigError as exc:
    print("ConfigError:", exc)
print(len(streamer_client.load_state_dict(sys.argv[1])), "tensors without a bar")
"""


def test_client_asked_for_a_bar_without_tqdm_says_what_to_install(checkpoint):
    result = subprocess.run([sys.executable, "-c", NO_TQDM, str(checkpoint)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "ConfigError: progress bars need tqdm, which streamer-client does not install: pip install tqdm "
        "(or leave progress off: progress=False, STREAMER_PROGRESS=off)",
        f"{len(mixed_tensors())} tensors without a bar",
    ]
