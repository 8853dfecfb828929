"""The daemon's wire format: one typed module that the daemon (``streamer_service.daemon.api``) and the
client (``streamer_client._daemon``) both import, so the two sides cannot drift apart.

Both directions are typed here: the client builds each request body with its class's
``to_wire`` and reads each reply with ``from_wire``; the daemon validates request bodies with
pydantic models of the same fields (plus their limits; a test compares the two) and builds its
replies with ``to_wire``. Each record is a ``NamedTuple`` (a rank imports this module for its
first load; a dataclass would compile its methods then); a dict-form body is its fields:

- ``POST /v1/metadata``: :class:`MetadataRequest` -> :class:`MetadataReply`
- ``POST /v1/sessions/join``: :class:`JoinRequest` -> :class:`JoinReply`
- ``POST /v1/sessions/{id}/ranks/{rank}/next``: :class:`NextRequest` -> :class:`NextReply`, whose
  handles are :class:`Handle` s (a JSON array each: the positional form keeps a reply of 8,192
  handles small)
- ``POST /v1/sessions/{id}/ranks/{rank}/leave``: :class:`LeaveRequest` -> ``{"left": bool}``
- an error: ``{"error": {"type", "message", "uri", "key"}}`` with the class name from
  :mod:`streamer_client.errors`, which the client raises again (:func:`error_from_body`).

Texts that may echo what a caller sent (an error's message, URI and key; a leaving rank's error)
are at most :data:`ERROR_TEXT_LIMIT` characters on the wire (:func:`clipped`).

Nothing here needs torch, numpy or httpx.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from . import errors
from .errors import DaemonError, StreamerError

__all__ = [
    "ERROR_TEXT_LIMIT",
    "JOIN_PATH",
    "METADATA_PATH",
    "Handle",
    "JoinReply",
    "JoinRequest",
    "LeaveRequest",
    "MetadataReply",
    "MetadataRequest",
    "NextReply",
    "NextRequest",
    "clipped",
    "error_body",
    "error_from_body",
    "rank_path",
    "request_fields",
]

JOIN_PATH = "/v1/sessions/join"
METADATA_PATH = "/v1/metadata"


def rank_path(session_id: str, rank: int, action: str) -> str:
    """The path of a rank's ``next`` or ``leave`` request."""
    return f"/v1/sessions/{session_id}/ranks/{rank}/{action}"


class MetadataRequest(NamedTuple):
    uri: str
    force: bool | None = None  # the caller's force-pull; None: the daemon's setting
    launch_id: str | None = None

    def to_wire(self) -> dict:
        return self._asdict()


class MetadataReply(NamedTuple):
    path: str  # the node-cache directory of the pulled metadata

    def to_wire(self) -> dict:
        return self._asdict()

    @classmethod
    def from_wire(cls, data: dict) -> MetadataReply:
        return cls(data["path"])


class JoinRequest(NamedTuple):
    uri: str
    session: str  # the session key the node's ranks of one load share
    rank: int
    world_size: int
    select: list[str] | None = None
    priority: list[str] | None = None
    launch_id: str | None = None
    force: bool | None = None  # TRTLLM_OBJECT_STORAGE_FORCE_PULL of the rank; None: the daemon's
    # The rank may page-lock the segments it copies from (a CUDA rank): where several of a load's
    # ranks may, its ring is kept to a few recycled slots, each registered once (JoinReply.ring_slots).
    pins: bool = False
    # The safetensors dtypes the rank's torch has (streamer_client._dtypes.torch_dtypes): a selection
    # with a tensor of another is refused at the join, before it is read. None: a rank that does not
    # say; the daemon assumes a torch with every dtype of the table.
    dtypes: list[str] | None = None
    # The rank checks segment generations (Handle.entry, .generation): its NextRequest asks for them
    # too. A daemon from before the fence refuses the field (the client then says to upgrade it).
    fence: bool = False
    # The parts of tensors the rank keeps (streamer_client._slicing.to_wire): checked against the
    # checkpoint at the join. Left off the wire when None: a daemon from before slices refuses the
    # field, and only a rank that slices needs one that takes it.
    slices: dict[str, list[list[int]]] | None = None

    def to_wire(self) -> dict:
        wire = self._asdict()
        if wire["slices"] is None:
            del wire["slices"]
        return wire


class NextRequest(NamedTuple):
    release: list[int]  # batches this rank is done with
    wait_s: float  # how long the daemon may wait for a batch to be ready
    fence: bool = False  # handles in the 10-field form (an older client reads only the 8-field one)

    def to_wire(self) -> dict:
        return self._asdict()


