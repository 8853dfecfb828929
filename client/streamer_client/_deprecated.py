"""The old names of the package's internal modules, kept for a deprecation period.

Up to streamer-client 0.1.0 the internal modules had names that looked public (``protocol``,
``daemon``, ``settings``, ...); they start with ``_`` now. Each old name is still a module, of
three lines that call :func:`moved`: importing it warns ``DeprecationWarning`` (once: the import
system keeps the module) and gives the private module itself, so that every object, private names
and patches included, is the one the package uses. The old names are removed in streamer-client
0.3.0, ``REMOVED_IN`` (docs/client.md, "Public API"); the package's own code, the service, the tests and
the examples never import them (tests/test_architecture.py).
"""

from __future__ import annotations

import importlib
import os
import sys
import warnings

__all__ = ["MOVED", "REMOVED_IN", "moved"]

REMOVED_IN = "0.3.0"

# Old name -> private module.
MOVED = {
    "connection": "_connection",
    "copier": "_native_copier",  # _copier is the native extension's name
    "counters": "_counters",
    "cuda": "_cuda",
    "daemon": "_daemon",
    "delivery": "_delivery",
    "devices": "_devices",
    "dtypes": "_dtypes",
    "fence": "_fence",
    "handles": "_handles",
    "host_memory": "_host_memory",
    "in_process": "_in_process",
    "launch": "_launch",
    "leases": "_leases",
    "parsers": "_parsers",
    "per_process": "_per_process",
    "pinning": "_pinning",
    "progress": "_progress",
    "protocol": "_protocol",
    "receiver": "_receiver",
    "request": "_request",
    "segments": "_segments",
    "settings": "_settings",
    "slicing": "_slicing",
    "waits": "_waits",
}

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def moved(name: str) -> None:
    """Make the module ``name`` (an old name's ``__name__``) the private module it moved to, and warn."""
    module = importlib.import_module(f"{__package__}.{MOVED[name.rpartition('.')[2]]}")
    warnings.warn(
        f"{name} is an internal module, now {module.__name__}; its old name is deprecated and goes away in "
        f"streamer-client {REMOVED_IN}. Use the public API: streamer_client's __all__ (stream, load_state_dict, "
        'pull_metadata, ...), streamer_client.errors and streamer_client.integrations (docs/client.md, "Public API")',
        DeprecationWarning,
        stacklevel=_importer_level(),
    )
    sys.modules[name] = module  # the import system hands out what sys.modules holds once the module ran


def _importer_level() -> int:
    """The ``stacklevel`` of the code that imported the old name, for :func:`moved`'s warning: the
    frames of this package (the old name's module, the package's ``__getattr__``) and of
    ``importlib.import_module`` are passed over; the import system's own frames are not counted by
    ``warnings`` at all. So the warning names the importer's line, and the default filters show it
    where that is ``__main__``."""
    frame, level = sys._getframe(2), 2  # level 1: moved; 2: the old name's module
    while frame is not None:
        file = frame.f_code.co_filename
        if "importlib" in file and "_bootstrap" in file:
            frame = frame.f_back
            continue
        if not (file.startswith(_PACKAGE_DIR) or file == importlib.__file__):
            return level
        level += 1
        frame = frame.f_back
    return level
