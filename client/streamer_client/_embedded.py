"""The bridge to the in-process engine (no daemon): imports streamer_service lazily.

Rank containers that only talk to a daemon never import the service, its cloud
SDKs or Run:ai; this module is the one place that does, on first embedded use.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from .errors import ConfigError


def service(module: str) -> ModuleType:
    """Import ``streamer_service.<module>`` or say clearly what to install."""
    try:
        return importlib.import_module(f"streamer_service.{module}")
    except ModuleNotFoundError as exc:
        raise _not_installed(exc) from None


def stream_in_process(request):
    """:func:`streamer_service.embedded.stream` for ``request`` (a :class:`StreamRequest`), with
    its budget and cache dir over the configured settings."""
    try:
        from streamer_service.embedded import stream
    except ModuleNotFoundError as exc:
        raise _not_installed(exc) from None
    return stream(request, settings(cache_dir=request.cache_dir, shm_budget=request.budget))


def _not_installed(exc: ModuleNotFoundError) -> BaseException:
    if exc.name and exc.name.split(".")[0] == "streamer_service":
        return ConfigError(
            "no streamer-service daemon is configured (STREAMER_SOCKET) and the streamer-service "
            "package is not installed for in-process mode: pip install streamer-service"
        )
    return exc


def settings(**overrides):
    """The service settings, with per-call overrides (None means: keep the configured value).

    Overrides are validated like the environment is (``budget="8GiB"`` works, a bad one raises).
    """
    module = service("settings")
    update = {k: v for k, v in overrides.items() if v is not None}
    if not update:
        return module.get_settings()
    try:
        return module.Settings(**update)
    except ValueError as exc:  # pydantic's ValidationError
        raise ConfigError(f"invalid argument: {exc}") from None
