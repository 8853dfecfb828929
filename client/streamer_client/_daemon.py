"""Daemon mode: join the node daemon's load session, map its segments, yield tensors.

The protocol is ``streamer_client._protocol`` (both sides import it; routes in
``streamer_service/daemon/api.py``). Segments are files in the daemon's shm dir (its join reply says
where; ``STREAMER_SHM_DIR`` overrides that where the rank mounts the same dir elsewhere), mapped
once per process and reused as the daemon recycles them (``segments``).

How a batch's bytes become tensors (``delivery``, shared with the embedded engine):

- CPU, owned: the native copier's threads copy the whole batch into new tensors; the batch is
  released to the daemon before its tensors are yielded;
- CPU, ``borrowed=True``: views of a private mapping, released when the next batch is asked for;
- CUDA, staged (``STREAMER_PIN_SEGMENTS=never``, and with ``auto`` a load the daemon serves whole
  from memory, or a process's first load of small-page segments that do not recycle): the
  copier's threads copy the segment, a window at a time, into the process's small page-locked
  staging ring, each window's host-to-device copy overlapping the next window; the batch is
  released as soon as its bytes are staged. The windows of successive replies form one stream: the
  last window of a reply is still being filled while the next reply is asked for. Nothing the
  size of the checkpoint is page-locked;
- CUDA, pinned (``always``, and with ``auto`` segments the daemon streams to a reloading process,
  huge-page ones, or a ring the daemon keeps to the slots it recycles, ``JoinReply.ring_slots``):
  each segment is page-locked once per process (on a worker thread, ahead of its copies) and
  copied from directly; the batch is released once its copies completed.

Every handle is checked against the segment as this rank mapped it before a byte is read
(:func:`handles.check`). A load ends, however it ends (finished, closed, dropped before its first item,
failed), in one order (``receiver.Receiver._end``): the copies out of the segments drained, then
``leave`` (from then on the daemon may write other bytes into them), then the segments unmapped,
then the connection closed.

Every path checks the generation of each segment it read (``fence``) after its bytes are copied
and before its tensors are yielded: a segment the daemon gave new bytes while this rank held it
raises ``SessionError`` naming the tensor (a borrowed view: ``BorrowedTensorError``, checked before
it is lent and when its batch is finished). Page-locked copies are yielded before they land, so
their check runs once they completed: at the latest before the iterator ends and before ``leave``.
"""

from __future__ import annotations

import logging
import mmap
import weakref
from collections.abc import Iterator
from pathlib import Path

import torch

from . import _native_copier as copier
from . import _protocol as protocol
from . import _slicing as slicing
from . import errors
from ._connection import DaemonClient
from ._devices import resolve_device
from ._dtypes import torch_dtypes
from ._fence import Fence, unfenced
from ._progress import track
from ._protocol import JoinReply
from ._receiver import Receiver, leave
from ._request import StreamRequest
from ._settings import Settings
from .errors import ConfigError

__all__ = ["DaemonClient", "daemon_stream"]  # DaemonClient: re-exported from .connection

log = logging.getLogger(__name__)


def daemon_stream(client: DaemonClient, request: StreamRequest) -> Iterator[tuple[str, torch.Tensor]]:
    """Join (eagerly: selection errors raise here) and return the iterator over the tensors.
    ``request.launch_id`` is resolved already. The load owns ``client``: closed when the iterator
    ends, is closed or is dropped (or when the join fails)."""
    try:
        return _joined(client, request)
    except BaseException:
        client.close()
        raise


def _joined(client: DaemonClient, request: StreamRequest) -> Iterator[tuple[str, torch.Tensor]]:
    device = resolve_device(request.device)
    cfg = Settings()
    body = protocol.JoinRequest(
        uri=request.uri, session=request.session_key, rank=request.rank, world_size=request.world_size,
        select=list(request.select) if request.select is not None else None,
        priority=list(request.priority) if request.priority else None, launch_id=request.launch_id,
        force=cfg.if_given("force_pull"), pins=device.type == "cuda" and not request.borrowed and cfg.pin_segments != "never",
        dtypes=sorted(torch_dtypes()),
        fence=True,
        slices=slicing.to_wire(request.slices) if request.slices else None,
    )  # fmt: skip
    # Blocks until every rank joined; the daemon enforces the join timeout.
    try:
        reply = client.call(protocol.JOIN_PATH, body.to_wire(), read_timeout=None)
    except ConfigError as exc:
        if "body.fence: Extra inputs" in exc.message:
            raise unfenced(client.socket) from None  # a daemon from before the fence refused the field
        if "body.slices: Extra inputs" in exc.message:
            raise errors.DaemonError(
                f"streamer daemon at {client.socket} does not take slices: it is older than this client; upgrade "
                'the daemon before the clients (docs/client.md, "Upgrades"), or load whole tensors'
            ) from None
        raise
    joined = JoinReply.from_wire(reply)
    try:
        shm_dir = cfg.if_given("shm_dir") or Path(joined.shm_dir)
        if joined.generations is None:
            raise unfenced(client.socket)
        copier.share_host(request.world_size)  # the session's ranks share this node's CPUs
        receiver = Receiver(
            client,
            shm_dir,
            joined.session_id,
            request.rank,
            device,
            request.borrowed,
            pin_segments=cfg.pin_segments,
            nbytes=joined.bytes,
            huge_pages=joined.shm_page_size > mmap.PAGESIZE,
            from_memory=joined.from_memory,
            recycled=joined.ring_slots > 0,
            fence=Fence(shm_dir / joined.generations, joined.session_id),
            slices=request.slices,
        )
    except BaseException as exc:
        # Joined, and nothing to read with: leave now, or the other ranks wait for this one.
        leave(client, protocol.rank_path(joined.session_id, request.rank, "leave"), exc)
        raise
    tensors = _Tensors(receiver)
    if request.progress == "off":
        return tensors
    return track(tensors, total=joined.bytes, desc=f"rank {request.rank}", mode=request.progress)


class _Tensors(Iterator[tuple[str, torch.Tensor]]):
    """The iterator a daemon load returns. The rank joined already and leaves however the load
    ends: when the iteration ends or fails, when it is closed, and when it is closed, dropped or
    garbage-collected before its first item (a generator's ``finally`` runs only once it
    started: left to it, a rank that never asked for an item would hold the other ranks of its
    session until the daemon's rank timeout)."""

    def __init__(self, receiver: Receiver) -> None:
        self._tensors = receiver.run()
        self._unstarted = weakref.finalize(self, receiver.abandon_unstarted)

    def __next__(self) -> tuple[str, torch.Tensor]:
        return next(self._tensors)

    def close(self) -> None:
        """Stop the load now: the rank leaves the session, whether it asked for an item or not."""
        self._tensors.close()
        self._unstarted()
