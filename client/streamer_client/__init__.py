"""streamer_client: checkpoint tensors for one rank, from the node daemon or in-process.

Public API (the names other projects rely on)::

    pull_metadata(uri, *, cache_dir=None, force=None) -> pathlib.Path
"""

from __future__ import annotations

import os
from pathlib import Path

from . import errors
from .errors import StreamerError

__all__ = ["pull_metadata", "errors", "StreamerError", "__version__"]

__version__ = "0.1.0"


def pull_metadata(
    uri: str | os.PathLike,
    *,
    cache_dir: str | os.PathLike | None = None,
    force: bool | None = None,
    launch_id: str | None = None,
) -> Path:
    """Pull the config, tokenizer and code of checkpoint ``uri`` into the node cache.

    Returns the local directory (``transformers.AutoConfig.from_pretrained`` can read it).
    ``force=None`` follows ``TRTLLM_OBJECT_STORAGE_FORCE_PULL``; a forced pull
    re-downloads once per launch (see docs/metadata-cache.md).
    """
    from ._embedded import service, settings

    metadata = service("metadata")
    cfg = settings(cache_dir=Path(cache_dir) if cache_dir is not None else None)
    return metadata.MetadataCache(cfg).pull(uri, force=force, launch_id=launch_id)
