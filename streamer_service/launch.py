"""The launch id of this process, from the service settings (rules: ``streamer_client.launch``)."""

from __future__ import annotations

from streamer_client.launch import process_launch_id, resolve_launch_id as _resolve

from .settings import Settings

__all__ = ["resolve_launch_id", "process_launch_id"]


def resolve_launch_id(settings: Settings, explicit: str | None = None, fallback: str | None = None) -> str:
    return _resolve(explicit, settings.launch_id, settings.torchelastic_run_id, fallback)
