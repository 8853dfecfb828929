"""The process's pool of page-locked ring slots (streamer_service.embedded.buffers), over a fake CUDA runtime.

The CUDA calls are the only fake: buffers are real anonymous mappings, registration goes through
the real :class:`streamer_client._pinning.HostPinner` and a registry of the test's own (the process's
one may hold what other tests' loads keep on purpose: the staging ring, kept slots and segments).
The device side (real ``cudaHostRegister``, loads through the engine) is tests/test_cuda.py.
"""

from __future__ import annotations

import gc

import pytest

from streamer_client._pinning import HostPinner, _Registry
from streamer_service.embedded.buffers import HostBuffer, PinnedPool

KIB = 1024


class FakeCudart:
    """Records registrations like the CUDA runtime would answer them."""

    def __init__(self) -> None:
        self.registered: dict[int, int] = {}
        self.calls: list[str] = []

    def host_register(self, address: int, nbytes: int, flags: int) -> int:
        self.calls.append("register")
        if address in self.registered:
            return 712
        self.registered[address] = nbytes
        return 0

    def host_unregister(self, address: int) -> int:
        self.calls.append("unregister")
        return 0 if self.registered.pop(address, None) is not None else 713

    def error_string(self, code: int) -> str:
        return f"error {code}"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def fake():
    return FakeCudart()


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def registry():
    return _Registry()


@pytest.fixture
def pool(fake, clock, registry):
    pool = PinnedPool(pinner=HostPinner(fake, registry=registry), idle_s=30.0, clock=clock)
    yield pool
    pool.close()
    assert registry.ranges() == {}


def _load(pool: PinnedPool, sizes: list[int]) -> list[HostBuffer]:
    """What a device load does with the pool: take or make a slot per batch, pin it at first copy."""
    slots = []
    for nbytes in sizes:
        buffer = pool.take(nbytes) or HostBuffer(nbytes)
        assert pool.pin(buffer)
        slots.append(buffer)
    return slots


def test_a_reload_pins_nothing_and_a_larger_ring_pins_only_the_extra_slots(pool, fake, registry):
    first = _load(pool, [64 * KIB] * 2)
    assert pool.stats.pinned == 2 and fake.calls == ["register"] * 2
    pool.give_back(first)
    assert pool.stats.idle == 2 and pool.idle_ranges() == registry.ranges()
    second = _load(pool, [64 * KIB] * 3)
    assert {b.address for b in first} < {b.address for b in second}, "the idle slots are taken again"
    assert pool.stats.reused == 2 and pool.stats.pinned == 3
    assert fake.calls == ["register"] * 3, "only the third slot was registered"
    assert pool.pin(second[0]) and fake.calls.count("register") == 3  # a pinned slot: a lookup
    pool.give_back(second)
    assert pool.stats.idle == 3 and pool.stats.pinned_bytes == 3 * 64 * KIB


def test_slots_of_another_size_are_released_when_a_load_ends(pool, fake, registry):
    pool.give_back(_load(pool, [64 * KIB] * 2))
    other = _load(pool, [128 * KIB])
    assert pool.stats.reused == 0  # no idle slot of that size
    pool.give_back(other)
    assert pool.idle_ranges() == {other[0].address: 128 * KIB} == registry.ranges()
    assert pool.stats.released == 2 and fake.calls.count("unregister") == 2


def test_idle_slots_are_released_after_the_idle_time(pool, fake, clock, registry):
    slots = _load(pool, [64 * KIB] * 2)
    pool.give_back(slots)
    clock.now += 29.0
    assert pool.sweep() == 0 and pool.stats.idle == 2
    clock.now += 2.0
    assert pool.sweep() == 2
    assert registry.ranges() == {} and fake.registered == {}
    assert pool.stats.idle == 0 and pool.stats.pinned_bytes == 0


def test_released_slots_are_unmapped(pool):
    import weakref

    slots = _load(pool, [64 * KIB] * 2)
    refs = [weakref.ref(b) for b in slots]
    pool.give_back(slots)
    del slots
    gc.collect()
    assert all(r() is not None for r in refs), "idle slots are kept"
    pool.close()
    gc.collect()
    assert all(r() is None for r in refs), "a released slot's mapping is gone"


def test_slots_that_could_not_be_pinned_are_not_kept(fake, clock, monkeypatch, registry):
    from streamer_client import _pinning as pinning

    monkeypatch.setattr(pinning, "_fallback_warned", False)  # the one warning per process, not yet given

    class Refusing(FakeCudart):
        def host_register(self, address, nbytes, flags):
            return 2  # cudaErrorMemoryAllocation

    pool = PinnedPool(pinner=HostPinner(Refusing(), registry=registry), clock=clock)
    buffer = HostBuffer(64 * KIB)
    with pytest.warns(RuntimeWarning, match="pageable"):
        assert not pool.pin(buffer)
    pool.give_back([buffer])
    assert pool.stats.idle == 0 and pool.stats.pinned == 0 and registry.ranges() == {}


def test_the_janitor_releases_idle_slots_without_a_further_load(fake, registry):
    import time

    pool = PinnedPool(pinner=HostPinner(fake, registry=registry), idle_s=0.2)
    pool.give_back(_load(pool, [64 * KIB]))
    deadline = time.monotonic() + 10
    while pool.stats.idle and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pool.stats.idle == 0 and registry.ranges() == {}
