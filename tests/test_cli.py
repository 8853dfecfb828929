import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

CLI = [sys.executable, "-m", "streamer_service"]


def run(*args, **kw):
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120, **kw)


def test_pull_prints_the_dir_last(tmp_path):
    src = tmp_path / "model"
    src.mkdir()
    (src / "config.json").write_text("{}")
    (src / "model.safetensors").write_bytes(b"\0" * 16)
    result = run("pull", str(src), "--cache-dir", str(tmp_path / "cache"))
    assert result.returncode == 0, result.stderr
    out = result.stdout.strip().splitlines()[-1]
    assert out.startswith(str(tmp_path / "cache") + "/")
    assert sorted(p.name for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock")) == [out.rsplit("/", 1)[1]]


def test_pull_error_is_one_clear_line(tmp_path):
    result = run("pull", "hdfs://nn/model")
    assert result.returncode == 1
    assert result.stderr.strip() == (
        "streamer-service pull: error: unsupported URI scheme 'hdfs://' in 'hdfs://nn/model': "
        "use s3://, gs://, az:// or a local directory"
    )
    assert "Traceback" not in result.stderr


def test_bad_setting_is_a_usage_error(tmp_path):
    import os

    result = run("pull", str(tmp_path), env={**os.environ, "STREAMER_LOCK_TIMEOUT_S": "soon"})
    assert result.returncode == 2
    assert result.stderr.startswith("streamer-service pull: error: STREAMER_LOCK_TIMEOUT_S='soon': ")
    assert len(result.stderr.strip().splitlines()) == 1


def test_health_without_a_daemon_fails_clearly(tmp_path):
    result = run("health", "--socket", str(tmp_path / "none.sock"))
    assert result.returncode == 1
    assert f"no daemon answers at {tmp_path / 'none.sock'}" in result.stderr


def test_cli_and_api_agree_on_the_torchrun_launch(tmp_path):
    import json
    import os

    src = tmp_path / "model"
    src.mkdir()
    (src / "config.json").write_text("{}")
    env = {**os.environ, "TORCHELASTIC_RUN_ID": "run-7", "STREAMER_CACHE_DIR": str(tmp_path / "cache")}
    result = run("pull", str(src), env=env)
    assert result.returncode == 0, result.stderr
    marker = json.loads((Path(result.stdout.strip().splitlines()[-1]) / ".runai_complete").read_text())
    # The launch id the Python API derives for every torchrun rank: a forced CLI pull counts as one of them.
    assert marker["launch_id"] == "torchelastic-run-7"


# -------------------------------------------------------------------------------------- conventions


def _walk_arguments():
    """(command, action) for every argument of the top-level parser and of every subcommand."""
    import argparse

    from streamer_service.cli import build_parser

    parser = build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                for sub_action in sub._actions:
                    yield name, sub_action
        else:
            yield "streamer-service", action


def test_every_argument_of_every_command_has_help():
    import argparse

    seen = set()
    for command, action in _walk_arguments():
        seen.add(command)
        if isinstance(action, argparse._HelpAction):
            continue
        name = "/".join(action.option_strings) or action.dest
        assert action.help and action.help.strip(), f"{command} {name}: no help text"
    assert {"pull", "inspect", "serve", "health", "demo", "bench"} <= seen


def test_version_names_our_and_runais_versions():
    import importlib.metadata

    result = run("--version")
    assert result.returncode == 0, result.stderr
    line = result.stdout.strip()
    assert line.startswith(f"streamer-service {importlib.metadata.version('streamer-service')} (")
    assert f"runai-model-streamer {importlib.metadata.version('runai-model-streamer')}" in line
    assert "streamer-client 0.1.0" in line
    import os

    broken = run("--version", env={**os.environ, "STREAMER_LOCK_TIMEOUT_S": "soon"})  # a bad setting elsewhere
    assert broken.returncode == 0 and broken.stdout.startswith("streamer-service "), broken.stderr


def test_errors_are_json_lines_with_log_format_json(tmp_path):
    import json

    failed = run("--log-format", "json", "pull", "hdfs://nn/model")
    assert failed.returncode == 1
    record = json.loads(failed.stderr.strip())  # one line, one object
    assert record["level"] == "ERROR" and record["command"] == "pull" and record["exit_code"] == 1
    assert record["error"] == "InvalidURIError" and record["uri"] == "hdfs://nn/model"
    assert record["message"].startswith("streamer-service pull: error: unsupported URI scheme 'hdfs://'")
    usage = run("--log-format", "json", "pul")  # argparse's usage error, too
    assert usage.returncode == 2
    record = json.loads(usage.stderr.strip())
    assert record["exit_code"] == 2 and "invalid choice: 'pul'" in record["message"]


def test_health_json_answers_without_a_daemon(tmp_path):
    import json

    result = run("health", "--json", "--socket", str(tmp_path / "none.sock"))
    assert result.returncode == 1
    reply = json.loads(result.stdout)
    assert reply["status"] == "unavailable" and reply["socket"] == str(tmp_path / "none.sock")
    assert "no daemon answers" in reply["error"]


def test_health_json_reports_readiness_and_read_parallelism(daemon):
    import json
    import os

    from streamer_service.sizing import in_flight_bytes, slot_bytes

    d = daemon({"STREAMER_OBJ_CONCURRENCY": "32", "STREAMER_TARGET_GBPS": "400"})
    env = {**os.environ, "RUNAI_STREAMER_CHUNK_BYTESIZE": "6291456"}  # the operator's own: it wins, and is reported
    result = run("health", "--ready", "--json", "--socket", str(d.socket), env=env)
    assert result.returncode == 0, result.stderr
    reply = json.loads(result.stdout)
    assert reply["status"] == "ready" and reply["socket"] == str(d.socket)
    # What the daemon's own environment puts in force (its process did not get the chunk size).
    budget = reply["shm_budget"]
    assert reply["read_parallelism"] == {
        "RUNAI_STREAMER_OBJ_CONCURRENCY": {"value": "32", "source": "settings"},
        "RUNAI_STREAMER_S3_TARGET_GBPS": {"value": "32", "source": "target_gbps=400"},
        "RUNAI_STREAMER_CHUNK_BYTESIZE": {"value": str(16 * 1024**2), "source": "target_gbps=400"},
        "bytes_in_flight": {
            "value": str(in_flight_bytes(400, slot_bytes(budget, 256 * 1024**2), budget)),
            "source": "target_gbps=400",
        },
    }
    assert reply["local_reader"] == "mapped"  # the copier is built here (tests/test_mapped.py)
    log = d.log.read_text()
    assert "Run:ai reads: RUNAI_STREAMER_OBJ_CONCURRENCY=32 (settings), RUNAI_STREAMER_S3_TARGET_GBPS=32 (target_gbps=400)" in log
    assert "local dirs: read through file mappings by the native copier" in log


def test_health_probe_imports_no_torch(tmp_path):
    """`health` runs as an exec probe every few seconds: it must not pay for torch (seconds of CPU)."""
    script = (
        "import sys; from streamer_service import cli; "
        f"code = cli.main(['health', '--socket', {str(tmp_path / 'none.sock')!r}]); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy', 'fastapi', 'uvicorn')))"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "[]", result.stdout + result.stderr


def test_exit_codes_table_matches_the_cli():
    """docs/daemon.md, "Exit codes", is the one table of them: the codes main() returns."""
    import re

    from streamer_service import cli

    text = (Path(__file__).resolve().parent.parent / "docs" / "daemon.md").read_text()
    section = text[text.index("## Exit codes") :].split("\n## ", 1)[0]
    documented = {int(code) for code in re.findall(r"^\| (\d+) \|", section, re.M)}
    assert documented == {cli.EXIT_OK, cli.EXIT_ERROR, cli.EXIT_USAGE, cli.EXIT_INTERRUPTED}


def _serve(tmp_path, *args, env=None):
    import os

    shm = tmp_path / "shm"
    shm.mkdir(exist_ok=True)
    sock = tmp_path / "d.sock"
    result = run("serve", "--socket", str(sock), "--shm-dir", str(shm), *args, env={**os.environ, **(env or {})})
    return result, sock


@pytest.mark.parametrize(
    "args, env, message",
    [
        (["--shm-dir", "/nonexistent"], {}, "--shm-dir / STREAMER_SHM_DIR /nonexistent is not a directory"),
        (
            ["--allow", "bogus://x"],
            {},
            "--allow / STREAMER_ALLOW prefix 'bogus://x' is not a URI this daemon can read: unsupported URI scheme",
        ),
        (
            ["--allow", "s3:/x"],
            {},
            "--allow / STREAMER_ALLOW prefix 's3:/x' is not a URI this daemon can read: checkpoint directory 's3:/x' does not exist",
        ),
        ([], {"STREAMER_SHM_BUDGET": "lots"}, "STREAMER_SHM_BUDGET='lots': "),
        (["--shm-budget", "1"], {}, "STREAMER_SHM_BUDGET='1': a budget of 1 bytes is below one slot (65536 bytes = 64KiB)"),
        ([], {"STREAMER_ALLOW": "s3://okay/m, hdfs://nn/m"}, "prefix 'hdfs://nn/m' is not a URI this daemon can read"),
        (["--tcp-port", "0"], {"STREAMER_TOKEN": "t0ken"}, "STREAMER_TCP_PORT=0: 0 is below the least allowed, 1"),
    ],
    ids=["shm-dir", "bogus-scheme", "one-slash", "env-budget", "budget-below-a-slot", "env-allow-list", "tcp-port-zero"],
)
def test_serve_startup_errors_are_one_line_exit_2_before_serving(tmp_path, args, env, message):
    """These must not print a uvicorn traceback after "serving on unix socket" nor exit 3."""
    result, sock = _serve(tmp_path, *args, env=env)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("streamer-service serve: error: "), result.stderr
    assert message in lines[0]
    assert not sock.exists()


def test_a_budget_of_few_slots_is_served_with_a_warning(tmp_path):
    import os
    import signal
    import threading
    import time

    shm = tmp_path / "shm"
    shm.mkdir(exist_ok=True)
    sock = tmp_path / "d.sock"
    proc = subprocess.Popen(
        [*CLI, "serve", "--socket", str(sock), "--shm-dir", str(shm), "--shm-budget", "256KiB"],
        env={**os.environ, "STREAMER_SLOT_SIZE": "1MiB"}, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    # Stopped once it answers: its log then holds the whole start-up.
    from streamer_client._connection import DaemonClient

    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
    reader.start()
    client = DaemonClient(sock)
    try:
        deadline = time.monotonic() + 60
        while not client.reachable() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        client.close()
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
        reader.join(timeout=30)
    err = "".join(lines)
    assert (
        "STREAMER_SHM_BUDGET (262144 bytes) holds fewer than 4 slots of STREAMER_SLOT_SIZE (1048576 bytes): "
        "slots shrink to 65536 bytes"
    ) in err
    assert err.index("holds fewer than 4 slots") < err.index("serving on unix socket")


@pytest.mark.parametrize("backend", ["s3"], indirect=True)
def test_cli_stderr_has_no_sdk_info_lines(backend, tmp_path):
    import os

    backend.put_tree("m", {"config.json": b"{}"})
    result = run("pull", backend.uri("m"), env={**os.environ, **backend.env, "STREAMER_LOG_LEVEL": "INFO"})
    assert result.returncode == 0, result.stderr
    assert "botocore" not in result.stderr and "Found credentials" not in result.stderr
    assert "pulled 1 metadata files" in result.stderr  # our own INFO lines still show


def test_every_option_that_sets_a_setting_names_its_variable():
    from streamer_client._settings import SETTINGS

    rows = {row.name: row for row in SETTINGS}
    checked = set()
    for command, action in _walk_arguments():
        row = rows.get(action.dest)
        if row is None or not action.option_strings or command not in ("pull", "inspect", "serve", "health"):
            continue
        checked.add(f"{command} {action.option_strings[0]}")
        assert any(env in action.help for env in row.env), f"{command} {action.option_strings[0]}: help names none of {row.env}"
    assert "serve --allow" in checked and "serve --shm-budget" in checked


def test_health_errors_are_error_lines(tmp_path):
    result = run("health", "--ready", "--socket", str(tmp_path / "none.sock"))
    assert result.returncode == 1
    [line] = result.stderr.splitlines()
    assert line.startswith(f"streamer-service health: error: no daemon answers at {tmp_path / 'none.sock'}: ")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run serve as another user (setpriv)")
@pytest.mark.parametrize(
    "socket_path", ["run/streamer/daemon.sock", "run/daemon.sock"], ids=["dir-it-cannot-make", "dir-it-cannot-write"]
)
def test_serve_on_a_socket_dir_it_cannot_write_is_one_error_line_exit_2(socket_path):
    """As a user that cannot write there (the default /run/streamer as non-root)."""
    import shutil
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="streamer-serve-"))
    try:
        root.chmod(0o755)
        (root / "run").mkdir(mode=0o755)  # root's: uid 65534 cannot write into it
        writable = root / "mine"
        writable.mkdir()
        writable.chmod(0o1777)
        env = {**os.environ, "STREAMER_CACHE_DIR": str(writable / "cache"), "HOME": str(writable)}
        path = root / socket_path
        result = subprocess.run(
            ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", *CLI, "serve",
             "--socket", str(path), "--shm-dir", str(writable)],
            capture_output=True, text=True, timeout=180, env=env,
        )  # fmt: skip
        assert result.returncode == 2, result.stderr
        [line] = result.stderr.splitlines()
        assert line == (
            f"streamer-service serve: error: cannot serve on {path}: Permission denied "
            "(--socket / STREAMER_SOCKET: a path in a dir this user can write)"
        )
        assert not path.exists()
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_a_budget_under_four_minimum_slots_keeps_slots_of_the_minimum_size(daemon, tmp_path):
    import torch
    from checkpoints import make_sharded_checkpoint
    from daemon_harness import finish

    src = tmp_path / "ckpt"  # 96 tensors of 4 KiB: slots, not tensors of their own, decide the segments' sizes
    make_sharded_checkpoint(src, {f"t.{i}": torch.full((1024,), float(i)) for i in range(96)}, n_shards=2)
    d = daemon({}, "--shm-budget", "100KiB")
    sizes: set[int] = set()
    stop = threading.Event()

    def sample_sizes() -> None:
        while not stop.is_set():
            for p in list(d.shm_dir.iterdir()):
                try:
                    sizes.add(p.stat().st_size)
                except FileNotFoundError:
                    pass
            time.sleep(0.001)

    sampler = threading.Thread(target=sample_sizes, daemon=True)
    sampler.start()
    try:
        result = finish(d.start_rank(str(src), 0, 1, src, None))
    finally:
        stop.set()
        sampler.join()
    assert result["bad"] == [] and result["got"]
    sizes.discard(0)  # a segment seen between its creation and its fallocate
    assert sizes and min(sizes) >= 64 * 1024, sorted(sizes)