class LeaveRequest(NamedTuple):
    error: str | None = None  # the rank failed with this (None: done, or abandoning)

    def to_wire(self) -> dict:
        return self._asdict()


def request_fields() -> dict[str, tuple[str, ...]]:
    """Each request body's field names, by class name (the daemon's models have the same)."""
    return {cls.__name__: cls._fields for cls in (MetadataRequest, JoinRequest, NextRequest, LeaveRequest)}


class Handle(NamedTuple):
    """One tensor of a published batch: ``nbytes`` at ``offset`` of shared-memory ``segment``, whose
    bytes are valid while entry ``entry`` of the daemon's generations table holds ``generation``
    (``JoinReply.generations``; ``entry`` -1: not fenced, an empty tensor or an old daemon's handle)."""

    batch: int
    segment: str | None  # None: an empty tensor, no bytes
    offset: int
    nbytes: int
    name: str
    dtype: str
    shape: tuple[int, ...]
    dedicated: bool  # an oversized tensor's own segment, unlinked once released
    entry: int = -1
    generation: int = 0

    def to_wire(self, fenced: bool = True) -> list:
        """The JSON array: 10 fields, or the 8 before the fence for a rank that did not ask for it."""
        wire = [self.batch, self.segment, self.offset, self.nbytes, self.name, self.dtype, list(self.shape), self.dedicated]
        if fenced:
            wire += [self.entry, self.generation]
        return wire

    @classmethod
    def from_wire(cls, raw: list) -> Handle:
        batch, segment, offset, nbytes, name, dtype, shape, dedicated, *fence = raw
        entry, generation = fence if fence else (-1, 0)
        return cls(batch, segment, offset, nbytes, name, dtype, tuple(shape), dedicated, entry, generation)


class JoinReply(NamedTuple):
    session_id: str
    tensors: int  # how many tensors this rank will receive
    bytes: int  # ... and their bytes
    metadata_dir: str
    shm_dir: str  # where the segments are, as the daemon sees it (STREAMER_SHM_DIR overrides it)
    shm_page_size: int = 0  # the page size backing the segments (0: a daemon that does not say)
    # Every byte this rank selected was in the daemon's resident copy when it joined: a hint for how
    # a CUDA rank copies them (False: a daemon that does not say, or bytes it streams).
    from_memory: bool = False
    # The slots of the ring this rank's streamed batches come through, each reused batch after
    # batch, where the daemon keeps the ring to them (0: it does not: a rank loading alone, a
    # retained load, whose segments are new memory for each batch, or a daemon that does not say).
    ring_slots: int = 0
    # The file in shm_dir of the daemon's segment generations (None: a daemon from before the fence).
    generations: str | None = None

    def to_wire(self) -> dict:
        return self._asdict()

    @classmethod
    def from_wire(cls, data: dict) -> JoinReply:
        return cls(
            data["session_id"], data["tensors"], data["bytes"], data["metadata_dir"], data["shm_dir"],
            data.get("shm_page_size", 0), data.get("from_memory", False), data.get("ring_slots", 0),
            data.get("generations"),
        )  # fmt: skip


class NextReply(NamedTuple):
    handles: tuple[Handle, ...]  # whole batches, in order
    done: bool  # this rank has been handed every tensor

    def to_wire(self, fenced: bool = True) -> dict:
        return {"handles": [h.to_wire(fenced) for h in self.handles], "done": self.done}

    @classmethod
    def from_wire(cls, data: dict) -> NextReply:
        return cls(tuple(Handle.from_wire(raw) for raw in data["handles"]), data["done"])


ERROR_TEXT_LIMIT = 8192
"""Characters of an error text on the wire: a bad entry of a long list is named, not sent back whole."""


def clipped(text: str | None, limit: int = ERROR_TEXT_LIMIT) -> str | None:
    """``text``, or in at most ``limit`` characters its start, how many characters were left out
    and its last 256 (where an error says what was wrong with what it names)."""
    if text is None or len(text) <= limit:
        return text
    head, tail = limit - 64 - 256, 256
    return f"{text[:head]} ... [{len(text) - head - tail} characters left out] ... {text[-tail:]}"


def error_body(type_name: str, message: str, *, uri: str | None = None, key: str | None = None) -> dict:
    """The JSON body of an error reply (its texts :func:`clipped`)."""
    return {"error": {"type": type_name, "message": clipped(message), "uri": clipped(uri), "key": clipped(key)}}


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
