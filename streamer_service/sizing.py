"""How a load's memory is sized: slots, ring depth, bytes in flight and Run:ai's read parallelism.

One rule for every place that sizes a load (the daemon, its sessions' buffers, the embedded
engine, the settings' warning), from three inputs: the buffer budget, the slot size and the node's
NIC rate (``STREAMER_TARGET_GBPS``, docs/configuration.md "Read parallelism"):

- **slots**: the configured slot size, shrunk so that at least :data:`FEW_SLOTS` fit the budget;
- **ring depth**: as many slots as the budget holds (never more than the load has batches): a
  slot is made only when no free one is left, so a deep ring costs nothing while the ranks keep
  up, and lets storage run ahead while they do not; but for :data:`PINNING_RANKS` or more ranks
  that page-lock what they copy from, the slots a load starts with (:func:`first_ring_slots`),
  which each rank then registers once;
- **bytes in flight**: what keeps the NIC busy while each request waits for its first byte,
  bandwidth × :data:`REQUEST_LATENCY_S`, never less than :data:`MIN_IN_FLIGHT_SLOTS` slots. The
  pipeline submits no more than that: the head of the checkpoint lands first, and the ranks work
  on it while the rest is read (everything submitted at once lands all together, at the end);
- **requests**: from object storage the bytes in flight go to Run:ai as :data:`REQUESTS_IN_FLIGHT`
  requests of whole batches (:func:`submission_size`): Run:ai splits each request across all its
  workers and serves the requests in flight side by side, so fewer, larger ones keep it as busy
  with less ramp-up and tail per request. A local directory's reads have no request latency to
  hide and its reader answers a request once all of it is copied: one batch a request, so the
  head batch is handed on as soon as it is in memory;
- **Run:ai's parallelism** for that rate: :class:`ReadParallelism`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from streamer_client._settings import MIN_SHM_BUDGET

__all__ = [
    "FEW_SLOTS", "MIN_IN_FLIGHT_SLOTS", "PINNING_RANKS", "REQUEST_LATENCY_S", "ReadParallelism", "first_ring_slots", "in_flight_bytes",
    "ring_slots", "slot_bytes", "submission_size",
]  # fmt: skip

MiB = 1024**2

FEW_SLOTS = 4
"""The budget holds at least this many slots: larger configured slots shrink to a quarter of it."""

PINNING_RANKS = 2
"""How many of a load's ranks that may page-lock (CUDA ranks) keep its ring to the slots it starts
with: staged, each would copy every byte once more on the host, and those copies share the host's
memory; page-locking, each registers those few slots once, in its own process. One rank alone
stages about as fast as it registers them."""

MIN_IN_FLIGHT_SLOTS = 2
"""One batch landing while the next is already asked for."""

REQUESTS_IN_FLIGHT = 2
"""Run:ai requests the bytes in flight are cut into: one landing while the next is read."""

REQUEST_LATENCY_S = 0.1
"""The request latency the bytes in flight cover: object stores answer a ranged GET's first byte in
tens of milliseconds (S3's p99 near this bound); loopback in microseconds."""

RUNAI_OBJ_CONCURRENCY = 8
"""Run:ai 0.17.0's object-storage clients (``RUNAI_STREAMER_OBJ_CONCURRENCY``)."""

CRT_GBPS_PER_CONNECTION = 0.4
"""What the AWS CRT plans per connection: it opens target ÷ 0.4 connections per client."""

MAX_REQUESTS_PER_S = 3000
"""Ranged GETs per second a load asks of one prefix at most (S3 serves about 5,500): past it,
larger parts."""

HEADROOM = 1.25
"""Run:ai's target over the NIC rate, so one slow connection does not leave the link idle."""


def slot_bytes(budget: int, slot_size: int) -> int:
    """The slot size in force: ``slot_size``, shrunk so that :data:`FEW_SLOTS` slots fit ``budget``,
    but never below one minimum slot (``MIN_SHM_BUDGET``, the least budget accepted)."""
    return max(1, min(slot_size, max(budget // FEW_SLOTS, MIN_SHM_BUDGET)))


def ring_slots(budget: int, slot: int, batches: int, *, cap_bytes: int | None = None) -> int:
    """Slots of a load's ring: as many of ``slot`` bytes as ``budget`` holds, at most ``batches``
    (the load's slot batches); ``cap_bytes`` (a device load's ring) caps them too, but leaves two."""
    if slot <= 0 or batches <= 0:
        return 0
    count = min(budget // slot, batches)
    if cap_bytes is not None:
        count = min(count, max(2, cap_bytes // slot))
    return max(count, 0)


def first_ring_slots(budget: int, slot: int, in_flight: int) -> int:
    """Ring slots a load takes before its ranks release any: those in flight, and a request's worth
    (:data:`REQUESTS_IN_FLIGHT` of the bytes in flight) delivered and being read, at least two
    (what the daemon makes when it starts, ahead of its first load)."""
    in_flight_slots = -(-in_flight // slot)
    return min(budget // slot, in_flight_slots + max(2, -(-in_flight_slots // REQUESTS_IN_FLIGHT)))


def in_flight_bytes(target_gbps: float, slot: int, budget: int) -> int:
    """Most bytes a load has submitted to storage and not yet landed: bandwidth × latency, at least
    :data:`MIN_IN_FLIGHT_SLOTS` slots, at most the budget (but one slot is always allowed)."""
    wanted = max(math.ceil(target_gbps * 1e9 / 8 * REQUEST_LATENCY_S), MIN_IN_FLIGHT_SLOTS * slot)
    return max(min(wanted, budget), slot)


def submission_size(in_flight: int | None, *, local: bool = False) -> int:
    """Most bytes of one read request: the bytes in flight over :data:`REQUESTS_IN_FLIGHT` (a
    request holds whole batches, at least one). ``0``, one batch a request: a local directory, or
    no bound in flight."""
    return in_flight // REQUESTS_IN_FLIGHT if in_flight and not local else 0


class ReadParallelism(NamedTuple):
    """Run:ai's object-storage knobs for a node NIC of ``target_gbps`` Gbit/s.

    Run:ai's own concurrency (8 clients) up to 200 Gbit/s, 8 more per 200 beyond; each S3 client
    targets its share of :data:`HEADROOM` × the rate; parts of 8 MiB, doubled while the load
    would ask more than :data:`MAX_REQUESTS_PER_S` ranged GETs per second.
    """

    target_gbps: int
    obj_concurrency: int
    s3_target_gbps: int  # per client: the AWS CRT's throughput target
    chunk_bytes: int

    @classmethod
    def for_rate(cls, target_gbps: int) -> ReadParallelism:
        concurrency = RUNAI_OBJ_CONCURRENCY * max(1, math.ceil(target_gbps / 200))
        per_client = max(1, math.ceil(HEADROOM * target_gbps / concurrency))
        chunk = 8 * MiB
        while target_gbps * 1e9 / 8 / chunk > MAX_REQUESTS_PER_S:
            chunk *= 2
        return cls(target_gbps, concurrency, per_client, chunk)

    @property
    def connections(self) -> int:
        """S3 connections the CRT opens for these targets (all clients)."""
        return math.ceil(self.obj_concurrency * self.s3_target_gbps / CRT_GBPS_PER_CONNECTION)

    @property
    def part_buffer_bytes(self) -> int:
        """The CRT's part buffers when every connection holds one part: RAM outside our budget."""
        return self.connections * self.chunk_bytes
