"""The daemon's wire format: one typed module that the daemon (``streamer_service.api``) and the
client (``streamer_client.daemon``) both import, so the two sides cannot drift apart.

Requests are JSON bodies (the daemon validates them with its own pydantic models); replies and
errors are built and read here:

- ``POST /v1/sessions/join`` -> :class:`JoinReply`
- ``POST /v1/sessions/{id}/ranks/{rank}/next`` -> :class:`NextReply`, whose handles are
  :class:`Handle` s (a JSON array each: the positional form keeps a reply of 8,192 handles small)
- ``POST /v1/sessions/{id}/ranks/{rank}/leave`` -> ``{"left": bool}``
- an error: ``{"error": {"type", "message", "uri", "key"}}`` with the class name from
  :mod:`streamer_client.errors`, which the client raises again (:func:`error_from_body`).

Nothing here needs torch, numpy or httpx.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import errors
from .errors import DaemonError, StreamerError

__all__ = [
    "JOIN_PATH",
    "Handle",
    "JoinReply",
    "NextReply",
    "error_body",
    "error_from_body",
    "rank_path",
]

JOIN_PATH = "/v1/sessions/join"


def rank_path(session_id: str, rank: int, action: str) -> str:
    """The path of a rank's ``next`` or ``leave`` request."""
    return f"/v1/sessions/{session_id}/ranks/{rank}/{action}"


@dataclass(frozen=True)
class Handle:
    """One tensor of a published batch: ``nbytes`` at ``offset`` of shared-memory ``segment``."""

    batch: int
    segment: str | None  # None: an empty tensor, no bytes
    offset: int
    nbytes: int
    name: str
    dtype: str
    shape: tuple[int, ...]
    dedicated: bool  # an oversized tensor's own segment, unlinked once released

    def to_wire(self) -> list:
        return [self.batch, self.segment, self.offset, self.nbytes, self.name, self.dtype, list(self.shape), self.dedicated]

    @classmethod
    def from_wire(cls, raw: list) -> Handle:
        batch, segment, offset, nbytes, name, dtype, shape, dedicated = raw
        return cls(batch, segment, offset, nbytes, name, dtype, tuple(shape), dedicated)


@dataclass(frozen=True)
class JoinReply:
    session_id: str
    tensors: int  # how many tensors this rank will receive
    bytes: int  # ... and their bytes
    metadata_dir: str
    shm_dir: str  # where the segments are, as the daemon sees it (STREAMER_SHM_DIR overrides it)

    def to_wire(self) -> dict:
        return {
            "session_id": self.session_id,
            "tensors": self.tensors,
            "bytes": self.bytes,
            "metadata_dir": self.metadata_dir,
            "shm_dir": self.shm_dir,
        }

    @classmethod
    def from_wire(cls, data: dict) -> JoinReply:
        return cls(data["session_id"], data["tensors"], data["bytes"], data["metadata_dir"], data["shm_dir"])


@dataclass(frozen=True)
class NextReply:
    handles: tuple[Handle, ...]  # whole batches, in order
    done: bool  # this rank has been handed every tensor

    def to_wire(self) -> dict:
        return {"handles": [h.to_wire() for h in self.handles], "done": self.done}

    @classmethod
    def from_wire(cls, data: dict) -> NextReply:
        return cls(tuple(Handle.from_wire(raw) for raw in data["handles"]), data["done"])


def error_body(type_name: str, message: str, *, uri: str | None = None, key: str | None = None) -> dict:
    """The JSON body of an error reply."""
    return {"error": {"type": type_name, "message": message, "uri": uri, "key": key}}


def error_from_body(data: Any, status: int, where: object) -> StreamerError:
    """The error an error reply stands for: its class from :mod:`streamer_client.errors`
    (``StreamerError`` for an unknown one), or ``DaemonError`` for a body not in this format."""
    info = data.get("error") if isinstance(data, dict) else None
    if not isinstance(info, dict):
        return DaemonError(f"streamer daemon at {where} answered {status}: {data!r}")
    cls = getattr(errors, str(info.get("type")), None)
    if not (isinstance(cls, type) and issubclass(cls, StreamerError)):
        cls = StreamerError
    return cls(str(info.get("message")), uri=info.get("uri"), key=info.get("key"))
