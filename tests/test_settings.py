import os
import re
from pathlib import Path

import pytest

import streamer_client
from streamer_client._settings import SETTINGS, Secret
from streamer_client.errors import ConfigError, SettingsError
from streamer_service.settings import Settings, get_settings, read_settings

DOCS = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"


def test_every_setting_is_documented():
    documented = set(re.findall(r"`([A-Z][A-Z0-9_]+)`", DOCS.read_text()))
    for row in SETTINGS:
        assert documented & set(row.env), f"setting {row.name} ({row.env}) missing from docs/configuration.md"


def test_force_pull_reads_the_trtllm_variable(monkeypatch):
    monkeypatch.setenv("TRTLLM_OBJECT_STORAGE_FORCE_PULL", "1")
    assert Settings().force_pull is True
    monkeypatch.setenv("TRTLLM_OBJECT_STORAGE_FORCE_PULL", "0")
    assert Settings().force_pull is False


def test_torchrun_none_is_no_run_id(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    assert Settings().torchelastic_run_id is None
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc")
    assert Settings().torchelastic_run_id == "abc"


def test_sizes_and_bad_values(monkeypatch):
    monkeypatch.setenv("STREAMER_SHM_BUDGET", "512MiB")
    assert Settings().shm_budget == 512 * 1024**2
    monkeypatch.setenv("STREAMER_LOCK_TIMEOUT_S", "-1")
    with pytest.raises(SettingsError, match=r"^STREAMER_LOCK_TIMEOUT_S='-1': -1 must be more than 0$"):
        Settings()


def test_secrets_never_printed(monkeypatch):
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_KEY", "SUPERSECRETKEY")
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", "AccountKey=SUPERSECRETKEY")
    for s in (Settings(), read_settings()):
        assert "SUPERSECRETKEY" not in repr(s) and "SUPERSECRETKEY" not in str(s)
        assert s.azure_storage_account_key == Secret("SUPERSECRETKEY")
        assert s.azure_storage_account_key.get_secret_value() == "SUPERSECRETKEY"


def test_client_public_surface():
    assert set(streamer_client.__all__) >= {"pull_metadata", "errors", "StreamerError"}
    for name in streamer_client.__all__:
        assert hasattr(streamer_client, name)


def test_allow_and_patterns_take_plain_lists(monkeypatch):
    """STREAMER_ALLOW takes commas or spaces; a JSON list still works (for paths with spaces)."""
    monkeypatch.setenv("STREAMER_ALLOW", "s3://bucket/models/, gs://other/m  az://cont/x")
    monkeypatch.setenv("STREAMER_METADATA_PATTERNS", "*.md")
    assert Settings().allow == ("s3://bucket/models/", "gs://other/m", "az://cont/x")
    assert Settings().metadata_patterns == ("*.md",)
    monkeypatch.setenv("STREAMER_ALLOW", '["s3://bucket/a"]')
    assert Settings().allow == ("s3://bucket/a",)
    monkeypatch.setenv("STREAMER_ALLOW", '["s3://bucket/a"')
    with pytest.raises(SettingsError, match=r"""^STREAMER_ALLOW='\["s3://bucket/a"': not a JSON list of strings$"""):
        Settings()


def test_a_budget_below_one_slot_is_refused_naming_the_variable(monkeypatch):
    monkeypatch.setenv("STREAMER_SHM_BUDGET", "1")
    message = "STREAMER_SHM_BUDGET='1': a budget of 1 bytes is below one slot (65536 bytes = 64KiB); give e.g. 4GiB"
    for read in (Settings, read_settings):
        with pytest.raises(SettingsError) as info:
            read()
        assert str(info.value) == message
    monkeypatch.setenv("STREAMER_SHM_BUDGET", "64KiB")
    assert Settings().shm_budget == read_settings().shm_budget == 65536


def test_each_bad_value_is_named_once_in_one_line(monkeypatch):
    monkeypatch.setenv("STREAMER_SHM_BUDGET", "lots")
    monkeypatch.setenv("STREAMER_FORCE_PULL", "maybe")  # the variable that was set is the one named
    with pytest.raises(SettingsError) as info:
        read_settings({"slot_size": "0"})
    assert str(info.value) == (
        "STREAMER_SHM_BUDGET='lots': not a size: give e.g. 4GiB, 512MiB or 1000000 (bytes); "
        "STREAMER_SLOT_SIZE='0': 0 bytes must be more than 0 bytes; "
        "STREAMER_FORCE_PULL='maybe': not a flag: give 1, true, yes or on; 0, false, no or off"
    )
    assert isinstance(info.value, ConfigError) and isinstance(info.value, ValueError)


def test_progress_words_are_read_in_any_case_by_both_readers(monkeypatch):
    """The daemon's reader refused ``STREAMER_PROGRESS=ON``, which the client read as ``on``."""
    monkeypatch.setenv("STREAMER_PROGRESS", "ON")
    assert get_settings().progress == Settings().progress == "on"


def test_a_flag_word_neither_reader_knows_is_refused_by_the_client_too(monkeypatch, tmp_path):
    """The client read an unknown flag word as false: ``STREAMER_REQUIRE_DAEMON=yess`` loaded
    in-process, reading storage, instead of refusing the variable."""
    monkeypatch.setenv("STREAMER_REQUIRE_DAEMON", "yess")
    monkeypatch.setenv("STREAMER_SOCKET", str(tmp_path / "nobody.sock"))
    with pytest.raises(SettingsError, match=r"^STREAMER_REQUIRE_DAEMON='yess': not a flag"):
        streamer_client.pull_metadata(str(tmp_path))
    assert not (tmp_path / "cache").exists()


def test_a_bad_variable_in_process_is_our_error_not_pydantics(monkeypatch, sample):
    monkeypatch.setenv("STREAMER_SLOT_SIZE", "lots")
    with pytest.raises(SettingsError, match=r"^STREAMER_SLOT_SIZE='lots': not a size"):
        streamer_client.load_state_dict(str(sample))


def test_given_names_what_was_set_and_replace_parses(monkeypatch):
    monkeypatch.setenv("STREAMER_SHM_DIR", "/somewhere")
    s = Settings(shm_budget="8GiB")
    assert {"shm_dir", "shm_budget"} <= s.given and "slot_size" not in s.given
    assert s.if_given("shm_dir") == Path("/somewhere") and s.if_given("force_pull") is None
    moved = s.replace(cache_dir="/c", slot_size="1MiB")
    assert (moved.cache_dir, moved.slot_size, moved.shm_budget) == (Path("/c"), 1024**2, 8 * 1024**3)
    assert {"cache_dir", "slot_size"} <= moved.given
    with pytest.raises(SettingsError, match=r"^STREAMER_SLOT_SIZE='x': not a size"):
        s.replace(slot_size="x")
    with pytest.raises(TypeError, match="no such setting: shm_budgett"):
        Settings(shm_budgett="1GiB")


def test_the_json_dump_keeps_secrets_out(monkeypatch):
    import json

    monkeypatch.setenv("STREAMER_TOKEN", "SUPERSECRETKEY")
    monkeypatch.setenv("STREAMER_ALLOW", "s3://a/m gs://b/m")
    dumped = Settings().to_json()
    assert "SUPERSECRETKEY" not in dumped
    values = json.loads(dumped)
    assert values["token"] == "**********" and values["allow"] == ["s3://a/m", "gs://b/m"]
    assert values["shm_dir"] == os.environ["STREAMER_SHM_DIR"] and values["shm_budget"] == 4 * 1024**3
