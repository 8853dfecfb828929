import subprocess
import sys
from pathlib import Path


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
    assert "invalid configuration" in result.stderr and "lock_timeout_s" in result.stderr


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
