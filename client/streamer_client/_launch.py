"""What one "launch" is: the ranks that one launcher started.

Used for force-pull-once metadata semantics and as the default daemon session
key (the ranks of one launch on one node share one load). In order:

1. an explicit ``STREAMER_LAUNCH_ID`` (a job id, a pod UID, ...);
2. ``TORCHELASTIC_RUN_ID``, which torchrun sets for every rank of a run (its ``none``, torchrun
   without a rendezvous id, is read as unset: ``streamer_client._settings``);
3. the parent process, ``ppid-<pid>-<start time>``: ranks one launcher process started share
   it, and the start time keeps a recycled PID from looking like the same launch.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._settings import Settings

__all__ = ["resolve_launch_id", "process_launch_id", "launch_origin"]


def _start_ticks(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return "0"
    # Field 22 (starttime) follows the parenthesized command name, which may contain spaces.
    fields = stat[stat.rindex(b")") + 2 :].split()
    return fields[19].decode()


def process_launch_id(pid: int) -> str:
    """The launch id naming process ``pid`` (pid plus its start time)."""
    return f"ppid-{pid}-{_start_ticks(pid)}"


def resolve_launch_id(settings: Settings, explicit: str | None = None, fallback: str | None = None) -> str:
    """The launch id by the rules above: ``explicit`` (a ``launch_id=`` argument) first, then the
    settings; ``fallback`` replaces rule 3 (the CLI is its own launch)."""
    if explicit:
        return explicit
    if settings.launch_id:
        return settings.launch_id
    if settings.torchelastic_run_id:
        return f"torchelastic-{settings.torchelastic_run_id}"
    return fallback or process_launch_id(os.getppid())


def launch_origin(launch_id: str) -> str:
    """How ``launch_id`` was derived, read from its form (the daemon gets only the id from a rank)."""
    if launch_id.startswith("torchelastic-"):
        return "from TORCHELASTIC_RUN_ID (torchrun)"
    if launch_id.startswith("ppid-"):
        return (
            f"from the parent process {launch_id.split('-')[1]} (no STREAMER_LAUNCH_ID or torchrun): "
            "processes started by one shell share it"
        )
    if launch_id.startswith("cli-"):
        return "this CLI invocation"
    return "given explicitly (STREAMER_LAUNCH_ID or launch_id=)"
