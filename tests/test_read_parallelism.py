"""Run:ai's read parallelism as our settings: what reaches its environment, and what is reported."""

from __future__ import annotations

import pytest

from streamer_client.errors import SettingsError
from streamer_service.runai import read_parallelism_in_force, storage_environment
from streamer_service.settings import Settings


def test_set_values_reach_runais_variables_and_unset_ones_stay_unset():
    env = storage_environment(Settings(obj_concurrency=32, s3_target_gbps=16, read_chunk_size="32MiB"))
    assert env["RUNAI_STREAMER_OBJ_CONCURRENCY"] == "32"
    assert env["RUNAI_STREAMER_S3_TARGET_GBPS"] == "16"
    assert env["RUNAI_STREAMER_CHUNK_BYTESIZE"] == str(32 * 1024**2)
    default = storage_environment(Settings())
    assert not {"RUNAI_STREAMER_OBJ_CONCURRENCY", "RUNAI_STREAMER_S3_TARGET_GBPS", "RUNAI_STREAMER_CHUNK_BYTESIZE"} & set(default)


def test_the_report_names_each_values_source():
    settings = Settings(obj_concurrency=32)
    report = read_parallelism_in_force(settings, environ={"RUNAI_STREAMER_S3_TARGET_GBPS": "40"})
    assert report == {
        "RUNAI_STREAMER_OBJ_CONCURRENCY": {"value": "32", "source": "settings"},
        "RUNAI_STREAMER_S3_TARGET_GBPS": {"value": "40", "source": "environment"},  # the operator's own wins
        "RUNAI_STREAMER_CHUNK_BYTESIZE": {"value": "8388608", "source": "run:ai default"},
    }
    # Run:ai's generic fallback, when ours is unset.
    fallback = read_parallelism_in_force(Settings(), environ={"RUNAI_STREAMER_CONCURRENCY": "12"})
    assert fallback["RUNAI_STREAMER_OBJ_CONCURRENCY"] == {"value": "12", "source": "environment (RUNAI_STREAMER_CONCURRENCY)"}


@pytest.mark.parametrize(
    ("field", "value"),
    [("obj_concurrency", 0), ("obj_concurrency", 1025), ("s3_target_gbps", 0), ("read_chunk_size", "4MiB"), ("read_chunk_size", "2GiB")],
)
def test_values_run_ai_would_refuse_are_refused_here(field, value):
    with pytest.raises(SettingsError, match=f"^STREAMER_{field.upper()}={value!r}: "):
        Settings(**{field: value})


def test_runai_reads_with_the_values_we_set(daemon, sample):
    """Run:ai 0.17.0's own start-up line (at its DEBUG level) shows the values in force: the
    settings reached its native reader, not only our log."""
    from daemon_harness import finish

    # A long rank timeout: on a loaded machine a healthy rank can be silent for seconds.
    # The sample is a local dir: Run:ai reads it only with STREAMER_LOCAL_READER=runai (else mapped).
    d = daemon({"STREAMER_RANK_TIMEOUT_S": "300", "STREAMER_OBJ_CONCURRENCY": "3", "STREAMER_READ_CHUNK_SIZE": "6MiB",
                "RUNAI_STREAMER_LOG_LEVEL": "DEBUG", "RUNAI_STREAMER_LOG_TO_STDERR": "1", "STREAMER_LOCAL_READER": "runai"})  # fmt: skip
    assert finish(d.start_rank(str(sample), 0, 1, sample, None))["bad"] == []
    log = d.log.read_text()
    assert "s3 concurrency 3 ; s3 block size 6291456 bytes" in log, log[-3000:]
