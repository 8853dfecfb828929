"""What a fresh daemon's first load would otherwise wait for, done on a thread as the daemon starts:
opening Run:ai's native reader (its ctypes wrapper only, ``runai.contract``: not Run:ai's package,
whose ``__init__`` imports torch and boto3), and preparing the storage SDKs of the object stores it
may read (their imports and botocore's models, which the first client a load makes for its catalog
or its version checks would otherwise build while holding the GIL its loading thread needs;
docs/deploy.md, "Segments made at start")."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Set

from ..storage import prepare_backends
from ..uri import Scheme

__all__ = ["start_preloading"]

log = logging.getLogger(__name__)


def start_preloading(schemes: Set[Scheme]) -> threading.Event:
    """Preload on a thread of its own; the event is set once it is done (the daemon's stats say
    it: a benchmark counts a daemon's reads only once its preloading read what it reads). Not a
    daemon thread: a stop right after start waits the moment it takes (nothing in it waits for the
    network) rather than end the interpreter under an import or a log line."""
    done = threading.Event()
    threading.Thread(target=_preload, args=(frozenset(schemes), done), name="preload").start()
    return done


def _preload(schemes: frozenset[Scheme], done: threading.Event) -> None:
    try:
        _prepare(schemes)
    finally:
        done.set()


def _prepare(schemes: frozenset[Scheme]) -> None:
    from ..readers.runai.contract import load_native

    try:
        load_native()
    except Exception as exc:  # noqa: BLE001 - the first load that needs it raises it as a ConfigError
        log.debug("Run:ai's native reader not preloaded: %s", exc)
    started, ordered = time.monotonic(), sorted(schemes)
    failed = prepare_backends(ordered)
    prepared = ", ".join(scheme.value for scheme in ordered if scheme not in failed)
    not_prepared = "".join(f"; not {scheme.value}: {type(exc).__name__}: {exc}" for scheme, exc in failed.items())
    log.info(
        "storage backends prepared at start (%.2f s): %s%s",
        time.monotonic() - started, prepared or ("none" if failed else "none (local dirs only)"), not_prepared,
    )  # fmt: skip
