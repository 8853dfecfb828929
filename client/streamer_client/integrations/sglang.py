"""SGLang: ``sglang.Engine(**engine_kwargs("s3://bucket/model"))``.

SGLang has no loader registry: ``Engine(load_format=<a loader class>)`` makes SGLang construct that
class (``get_model_loader``: ``isinstance(load_config.load_format, type)``). ``engine_kwargs``
pulls the config and tokenizer with :func:`streamer_client.pull_metadata` (through the daemon when
one answers) and returns ``model_path`` (the pulled dir), ``load_format``
(:class:`.sglang_loader.StreamerModelLoader`) and ``model_loader_extra_config`` (the URI and the
options ``socket``, ``session``, ``budget``, ``borrowed``). This module imports no SGLang.
"""

from __future__ import annotations

import json
import os
from typing import Any

from .. import pull_metadata
from ._engine import LoaderOptions

__all__ = ["engine_kwargs"]


def engine_kwargs(uri: str | os.PathLike, **options: Any) -> dict[str, Any]:
    """Keyword arguments for ``sglang.Engine`` that load ``uri`` through the streamer."""
    uri = os.fspath(uri)
    LoaderOptions.parse({**options, "uri": uri}, where="engine_kwargs")  # bad options fail here, not in a worker
    from .sglang_loader import StreamerModelLoader

    return {
        "model_path": str(pull_metadata(uri)),
        "load_format": StreamerModelLoader,
        "model_loader_extra_config": json.dumps({**options, "uri": uri}),
    }
