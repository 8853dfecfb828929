"""Progress bars on stderr: bytes, tensors or files done, and the rate (in tqdm's scaled units).

One helper for the CLI (``pull``, ``demo``) and the client (``stream(..., progress=True)``).
tqdm is a dependency of streamer-service but not of streamer-client (rank containers install
only torch and numpy): it is imported only when a bar is asked for, and a
client asked for one without tqdm installed gets a :class:`ConfigError` saying what to install
rather than a silent no-op.

Whether a bar is drawn is the mode (``STREAMER_PROGRESS``, the CLI's ``--progress`` /
``--no-progress``): ``auto`` draws only when stderr is a terminal, so logs of services, CI and
pipes stay free of carriage-return noise; ``on`` always draws; ``off`` never does.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from .errors import ConfigError

if TYPE_CHECKING:
    import torch

__all__ = ["MODES", "check_mode", "require_tqdm", "bar", "track"]

MODES = ("auto", "on", "off")


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ConfigError(f"STREAMER_PROGRESS must be one of auto, on, off; got {mode!r}")
    return mode


class _Quiet:
    """What ``bar`` returns when nothing is drawn: tqdm's methods the callers use, doing nothing."""

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> _Quiet:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


def require_tqdm() -> type:
    """tqdm's bar class, or :class:`ConfigError` saying what to install."""
    try:
        from tqdm import tqdm
    except ImportError:
        raise ConfigError(
            "progress bars need tqdm, which streamer-client does not install: pip install tqdm "
            "(or leave progress off: progress=False, STREAMER_PROGRESS=off)"
        ) from None
    return tqdm


def bar(*, total: int | None, desc: str, mode: str, unit: str = "B") -> Any:
    """A tqdm bar on stderr for ``total`` units (``B``: bytes, scaled to kB/MB/GB), or a quiet one.

    Raises :class:`ConfigError` when the mode may draw and tqdm is not installed.
    """
    if check_mode(mode) == "off":
        return _Quiet()
    tqdm = require_tqdm()
    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        unit_scale=unit == "B",
        unit_divisor=1000,  # GB/s as storage and networks quote it, matching our tables
        file=sys.stderr,
        disable=None if mode == "auto" else False,  # None: tqdm draws only on a terminal
        mininterval=0.25,
        dynamic_ncols=True,
        leave=True,
    )


def track(
    tensors: Iterator[tuple[str, torch.Tensor]], *, total: int | None, desc: str, mode: str
) -> Iterator[tuple[str, torch.Tensor]]:
    """``tensors`` unchanged, counting their bytes on a bar (created now, so errors come eagerly).
    Closing it closes ``tensors`` too, started or not, and dropping it drops them."""
    return _Counted(tensors, bar(total=total, desc=desc, mode=mode))


class _Counted(Iterator):
    """``tensors`` counted on ``progress``; the bar closes when the iteration ends or fails, or
    at :meth:`close`, which closes ``tensors`` too (an abandoned daemon load leaves its session
    then, not at garbage collection). An iterator object, not a generator: a generator's ``close``
    before its first item would not reach ``tensors``."""

    def __init__(self, tensors: Iterator, progress: Any) -> None:
        self._tensors, self._progress = tensors, progress

    def __next__(self) -> tuple[str, torch.Tensor]:
        try:
            name, tensor = next(self._tensors)
        except BaseException:
            self._progress.close()
            raise
        self._progress.update(tensor.numel() * tensor.element_size())
        return name, tensor  # nothing held here: a borrowed view must be free to be recycled

    def close(self) -> None:
        self._progress.close()
        close = getattr(self._tensors, "close", None)
        if close is not None:
            close()
