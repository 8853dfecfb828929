"""streamer_client: checkpoint tensors for one rank, from the node daemon or in-process.

Public API (the names other projects rely on)::

    pull_metadata(uri, *, cache_dir=None, force=None, socket=None, ...) -> pathlib.Path
    stream(uri, *, select=None, rank=0, world_size=1, device="cpu", socket=None, ...)
        -> iterator of (name, torch.Tensor)
    load_state_dict(uri, **same) -> dict[str, torch.Tensor]

with ``errors``, ``StreamerError`` and ``__version__``: ``__all__``, listed in docs/client.md,
"Public API", with the public modules besides (``errors``, ``integrations``). The package's other
modules are internal: their names start with ``_``. Their old names (``streamer_client/_deprecated.py``)
still import, with a ``DeprecationWarning``, until they are removed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from . import _slicing, errors
from ._launch import resolve_launch_id
from ._request import StreamRequest
from ._settings import DEFAULT_SOCKET, Settings, parse_argument
from .errors import StreamerError

if TYPE_CHECKING:
    import torch

    from ._slicing import Slice

__all__ = ["pull_metadata", "stream", "load_state_dict", "errors", "StreamerError", "__version__"]

log = logging.getLogger(__name__)

__version__ = "0.1.0"


def pull_metadata(
    uri: str | os.PathLike,
    *,
    cache_dir: str | os.PathLike | None = None,
    force: bool | None = None,
    launch_id: str | None = None,
    socket: str | os.PathLike | None = None,
    require_daemon: bool = False,
) -> Path:
    """Pull the config, tokenizer and code of checkpoint ``uri`` into the node cache.

    Returns the local directory (``transformers.AutoConfig.from_pretrained`` can read it).
    ``force=None`` follows ``TRTLLM_OBJECT_STORAGE_FORCE_PULL``; a forced pull
    re-downloads once per launch (see docs/metadata-cache.md). The daemon is found as
    :func:`stream` finds it (``socket``, ``require_daemon``); without one this process pulls
    into ``cache_dir`` (default ``STREAMER_CACHE_DIR``) itself.
    """
    if cache_dir is not None:
        cache_dir = parse_argument("cache_dir", cache_dir, "cache_dir")
    client = _daemon_client(socket, require_daemon)
    if client is not None:
        _say_in_process_only(["cache_dir"] if cache_dir is not None else [], client)
        with contextlib.closing(client):
            # The rank's TRTLLM_OBJECT_STORAGE_FORCE_PULL, as stream() sends it: the daemon's
            # environment is not the rank's: a forced stream() must not be served a stale config.
            force = Settings().if_given("force_pull") if force is None else force
            from . import _protocol as protocol

            body = protocol.MetadataRequest(os.fspath(uri), force, launch_id or _launch_id())
            return Path(
                protocol.MetadataReply.from_wire(client.call(protocol.METADATA_PATH, body.to_wire(), read_timeout=None)).path
            )
    from ._in_process import pull_in_process

    return pull_in_process(uri, cache_dir=cache_dir, force=force, launch_id=launch_id)


_said_embedded = False


def _launch_id() -> str:
    return resolve_launch_id(Settings())


def _daemon_client(socket: str | os.PathLike | None, require: bool = False):
    """A client for the daemon (``socket``, ``STREAMER_SOCKET`` or ``DEFAULT_SOCKET``), or None:
    in-process mode, logged once. ``require`` (or ``STREAMER_REQUIRE_DAEMON=1``): none is an error."""
    global _said_embedded
    settings = Settings()
    configured = socket if socket is not None else settings.socket
    path = configured if configured is not None else DEFAULT_SOCKET
    require = require or settings.require_daemon
    if configured is not None or require or os.path.exists(path):
        from ._connection import DaemonClient

        token = settings.token.get_secret_value() if settings.token else None
        client = DaemonClient(path, connect_timeout_s=settings.connect_timeout_s, token=token)
        if client.reachable():
            return client
        client.close()
    if require:
        from .errors import DaemonError

        raise DaemonError(
            f"no streamer daemon answers at {path}, and STREAMER_REQUIRE_DAEMON=1 (or require_daemon=True) "
            "forbids loading in-process: start `streamer-service serve` or point STREAMER_SOCKET at it"
        )
    if not _said_embedded:
        _said_embedded = True
        if configured is not None:
            log.warning("no streamer daemon answers at %s; loading in-process instead", path)
        else:
            log.info("no streamer daemon at %s (STREAMER_SOCKET unset); loading in-process", path)
    return None


def _names(value: str | Sequence[str] | None) -> tuple[str, ...] | None:
    if value is None:
        return None
    return (value,) if isinstance(value, str) else tuple(value)


def stream(
    uri: str | os.PathLike,
    *,
    select: str | Sequence[str] | None = None,
    priority: str | Sequence[str] | None = None,
    slices: Mapping[str, Slice | Sequence[Slice]] | None = None,
    rank: int = 0,
    world_size: int = 1,
    device: str = "cpu",
    socket: str | os.PathLike | None = None,
    borrowed: bool = False,
    budget: int | str | None = None,
    cache_dir: str | os.PathLike | None = None,
    launch_id: str | None = None,
    session: str | None = None,
    progress: bool = False,
    require_daemon: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream the tensors of checkpoint ``uri``: ``(name, tensor)`` in checkpoint order.

    ``select`` takes tensor names and/or name prefixes (default: every tensor);
    ``priority`` prefixes are delivered first. A name or prefix that matches
    nothing, a duplicate or an overlap raises ``SelectionError`` here, before any
    tensor data is read.

    ``slices`` maps selected tensor names to the part of each this rank keeps:
    ``(dim, start, stop)`` in the torch tensor's coordinates (``narrow(dim, start,
    stop - start)``), or a list of them along one dim, concatenated in order (a fused
    layout). The rank receives and copies only those bytes (docs/client.md, "Slices");
    a bound outside its tensor raises ``SelectionError`` before any read.

    Tensors are safe to keep. ``borrowed=True`` yields zero-copy CPU views that
    stay valid only until the next item is requested (docs/client.md).
    ``device="cuda:N"`` yields tensors on that GPU.

    ``rank``/``world_size`` identify this process among the ranks of a launch on
    this node; they matter in daemon mode, where the node reads the union of the
    ranks' selections once. ``session`` names the ranks' shared load (default: the
    launch id and the URI). Without a daemon this process reads its own selection.

    The daemon is found through ``socket``, ``STREAMER_SOCKET`` or the default socket
    (``/run/streamer/daemon.sock``); with none reachable this runs in-process (and says so once
    in the log), unless ``require_daemon=True`` or ``STREAMER_REQUIRE_DAEMON=1``: then it raises
    ``DaemonError`` instead of reading storage itself.

    ``budget`` (e.g. ``"8GiB"``) and ``cache_dir`` size an in-process load: its buffer ring and
    metadata cache. Through a daemon they are checked alike (``SettingsError`` naming the argument)
    but the daemon's own apply (``serve --shm-budget``, its cache), and the client says so once.

    ``progress=True`` draws a bar of this rank's bytes and GB/s on stderr, following
    ``STREAMER_PROGRESS`` (``auto``: only on a terminal). It needs tqdm, which this package does
    not install; without it ``ConfigError`` says so, before anything is loaded.
    """
    request = StreamRequest(
        uri=os.fspath(uri) if isinstance(uri, os.PathLike) else uri,
        select=_names(select),
        priority=_names(priority),
        slices=_slicing.parse(slices),
        rank=rank,
        world_size=world_size,
        device=device,
        borrowed=borrowed,
        launch_id=launch_id,
        session=session,
        progress=_progress_mode(progress),
        budget=budget,
        cache_dir=cache_dir,
    )
    client = _daemon_client(socket, require_daemon)
    if client is not None:
        from ._daemon import daemon_stream

        _say_in_process_only(request.in_process_only(), client)
        return daemon_stream(client, dataclasses.replace(request, launch_id=launch_id or _launch_id()))
    from ._in_process import stream_in_process

    return stream_in_process(request)


