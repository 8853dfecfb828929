"""The two readers of the settings table agree: the client's plain reader and the daemon's
pydantic-settings model give the same value, or the same error, for every field and input."""

from __future__ import annotations

import contextlib
import os
import typing
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from streamer_client import _settings as plain
from streamer_client.errors import SettingsError
from streamer_service import settings as service

VARIABLES = sorted({name for row in plain.SETTINGS for name in row.env})
# Names are case-sensitive: a variable in another case is no setting, for either reader.
NAMES = VARIABLES + [name.lower() for name in VARIABLES] + [name.title() for name in VARIABLES]

# Words each kind of parser treats specially, in several cases, beside arbitrary text.
INTERESTING = [
    "", " ", "0", "1", "-1", "+5", " 3 ", "3.0", "1_000", "0x10", "1e3", "nan", "inf", "-inf",
    "true", "TRUE", "yes", "On", "off", "f", "maybe", "none", "None", "null",
    "64KiB", "65535", "65536", "1", "4GiB", "4 gib", "1.5GB", "5MiB", "1GiB", "2GiB", "10k", "1Gbit", "4GiB junk",
    "auto", "ON", "path", "Virtual", "mapped", "RUNAI", "json", "TEXT", "debug", "Warning", "trace",
    "a, b", "a  b,c", '["a b"]', "[1]", "[", "{}", "tcp://127.0.0.1:1", "/tmp/x", "rel/dir", "//double",
]  # fmt: skip
texts = st.one_of(
    st.sampled_from(INTERESTING), st.text(st.characters(exclude_categories=("Cs",), exclude_characters="\x00"), max_size=10)
)
environments = st.dictionaries(st.sampled_from(NAMES), texts, max_size=8)
python_values = st.one_of(
    texts, st.integers(-(2**40), 2**40), st.floats(allow_nan=True), st.booleans(), st.none(),
    st.lists(st.text(max_size=3), max_size=2), st.builds(Path, st.sampled_from(["/x", "y"])),
)  # fmt: skip
overrides = st.dictionaries(st.sampled_from([row.name for row in plain.SETTINGS]), python_values, max_size=3)


@contextlib.contextmanager
def environment(env: dict[str, str]):
    """The process environment with exactly ``env`` of the table's variables (hypothesis runs
    many examples in one test, so no function-scoped monkeypatch)."""
    saved = {name: os.environ.pop(name) for name in NAMES if name in os.environ}
    os.environ.update(env)
    try:
        yield
    finally:
        for name in env:
            os.environ.pop(name, None)
        os.environ.update(saved)


def outcome(read, *args, **kwargs):
    try:
        value = read(*args, **kwargs)
    except SettingsError as exc:
        return ("error", str(exc))
    return ("value", value, value.given)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(env=environments)
@example(env={"STREAMER_FORCE_PULL": "maybe"})  # the client read an unknown flag word as false
@example(env={"STREAMER_PROGRESS": "ON"})  # the daemon refused the upper case the client read
@example(env={"TORCHELASTIC_RUN_ID": "none"})  # torchrun's "no id"
@example(env={"TRTLLM_OBJECT_STORAGE_FORCE_PULL": "", "STREAMER_FORCE_PULL": "1"})  # empty is unset
@example(env={"STREAMER_SHM_BUDGET": "lots", "STREAMER_SOCKET": "tcp://127.0.0.1:9"})
@example(env={"streamer_shm_budget": "1"})
def test_both_readers_read_the_environment_alike(env):
    with environment(env):
        assert outcome(plain.read_settings) == outcome(service.read_settings) == outcome(plain.Settings)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(env=environments, passed=overrides, named=st.booleans())
@example(env={}, passed={"shm_budget": "1"}, named=True)
def test_both_readers_take_arguments_alike(env, passed, named):
    arguments = {"shm_budget": "budget"} if named else None
    with environment(env):
        assert outcome(plain.read_settings, passed, arguments=arguments) == outcome(
            service.read_settings, passed, arguments=arguments
        )


def test_the_model_is_the_table():
    """Every field of the daemon's model comes from its row: type, default, variables, doc."""
    model = service.settings_model()
    assert list(model.model_fields) == [row.name for row in plain.SETTINGS]
    for row in plain.SETTINGS:
        field = model.model_fields[row.name]
        assert typing.get_args(field.annotation)[:1] == (row.type,) or field.annotation == row.type, row.name
        assert tuple(field.validation_alias.choices) == row.env
        assert field.description == row.doc
        if row.factory is None:
            assert field.default == row.default
        else:
            assert field.default_factory is row.factory


@pytest.mark.parametrize("row", plain.SETTINGS, ids=lambda row: row.name)
def test_every_default_is_a_value_its_parser_accepts(row):
    default = row.default_value()
    assert row.parse(default) == default
