"""In-process mode: the client API without a daemon (one process, no shared memory)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from streamer_client.progress import track

from .checkpoint import open_checkpoint
from .engine import EmbeddedEngine, EngineConfig
from .runai import check_credentials
from .settings import Settings
from .versions import ObjectVersions

__all__ = ["stream"]


def stream(
    uri: str,
    settings: Settings,
    *,
    select: Sequence[str] | None = None,
    priority: Sequence[str] | None = None,
    device: str | torch.device = "cpu",
    borrowed: bool = False,
    launch_id: str | None = None,
    progress: str = "off",
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` pairs of ``uri`` in plan order.

    Everything that can be refused — the URI, the checkpoint, the selection, the
    device — is refused here, before the first byte of tensor data is read.
    """
    checkpoint = open_checkpoint(uri, settings, launch_id=launch_id)
    check_credentials(checkpoint.uri, settings)
    versions = ObjectVersions.of(checkpoint, settings)
    engine = EmbeddedEngine(checkpoint.uri, checkpoint.catalog, EngineConfig.from_settings(settings), versions=versions)
    plan = engine.plan(list(select) if select is not None else None, list(priority) if priority else None)
    tensors = engine.stream(plan, device=device, borrowed=borrowed)
    if progress == "off":
        return tensors
    total = sum(t.nbytes for t in plan.tensors)
    return track(tensors, total=total, desc=checkpoint.uri.normalized, mode=progress)
