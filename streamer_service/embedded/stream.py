"""In-process mode: the client API without a daemon (one process, no shared memory)."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from streamer_client._progress import track
from streamer_client._request import StreamRequest
from streamer_client._slicing import kept_bytes

from ..checkpoint.open import open_checkpoint
from ..checkpoint.versions import ObjectVersions
from ..readers.runai import check_credentials
from ..settings import Settings
from .engine import EmbeddedEngine, EngineConfig

__all__ = ["stream"]


def stream(request: StreamRequest, settings: Settings) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` pairs of ``request.uri`` in plan order.

    Everything that can be refused — the URI, the checkpoint, the selection, the
    device — is refused here, before the first byte of tensor data is read.
    """
    checkpoint = open_checkpoint(request.uri, settings, launch_id=request.launch_id)
    check_credentials(checkpoint.uri, settings)
    versions = ObjectVersions.of(checkpoint, settings)
    engine = EmbeddedEngine(checkpoint.uri, checkpoint.catalog, EngineConfig.from_settings(settings), versions=versions)
    select = list(request.select) if request.select is not None else None
    plan = engine.plan(select, list(request.priority) if request.priority else None, request.slices)
    tensors = engine.stream(plan, device=request.device, borrowed=request.borrowed)
    if request.progress == "off":
        return tensors
    total = kept_bytes(plan.tensors, plan.cuts)
    return track(tensors, total=total, desc=checkpoint.uri.normalized, mode=request.progress)
