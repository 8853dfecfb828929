"""One rank's load as a value: what :func:`streamer_client.stream` was asked for.

The one declared entry point between the public API and the two ways of loading: the daemon
client (``streamer_client._daemon.daemon_stream``) and in-process mode
(``streamer_service.embedded.backend.stream``) each take a :class:`StreamRequest`, instead of a dozen
keyword arguments passed along twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ._settings import parse_argument
from ._slicing import Slices
from .errors import ConfigError

__all__ = ["StreamRequest", "target"]


@dataclass(frozen=True)
class StreamRequest:
    uri: str
    select: tuple[str, ...] | None = None  # tensor names and/or name prefixes; None: every tensor
    priority: tuple[str, ...] | None = None  # delivered first, in the order of the entries
    rank: int = 0
    world_size: int = 1
    device: str = "cpu"
    borrowed: bool = False
    launch_id: str | None = None
    session: str | None = None  # the ranks' shared load (daemon mode); None: launch id and URI
    progress: str = "off"  # the bar mode, already checked: off | on | auto
    budget: int | str | None = None  # in-process buffer budget; None: STREAMER_SHM_BUDGET
    cache_dir: Path | None = None  # in-process metadata cache; None: STREAMER_CACHE_DIR
    slices: Slices | None = None  # the parts of tensors this rank keeps (streamer_client._slicing), parsed

    def __post_init__(self) -> None:
        """The checks both modes share, before a daemon is asked or storage is read."""
        if not (0 <= self.rank < self.world_size):
            raise ConfigError(f"rank {self.rank} is outside world_size {self.world_size}")
        target(self.device, self.borrowed)
        if self.budget is not None:
            parse_argument("shm_budget", self.budget, "budget")
        if self.cache_dir is not None:  # a path or a str: refused naming the argument otherwise
            object.__setattr__(self, "cache_dir", parse_argument("cache_dir", self.cache_dir, "cache_dir"))

    def in_process_only(self) -> list[str]:
        """The arguments given that only an in-process load uses (a daemon has its own)."""
        return [name for name, value in (("budget", self.budget), ("cache_dir", self.cache_dir)) if value is not None]

    @property
    def session_key(self) -> str:
        """The daemon session this rank joins (needs the launch id resolved)."""
        return self.session or f"{self.launch_id}:{self.uri}"


def target(device, borrowed: bool):
    """The ``torch.device`` a load delivers to, checked: borrowed views are CPU memory (said
    before whether the device exists), and the device must be usable here."""
    import torch

    from ._devices import resolve_device

    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError, ValueError) as exc:
        raise ConfigError(f"unusable device {device!r}: {exc}") from None
    if borrowed and kind != "cpu":
        raise ConfigError(f"borrowed views are CPU memory; device {device!r} needs a copy anyway")
    return resolve_device(device)
