import re
from pathlib import Path

import pytest
from pydantic import ValidationError

import streamer_client
from streamer_service.settings import Settings

DOCS = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"


def _env_names(name: str, field) -> list[str]:
    alias = field.validation_alias
    if alias is not None:
        return [str(a) for a in alias.choices]
    return [f"STREAMER_{name.upper()}"]


def test_every_setting_is_documented():
    text = DOCS.read_text()
    documented = set(re.findall(r"`([A-Z][A-Z0-9_]+)`", text))
    for name, field in Settings.model_fields.items():
        names = _env_names(name, field)
        assert documented & set(names), f"setting {name} ({names}) missing from docs/configuration.md"


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
    with pytest.raises(ValidationError, match="lock_timeout_s"):
        Settings()


def test_secrets_never_printed(monkeypatch):
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_KEY", "SUPERSECRETKEY")
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", "AccountKey=SUPERSECRETKEY")
    s = Settings()
    assert "SUPERSECRETKEY" not in repr(s) and "SUPERSECRETKEY" not in str(s)
    assert s.azure_storage_account_key.get_secret_value() == "SUPERSECRETKEY"


def test_client_public_surface():
    assert set(streamer_client.__all__) >= {"pull_metadata", "errors", "StreamerError"}
    for name in streamer_client.__all__:
        assert hasattr(streamer_client, name)


def test_allow_and_patterns_take_plain_lists(monkeypatch):
    """Issue 14: STREAMER_ALLOW needed a JSON list; a plain one failed with a pydantic dump."""
    monkeypatch.setenv("STREAMER_ALLOW", "s3://bucket/models/, gs://other/m  az://cont/x")
    monkeypatch.setenv("STREAMER_METADATA_PATTERNS", "*.md")
    assert Settings().allow == ["s3://bucket/models/", "gs://other/m", "az://cont/x"]
    assert Settings().metadata_patterns == ["*.md"]
    monkeypatch.setenv("STREAMER_ALLOW", '["s3://bucket/a"]')
    assert Settings().allow == ["s3://bucket/a"]


def test_a_budget_below_one_slot_is_refused_naming_the_variable(monkeypatch):
    from pydantic import ValidationError

    from streamer_service.settings import describe_invalid

    monkeypatch.setenv("STREAMER_SHM_BUDGET", "1")
    with pytest.raises(ValidationError) as info:
        Settings()
    assert describe_invalid(info.value) == (
        "STREAMER_SHM_BUDGET='1': Value error, a budget of 1 bytes is below one slot (65536 bytes = 64KiB); give e.g. 4GiB"
    )
    monkeypatch.setenv("STREAMER_SHM_BUDGET", "64KiB")
    assert int(Settings().shm_budget) == 65536
