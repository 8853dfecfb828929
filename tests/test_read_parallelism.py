"""Run:ai's read parallelism as our settings: what reaches its environment, and what is reported."""

from __future__ import annotations

import pytest

from streamer_client.errors import SettingsError
from streamer_service.readers.runai import read_parallelism_in_force, storage_environment
from streamer_service.settings import Settings


def test_set_values_reach_runais_variables():
    env = storage_environment(Settings(obj_concurrency=32, s3_target_gbps=16, read_chunk_size="32MiB"))
    assert env["RUNAI_STREAMER_OBJ_CONCURRENCY"] == "32"
    assert env["RUNAI_STREAMER_S3_TARGET_GBPS"] == "16"
    assert env["RUNAI_STREAMER_CHUNK_BYTESIZE"] == str(32 * 1024**2)


@pytest.mark.parametrize(
    ("target", "concurrency", "per_client", "chunk"),
    [(25, "8", "4", None), (100, "8", "16", None), (400, "16", "32", str(16 * 1024**2))],
)
def test_the_nic_rate_sets_runais_parallelism(monkeypatch, target, concurrency, per_client, chunk):
    """Run:ai's own concurrency up to 200 Gbit/s, each S3 client 1.25 x its share of the rate, and
    parts of 8 MiB (Run:ai's own, left unset: it applies the variable to local files too) until
    the load would ask more than 3,000 GETs per second."""
    monkeypatch.delenv("RUNAI_STREAMER_CONCURRENCY", raising=False)
    env = storage_environment(Settings(target_gbps=target))
    assert env["RUNAI_STREAMER_OBJ_CONCURRENCY"] == concurrency
    assert env["RUNAI_STREAMER_S3_TARGET_GBPS"] == per_client
    assert env.get("RUNAI_STREAMER_CHUNK_BYTESIZE") == chunk
    # The default is a 100 Gbit/s NIC.
    assert storage_environment(Settings())["RUNAI_STREAMER_S3_TARGET_GBPS"] == "16"


def test_an_operators_runai_concurrency_wins_over_the_nic_rate(monkeypatch):
    monkeypatch.setenv("RUNAI_STREAMER_CONCURRENCY", "2")
    env = storage_environment(Settings(target_gbps=400))
    assert "RUNAI_STREAMER_OBJ_CONCURRENCY" not in env  # Run:ai falls back to the operator's 2
    assert env["RUNAI_STREAMER_S3_TARGET_GBPS"] == "32"
    assert storage_environment(Settings(target_gbps=400, obj_concurrency=4))["RUNAI_STREAMER_OBJ_CONCURRENCY"] == "4"


def test_the_report_names_each_values_source():
    settings = Settings(obj_concurrency=32, shm_budget="4GiB", slot_size="256MiB")
    report = read_parallelism_in_force(settings, environ={"RUNAI_STREAMER_S3_TARGET_GBPS": "40"})
    assert report == {
        "RUNAI_STREAMER_OBJ_CONCURRENCY": {"value": "32", "source": "settings"},
        "RUNAI_STREAMER_S3_TARGET_GBPS": {"value": "40", "source": "environment"},  # the operator's own wins
        "RUNAI_STREAMER_CHUNK_BYTESIZE": {"value": "8388608", "source": "run:ai default"},
        # 100 Gbit/s x 100 ms
        "bytes_in_flight": {"value": "1250000000", "source": "target_gbps=100"},
    }
    derived = read_parallelism_in_force(Settings(target_gbps=400, shm_budget="4GiB", slot_size="256MiB"), environ={})
    assert derived["RUNAI_STREAMER_OBJ_CONCURRENCY"] == {"value": "16", "source": "target_gbps=400"}
    assert derived["RUNAI_STREAMER_CHUNK_BYTESIZE"] == {"value": str(16 * 1024**2), "source": "target_gbps=400"}
    assert derived["bytes_in_flight"] == {"value": str(4 * 1024**3), "source": "target_gbps=400"}  # the budget caps it
    # Run:ai's generic fallback, when ours is unset.
    fallback = read_parallelism_in_force(Settings(), environ={"RUNAI_STREAMER_CONCURRENCY": "12"})
    assert fallback["RUNAI_STREAMER_OBJ_CONCURRENCY"] == {"value": "12", "source": "environment (RUNAI_STREAMER_CONCURRENCY)"}


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("target_gbps", 0),
        ("obj_concurrency", 0),
        ("obj_concurrency", 1025),
        ("s3_target_gbps", 0),
        ("read_chunk_size", "4MiB"),
        ("read_chunk_size", "2GiB"),
    ],
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
