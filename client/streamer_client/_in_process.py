"""In-process mode (no daemon): the backend that loads in this process, found through an entry point.

The client never imports the service by name. A package that can load in-process registers a
backend in the entry point group :data:`GROUP` under the name :data:`NAME`; ``streamer-service``
registers ``streamer_service.embedded.backend`` there (its ``pyproject.toml``). The group is looked
up on first in-process use only, so a rank that talks to a daemon reads no package metadata and
imports nothing of the service, its cloud SDKs or Run:ai.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from ._settings import Settings, read_settings
from .errors import ConfigError

if TYPE_CHECKING:
    import torch

    from ._request import StreamRequest

__all__ = ["GROUP", "NAME", "PROVIDER", "Backend", "backend", "pull_in_process", "settings", "stream_in_process"]

GROUP = "streamer_client.backends"
NAME = "in_process"
PROVIDER = "streamer-service"  # the distribution that registers it

# Settings fields whose public argument has another name (for error messages).
_ARGUMENTS = {"shm_budget": "budget"}


class Backend(Protocol):
    """What an in-process backend provides (a module with these two functions will do)."""

    def stream(self, request: StreamRequest, settings: Settings) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` pairs of ``request.uri`` in plan order, read by this process."""
        ...

    def pull(self, uri: str, settings: Settings, *, force: bool | None, launch_id: str | None) -> Path:
        """The node-cache directory of ``uri``'s metadata, pulled by this process."""
        ...


@functools.cache
def backend() -> Backend:
    """The registered in-process backend, loaded on first use.

    Looked up in :data:`PROVIDER` 's metadata first (one distribution found by name), then in
    every installed distribution's: reading all of them is a first load's cost in an
    environment with hundreds of packages."""
    from importlib.metadata import PackageNotFoundError, distribution, entry_points

    try:
        found = [ep for ep in distribution(PROVIDER).entry_points if ep.group == GROUP and ep.name == NAME]
    except PackageNotFoundError:
        found = []
    if not found:
        found = [ep for ep in entry_points(group=GROUP) if ep.name == NAME]
    if not found:
        raise ConfigError(
            "no streamer-service daemon is configured (STREAMER_SOCKET) and the streamer-service "
            "package is not installed for in-process mode: pip install streamer-service"
        )
    return found[0].load()


def stream_in_process(request: StreamRequest) -> Iterator[tuple[str, torch.Tensor]]:
    """The backend's stream of ``request``, with its budget and cache dir over the configured settings."""
    return backend().stream(request, settings(cache_dir=request.cache_dir, shm_budget=request.budget))


def pull_in_process(uri: str, *, cache_dir: Path | None, force: bool | None, launch_id: str | None) -> Path:
    """The node-cache directory of ``uri``'s metadata, pulled by this process into ``cache_dir``
    (over the configured one). Needs no torch: the metadata cache does not import it."""
    return backend().pull(uri, settings(cache_dir=cache_dir), force=force, launch_id=launch_id)


def settings(**overrides) -> Settings:
    """The environment's settings now, with per-call overrides (None means: keep the configured
    value), parsed alike: ``budget="8GiB"`` works, a bad one raises ``SettingsError`` naming it."""
    return read_settings({k: v for k, v in overrides.items() if v is not None}, arguments=_ARGUMENTS)
