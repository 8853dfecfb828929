"""What one "launch" is, for force-pull-once semantics.

``TRTLLM_OBJECT_STORAGE_FORCE_PULL=1`` re-downloads the metadata on the first
pull of a launch and reuses it for every other pull of the same launch. The
launch id is, in order:

1. ``STREAMER_LAUNCH_ID`` when set (use it with any launcher: a job id, a pod UID, ...);
2. ``TORCHELASTIC_RUN_ID`` when torchrun set it to something other than ``none``
   (``torchrun --standalone`` or ``--rdzv-id``): every rank of that run shares it;
3. otherwise the parent process, as ``ppid-<pid>-<start time>``: the ranks that one
   launcher process (torchrun, mpirun's orted, a Python spawner) started share it,
   and the start time keeps a recycled PID from looking like the same launch.
"""

from __future__ import annotations

import os

from .settings import Settings

__all__ = ["resolve_launch_id", "process_launch_id"]


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


def resolve_launch_id(settings: Settings, explicit: str | None = None) -> str:
    if explicit:
        return explicit
    if settings.launch_id:
        return settings.launch_id
    if settings.torchelastic_run_id:
        return f"torchelastic-{settings.torchelastic_run_id}"
    return process_launch_id(os.getppid())
