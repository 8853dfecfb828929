"""The service's settings: the one :class:`Settings` value, read by the daemon through pydantic-settings.

The schema — every field's variable, type, default and parser — is ``streamer_client._settings``
(the client cannot import the service, and reads it without pydantic). This module builds the
daemon's pydantic-settings model from that table and turns what the model read into the same
:class:`Settings` value the rest of the service takes; nothing here lists a field again.

pydantic is imported when the model is first needed (:func:`get_settings`,
:func:`read_settings`), not with this module: the modules that only take a :class:`Settings`
(the whole in-process load path) import no pydantic. Cloud SDKs keep reading their standard
variables themselves (``AWS_ENDPOINT_URL``, ``STORAGE_EMULATOR_HOST``, ...); see
docs/configuration.md for the full table.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any

from streamer_client._settings import (
    DEFAULT_SOCKET,
    MIN_SHM_BUDGET,
    SETTINGS,
    Settings,
    check_names,
    default_cache_dir,
    problem,
)  # fmt: skip
from streamer_client.errors import SettingsError

from .sizing import FEW_SLOTS, slot_bytes

if TYPE_CHECKING:
    from pydantic import ValidationError
    from pydantic_settings import BaseSettings

__all__ = [
    "DEFAULT_SOCKET", "MIN_SHM_BUDGET", "Settings", "SettingsError", "default_cache_dir", "few_slots_warning",
    "get_settings", "read_settings", "settings_model",
]  # fmt: skip

_BY_VARIABLE = {name: row for row in SETTINGS for name in row.env}


@functools.cache
def settings_model() -> type[BaseSettings]:
    """The pydantic-settings model of the table: per field its type, its default, its variables
    as aliases and its row's parser as the validator. Arguments go by the first alias (by name,
    pydantic-settings would also read a variable spelled like the field)."""
    from pydantic import AliasChoices, Field, PlainValidator, create_model
    from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

    class _Base(BaseSettings):
        # The plain reader's rules (streamer_client._settings): exact names, an empty variable is
        # unset, defaults are not parsed, every value goes through the row's parser.
        model_config = SettingsConfigDict(
            case_sensitive=True, env_ignore_empty=True, validate_default=False, extra="ignore", frozen=True,
            arbitrary_types_allowed=True,
        )  # fmt: skip

    fields: dict[str, Any] = {}
    for row in SETTINGS:
        default = {"default_factory": row.factory} if row.factory is not None else {"default": row.default}
        # NoDecode: the text goes to the parser as it is (pydantic-settings would read a list-typed
        # variable as JSON first).
        annotation = Annotated[row.type, NoDecode, PlainValidator(row.parse)]
        fields[row.name] = (annotation, Field(validation_alias=AliasChoices(*row.env), description=row.doc, **default))
    return create_model("SettingsModel", __base__=_Base, __doc__="The settings table as a pydantic-settings model.", **fields)


def read_settings(overrides: Mapping[str, Any] | None = None, *, arguments: Mapping[str, str] | None = None) -> Settings:
    """The environment's settings with ``overrides`` on top, read through :func:`settings_model`.

    Same contract as ``streamer_client._settings.read_settings``: :class:`SettingsError` naming
    each bad variable (or, with ``arguments``, each bad argument by its public name).
    """
    from pydantic import ValidationError

    overrides = dict(overrides or {})
    check_names(overrides)
    try:
        model = settings_model()(**{getattr(Settings, name).env[0]: value for name, value in overrides.items()})
    except ValidationError as exc:
        raise SettingsError(_describe(exc, overrides, arguments)) from None
    return Settings.from_values({row.name: getattr(model, row.name) for row in SETTINGS}, model.model_fields_set)


def _describe(exc: ValidationError, overrides: Mapping[str, Any], arguments: Mapping[str, str] | None) -> str:
    """pydantic's errors in the plain reader's words (``STREAMER_SHM_BUDGET='lots': ...``)."""
    problems = []
    for error in exc.errors():
        row = _BY_VARIABLE[str(error["loc"][0])]  # arguments go by the first variable too
        # A parser's ValueError comes back as pydantic's "value_error" with the exception itself.
        cause = (error.get("ctx") or {}).get("error")
        message = str(cause) if error["type"] == "value_error" and cause is not None else error["msg"]
        problems.append(
            problem(row, error["input"], message, environ=os.environ, arguments=arguments, passed=row.name in overrides)
        )
    return "; ".join(problems)


def few_slots_warning(settings: Settings) -> str | None:
    """What to warn about when the budget holds fewer than a few slots of the configured size."""
    budget, slot = int(settings.shm_budget), int(settings.slot_size)
    shrunk = slot_bytes(budget, slot)
    if shrunk == slot:
        return None
    return (
        f"STREAMER_SHM_BUDGET ({budget} bytes) holds fewer than {FEW_SLOTS} slots of STREAMER_SLOT_SIZE "
        f"({slot} bytes): slots shrink to {shrunk} bytes and loads of many tensors "
        "take more requests; raise the budget for speed"
    )


@functools.lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings, read once through :func:`settings_model`. Tests build
    ``Settings(...)`` directly."""
    return read_settings()