def _daemon_serves(socket: str | os.PathLike | None = None, require: bool = False) -> bool:
    """Whether a load with these arguments goes through a daemon (for adapters that size an
    in-process load themselves); raises as the load would when ``require`` finds none."""
    client = _daemon_client(socket, require)
    if client is None:
        return False
    client.close()
    return True


_said_in_process_only: set[str] = set()


def _say_in_process_only(given: list[str], client) -> None:
    """``budget=``/``cache_dir=`` size an in-process load; through a daemon its own settings apply
    (``serve --shm-budget``, its metadata cache). Said (a WARNING and a ``RuntimeWarning``) once per
    process and daemon, not ignored silently: a loader that passes them on every load says it once."""
    if not given:
        return
    message = (
        f"{' and '.join(a + '=' for a in given)} {'applies' if len(given) == 1 else 'apply'} to in-process loads only; the daemon at "
        f"{client.socket} loads with its own (serve --shm-budget, --cache-dir)"
    )
    if message in _said_in_process_only:
        return
    _said_in_process_only.add(message)
    import warnings

    log.warning("%s", message)
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def _progress_mode(asked: bool) -> str:
    """The bar mode for a ``stream`` call: ``off`` unless asked; tqdm checked now, before any work."""
    from . import _progress as progress

    mode = Settings().progress if asked else "off"
    if mode != "off":
        progress.require_tqdm()
    return mode


def load_state_dict(uri: str | os.PathLike, **kwargs) -> dict[str, torch.Tensor]:
    """Every selected tensor of ``uri`` in a dict (takes the arguments of :func:`stream`)."""
    if kwargs.get("borrowed"):
        from .errors import ConfigError

        raise ConfigError("load_state_dict keeps every tensor: borrowed views cannot be kept")
    return dict(stream(uri, **kwargs))


def __getattr__(name: str):
    """An old name of an internal module (``_deprecated.MOVED``) reached as the package's attribute:
    the module, imported under that name (with its ``DeprecationWarning``)."""
    if not name.startswith("_"):
        from ._deprecated import MOVED

        if name in MOVED:
            return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
