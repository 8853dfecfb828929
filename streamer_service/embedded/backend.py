"""The in-process backend of ``streamer_client``: registered in the entry point group
``streamer_client.backends`` as ``in_process`` (``pyproject.toml``), found by
``streamer_client._in_process`` on a rank's first load without a daemon.

Importing this module is cheap: each function imports what it needs when called, so a pull of
metadata imports neither torch nor Run:ai.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from streamer_client._request import StreamRequest

    from ..settings import Settings

__all__ = ["pull", "stream"]


def stream(request: StreamRequest, settings: Settings) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` pairs of ``request.uri`` in plan order, read by this process."""
    from .stream import stream as stream_here

    return stream_here(request, settings)


def pull(uri: str, settings: Settings, *, force: bool | None, launch_id: str | None) -> Path:
    """The node-cache directory of ``uri``'s metadata, pulled by this process."""
    from ..metadata.cache import MetadataCache

    return MetadataCache(settings).pull(uri, force=force, launch_id=launch_id)
