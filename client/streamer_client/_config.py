"""The client's settings, read from the environment on each call (the client has no pydantic).

The service reads its own settings in ``streamer_service.settings``; these are the few a rank
process needs to find the daemon and its shared memory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


DEFAULT_SOCKET = Path("/run/streamer/daemon.sock")
"""Where ``serve`` listens and ranks look for the daemon when ``STREAMER_SOCKET`` is unset: one
default for the daemon, the client, ``health``, the docs and the manifests (issue 14)."""


@dataclass(frozen=True)
class ClientConfig:
    socket: Path | str | None  # a unix socket path, or tcp://127.0.0.1:PORT; None: DEFAULT_SOCKET
    shm_dir: Path | None  # STREAMER_SHM_DIR; None: where the daemon says its segments are
    launch_id: str | None
    torchelastic_run_id: str | None
    connect_timeout_s: float
    token: str | None
    force_pull: bool | None  # None: unset here, the daemon's own setting applies
    require_daemon: bool  # STREAMER_REQUIRE_DAEMON: no daemon is an error, not in-process mode
    progress: str  # STREAMER_PROGRESS: auto | on | off (see progress.py)


def client_config() -> ClientConfig:
    env = os.environ
    socket = env.get("STREAMER_SOCKET") or None
    return ClientConfig(
        socket=(socket if socket.startswith("tcp://") else Path(socket)) if socket else None,
        shm_dir=Path(env["STREAMER_SHM_DIR"]) if env.get("STREAMER_SHM_DIR") else None,
        launch_id=env.get("STREAMER_LAUNCH_ID") or None,
        torchelastic_run_id=env.get("TORCHELASTIC_RUN_ID") or None,
        connect_timeout_s=float(env.get("STREAMER_CONNECT_TIMEOUT_S") or 5.0),
        token=env.get("STREAMER_TOKEN") or None,
        force_pull=_flag(env.get("TRTLLM_OBJECT_STORAGE_FORCE_PULL") or env.get("STREAMER_FORCE_PULL")),
        progress=(env.get("STREAMER_PROGRESS") or "auto").lower(),
        require_daemon=bool(_flag(env.get("STREAMER_REQUIRE_DAEMON"))),
    )


def _flag(value: str | None) -> bool | None:
    """An environment flag as the service's settings read it (pydantic's bool words)."""
    if value is None or not value.strip():
        return None
    return value.strip().lower() in {"1", "true", "t", "yes", "y", "on"}
