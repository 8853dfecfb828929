"""The bridge to the in-process engine (no daemon): imports streamer_service lazily.

Rank containers that only talk to a daemon never import the service, its cloud
SDKs or Run:ai; this module is the one place that does, on first embedded use.
"""

from __future__ import annotations

from pathlib import Path

from .errors import ConfigError
from .settings import Settings, read_settings

# Settings fields whose public argument has another name (for error messages).
_ARGUMENTS = {"shm_budget": "budget"}


def stream_in_process(request):
    """:func:`streamer_service.embedded.stream` for ``request`` (a :class:`StreamRequest`), with
    its budget and cache dir over the configured settings."""
    try:
        from streamer_service.embedded import stream
    except ModuleNotFoundError as exc:
        raise _not_installed(exc) from None
    return stream(request, settings(cache_dir=request.cache_dir, shm_budget=request.budget))


def pull_in_process(uri: str, *, cache_dir: Path | None, force: bool | None, launch_id: str | None) -> Path:
    """The node-cache directory of ``uri``'s metadata, pulled by this process into ``cache_dir``
    (over the configured one). Needs no torch: the metadata cache does not import it."""
    try:
        from streamer_service.metadata import MetadataCache
    except ModuleNotFoundError as exc:
        raise _not_installed(exc) from None
    return MetadataCache(settings(cache_dir=cache_dir)).pull(uri, force=force, launch_id=launch_id)


def _not_installed(exc: ModuleNotFoundError) -> BaseException:
    if exc.name and exc.name.split(".")[0] == "streamer_service":
        return ConfigError(
            "no streamer-service daemon is configured (STREAMER_SOCKET) and the streamer-service "
            "package is not installed for in-process mode: pip install streamer-service"
        )
    return exc


def settings(**overrides) -> Settings:
    """The environment's settings now, with per-call overrides (None means: keep the configured
    value), parsed alike: ``budget="8GiB"`` works, a bad one raises ``SettingsError`` naming it."""
    return read_settings({k: v for k, v in overrides.items() if v is not None}, arguments=_ARGUMENTS)
