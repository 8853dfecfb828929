"""SIGINT and SIGTERM, kept from the start of ``serve`` until the server can act on them.

Python's own SIGINT handler raises KeyboardInterrupt wherever the main thread happens to be. When
that is a finalizer (a ``__del__`` the garbage collector runs while modules import or the app is
built) the exception is printed as ignored and the signal is gone: the daemon starts and serves
as if it had never been told to stop. SIGTERM's default ends the process at once, before the
socket file is removed. While :class:`StopSignals` is entered both are only recorded; the server
acts on what was recorded as it starts (``server._Server``), and ``serve`` ends as the last one
asks once everything is cleaned up. uvicorn takes the signals over while it serves and hands the
ones it acted on back here as it finishes.
"""

from __future__ import annotations

import signal
from types import FrameType, TracebackType

STOPS = (signal.SIGINT, signal.SIGTERM)


class StopSignals:
    """Records SIGINT and SIGTERM while entered (the main thread only); the handlers found are
    restored on exit."""

    def __init__(self) -> None:
        self.received: list[int] = []
        # The daemon stopped while native reads may still write into its memory: the process ends
        # with os._exit once its logs are flushed, never through the interpreter's teardown, which
        # would wait for those reads (cli.main).
        self.exit_at_once = False
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        self._previous = {sig: signal.signal(sig, self._record) for sig in STOPS}
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    @property
    def interrupted(self) -> bool:
        """A SIGINT came: the command ends as interrupted (KeyboardInterrupt, exit 130)."""
        return signal.SIGINT in self.received

    def _record(self, signum: int, frame: FrameType | None) -> None:
        self.received.append(signum)
