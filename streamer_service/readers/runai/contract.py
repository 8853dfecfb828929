"""The Run:ai version and native entry points this package was written against, and the checks
that refuse anything else (docs/architecture.md).

The native entry points (``runai_model_streamer.libstreamer.libstreamer``) are not public API, so
the distributions are pinned to exactly :data:`PINNED_VERSION` (pyproject),
``tests/test_runai_contract.py`` fails loudly when that changes, and :func:`load_native` checks the
entry points and their parameter names before the first call, raising :class:`ConfigError` naming
what changed instead of handing a changed ABI wrong arguments.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import inspect
import logging
import sys
import threading
from types import ModuleType

from streamer_client.errors import ConfigError

__all__ = [
    "DISTRIBUTIONS",
    "ENTRY_POINTS",
    "FS_STRATEGY_SYMBOL",
    "NATIVE_MODULE",
    "PINNED_VERSION",
    "installed_versions",
    "load_native",
]

log = logging.getLogger(__name__)

PINNED_VERSION = "0.17.0"
"""The one Run:ai version whose native entry points this module was written against."""

DISTRIBUTIONS = (
    "runai-model-streamer",
    "runai-model-streamer-s3",
    "runai-model-streamer-gcs",
    "runai-model-streamer-azure",
)
"""Every part must be :data:`PINNED_VERSION`: mixed versions put .so files of different builds side by side."""

NATIVE_MODULE = "runai_model_streamer.libstreamer.libstreamer"
PACKAGE = NATIVE_MODULE.partition(".")[0]

ENTRY_POINTS: dict[str, tuple[str, ...]] = {
    "runai_start": (),
    "runai_request": ("streamer", "paths", "num_ranges", "range_offsets", "range_sizes", "range_dsts"),
    "runai_response": ("streamer", "timeout_ms"),
    "runai_response_str": ("response_code",),
    "runai_end": ("streamer",),
}
"""The Python wrappers we call in :data:`NATIVE_MODULE`, with their parameter names at 0.17.0."""

FS_STRATEGY_SYMBOL = "runai_file_streamer_set_fs_strategy"
"""C entry point (exported, versioned RUNAI_FILE_STREAMER_1.0) that 0.17.0 has no Python wrapper for.

``int runai_file_streamer_set_fs_strategy(void *streamer, const char *candidates)``: an ordered,
comma-separated preference list (io_uring_direct, io_uring_buffered, libaio_direct, sync_buffered),
set once per streamer, before its first filesystem submission. We call it instead of writing
``RUNAI_STREAMER_FS_STRATEGY`` into ``os.environ``: it is scoped to our streamer, so nothing
process-wide changes and nothing needs restoring."""


def installed_versions() -> dict[str, str | None]:
    """The installed version of each of :data:`DISTRIBUTIONS` (``None`` when missing)."""
    versions: dict[str, str | None] = {}
    for name in DISTRIBUTIONS:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def load_native() -> ModuleType:
    """Import Run:ai's native wrapper (this opens libstreamer.so) and check its contract."""
    try:
        module = _import_native()
    except (ImportError, OSError) as exc:
        raise ConfigError(
            f"cannot load Run:ai's native reader ({NATIVE_MODULE}): {exc}; "
            f"install runai-model-streamer=={PINNED_VERSION} (all of {', '.join(DISTRIBUTIONS)})"
        ) from exc
    problems = _contract_problems(module)
    if problems:
        raise ConfigError(
            f"Run:ai's native entry points changed ({'; '.join(problems)}); streamer-service needs "
            f"runai-model-streamer=={PINNED_VERSION}, installed: {installed_versions()}"
        )
    _warn_if_version_differs()
    return module


_IMPORT_LOCK = threading.Lock()
_native: ModuleType | None = None


def _import_native() -> ModuleType:
    """Run:ai's native wrapper, imported without running its package's ``__init__`` unless
    something in this process imported the package already (then that wrapper is the one used).

    The package's ``__init__`` imports its whole Python surface on the way: torch, its
    safetensors and distributed streamers, and boto3 through its S3 helpers. That is a large
    part of a process's first load (with boto3 installed) and would put torch in every daemon,
    where the wrapper alone needs only ``libstreamer`` and ``s3_utils`` (ctypes
    and the standard library). So while the wrapper is imported, the package's module object
    stands in for it with its ``__init__`` not run, and afterwards the stand-in and every module
    imported under it leave ``sys.modules`` again: a later ``import runai_model_streamer``
    (vLLM's Run:ai loader, ``streamer-service bench`` mode A) runs the real ``__init__`` and
    imports its own copy of the wrapper, over the same library (``dlopen`` of one path gives one
    handle). Imported once per process; a failed import is tried again next time.
    """
    global _native
    with _IMPORT_LOCK:
        if _native is None:
            _native = _import_wrapper_alone() if PACKAGE not in sys.modules else importlib.import_module(NATIVE_MODULE)
        return _native


def _import_wrapper_alone() -> ModuleType:
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None:
        raise ImportError(f"No module named {PACKAGE!r}")
    before = set(sys.modules)
    sys.modules[PACKAGE] = importlib.util.module_from_spec(spec)
    try:
        return importlib.import_module(NATIVE_MODULE)
    finally:
        for name in set(sys.modules) - before:
            if name == PACKAGE or name.startswith(PACKAGE + "."):
                del sys.modules[name]


def _contract_problems(module: ModuleType) -> list[str]:
    problems = []
    for name, params in ENTRY_POINTS.items():
        function = getattr(module, name, None)
        if not callable(function):
            problems.append(f"{name} is missing")
            continue
        found = tuple(inspect.signature(function).parameters)
        if found != params:
            problems.append(f"{name}{found} is not {name}{params}")
    library = getattr(getattr(module, "dll", None), "lib", None)
    if library is None or not hasattr(library, FS_STRATEGY_SYMBOL):
        problems.append(f"C symbol {FS_STRATEGY_SYMBOL} is missing")
    return problems


@functools.lru_cache(maxsize=1)
def _warn_if_version_differs() -> None:
    # The entry points matched, so this may work; the contract test is what refuses to pass.
    # Once per process: every stream starts a reader.
    wrong = {name: v for name, v in installed_versions().items() if v != PINNED_VERSION}
    if wrong:
        log.warning("Run:ai distributions not at the pinned %s: %s", PINNED_VERSION, wrong)
