"""Pinned host -> GPU copies (streamer_client._cuda) and the engine's device path (docs/architecture.md, "Data-path rules").

The first part runs anywhere: registration bookkeeping, the one-warning fallback and the release
queue, against a fake CUDA runtime. The GPU part (``-m gpu``; skipped without CUDA) checks every
tensor against safetensors' ground truth: a few-GB random checkpoint with a tensor larger than a
ring slot, one process and two processes (on one GPU, and one per GPU where two exist), a copy
stream slowed down on purpose (a slot recycled before its copies completed would corrupt the
next tensors), registration that fails for real and registration that is made to fail.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import shutil
import subprocess
import sys
import textwrap
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from checkpoints import INDEX_NAME, ground_truth, make_sharded_checkpoint, many_small_tensors, mixed_tensors
from safetensors.torch import load_file

import streamer_client
from streamer_client import _pinning as pinning
from streamer_client._cuda import Fence, PinnedCopier, _check_host, _Releases, address_of, cuda_device
from streamer_client._pinning import (
    ERROR_ALREADY_REGISTERED,
    HOST_REGISTER_PORTABLE,
    HOST_REGISTER_READ_ONLY,
    HostPinner,
    _Registry,
    registered_ranges,
)
from streamer_client.errors import ConfigError
from streamer_service.checkpoint.plan import BatchKind

KIB = 1024
MIB = 1024 * KIB
GIB = 1024 * MIB
REPO = Path(__file__).resolve().parents[1]

HAS_CUDA = torch.cuda.is_available()


@pytest.fixture(autouse=True)
def fresh_fallback_warning(monkeypatch):
    """Each test sees the process-wide 'pageable fallback' warning as not yet given."""
    monkeypatch.setattr(pinning, "_fallback_warned", False)


# =========================================================================== anywhere


class FakeCudart:
    """Records registrations; ``fail`` maps an address to the error code its registration returns."""

    def __init__(self, fail: dict[int, int] | None = None) -> None:
        self.fail = fail or {}
        self.registered: dict[int, tuple[int, int]] = {}
        self.calls: list[tuple] = []

    def host_register(self, address: int, nbytes: int, flags: int) -> int:
        self.calls.append(("register", address, nbytes, flags))
        if address in self.fail:
            return self.fail[address]
        if address in self.registered:
            return ERROR_ALREADY_REGISTERED
        self.registered[address] = (nbytes, flags)
        return 0

    def host_unregister(self, address: int) -> int:
        self.calls.append(("unregister", address))
        return 0 if self.registered.pop(address, None) else 713

    def error_string(self, code: int) -> str:
        return {2: "out of memory", 800: "operation not permitted"}.get(code, "some error")


def test_a_buffer_is_registered_once_and_unregistered_by_its_last_user():
    fake, registry = FakeCudart(), _Registry()
    a, b = HostPinner(fake, registry=registry), HostPinner(fake, registry=registry)
    assert a.pin(0x10000, 4 * MIB)
    assert a.pin(0x10000, 4 * MIB)  # again: a lookup
    assert b.pin(0x10000, 4 * MIB)  # another user (a copier for another device): a reference
    assert [c[0] for c in fake.calls] == ["register"]
    assert fake.calls[0][3] == HOST_REGISTER_PORTABLE
    assert registry.covers(0x10000 + MIB, MIB) and not registry.covers(0x10000 + 3 * MIB, 2 * MIB)
    assert not registry.covers(0x0, 16)
    a.close()
    assert fake.registered  # b still holds it
    b.close()
    assert not fake.registered and not registry.entries
    assert a.pinned_bytes == b.pinned_bytes == 0


class _SlowCudart(FakeCudart):
    """Registers ``slow`` only once ``go`` is set (a large segment's registration, in the driver)."""

    def __init__(self, slow: int, fail: dict[int, int] | None = None) -> None:
        super().__init__(fail)
        self.slow = slow
        self.started = threading.Event()
        self.go = threading.Event()

    def host_register(self, address: int, nbytes: int, flags: int) -> int:
        if address == self.slow:
            self.started.set()
            assert self.go.wait(30)
        return super().host_register(address, nbytes, flags)


def _in_thread(call) -> tuple[threading.Thread, list]:
    result: list = []
    thread = threading.Thread(target=lambda: result.append(call()), daemon=True)
    thread.start()
    return thread, result


@pytest.mark.parametrize("fails", [False, True], ids=["registers", "fails"])
def test_a_registration_in_flight_holds_up_no_lookup_and_is_shared_by_a_second_one(fails):
    # Segment k is registered; k+1 is being registered on the worker thread while batch k's copies
    # look k up (PinnedCopier.copy_pieces asks is_pinned) and another user of k+1 asks for it too.
    k, k1 = 0x10000, 0x800000
    fake, registry = _SlowCudart(slow=k1, fail={k1: 2} if fails else None), _Registry()
    worker, copier, other = (HostPinner(fake, registry=registry) for _ in range(3))
    assert copier.pin(k, 4 * MIB)
    registering, registered = _in_thread(lambda: worker.pin(k1, 4 * MIB))
    assert fake.started.wait(30)
    looked_up, answers = _in_thread(lambda: (copier.is_pinned(k + MIB, MIB), other.pin(k, 4 * MIB), registry.ranges()))
    looked_up.join(10)
    assert answers == [(True, True, {k: 4 * MIB})]  # answered while k+1 is still being registered
    second, shared = _in_thread(lambda: other.pin(k1, 4 * MIB))
    second.join(0.2)
    assert second.is_alive() and registering.is_alive()  # the second waits for the one in flight
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the failed registration's one warning
        fake.go.set()
        registering.join(10), second.join(10)
    assert registered == shared == [not fails]
    assert [c[1] for c in fake.calls if c[0] == "register"] == [k, k1]  # k+1 registered once, by the first
    assert registry.covers(k1, 4 * MIB) is not fails
    for pinner in (worker, copier, other):
        pinner.close()
    assert not registry.entries and not fake.registered


def test_read_only_mappings_register_with_the_read_only_flag():
    fake = FakeCudart()
    pinner = HostPinner(fake, registry=_Registry())
    assert pinner.pin(0x20000, MIB, read_only=True)
    assert fake.registered[0x20000][1] == HOST_REGISTER_PORTABLE | HOST_REGISTER_READ_ONLY


def test_a_failed_registration_warns_once_per_process_and_stops_trying():
    fake, registry = FakeCudart(fail={0x10000: 2, 0x90000: 800}), _Registry()
    first = HostPinner(fake, registry=registry)
    with pytest.warns(RuntimeWarning, match=r"cudaHostRegister of 1048576 bytes failed: out of memory \(2\).*pageable"):
        assert not first.pin(0x10000, MIB)
    assert "out of memory" in first.failure
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no second warning, from this pinner or another
        assert not first.pin(0x50000, MIB)  # not even tried: this pinner copies pageable from now on
        second = HostPinner(fake, registry=registry)
        assert not second.pin(0x90000, MIB)
    assert [c[1] for c in fake.calls if c[0] == "register"] == [0x10000, 0x90000]
    first.close(), second.close()
    assert not registry.entries


def test_memory_registered_by_someone_else_counts_as_pinned_and_is_left_registered():
    fake, registry = FakeCudart(), _Registry()
    fake.registered[0x10000] = (MIB, 0)  # e.g. the user's own cudaHostRegister
    pinner = HostPinner(fake, registry=registry)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        assert pinner.pin(0x10000, MIB)
    assert pinner.is_pinned(0x10000, MIB)
    pinner.close()
    assert 0x10000 in fake.registered, "not ours to unregister"
    assert ("unregister", 0x10000) not in fake.calls


def test_disabled_pinning_never_registers():
    fake = FakeCudart()
    pinner = HostPinner(fake, enabled=False, registry=_Registry())
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        assert not pinner.pin(0x10000, MIB)
    assert fake.calls == []


class FakeEvent:
    def __init__(self) -> None:
        self.complete = False
        self.waited = False

    def query(self) -> bool:
        return self.complete

    def synchronize(self) -> None:
        self.waited = True
        self.complete = True


def test_buffers_are_released_in_copy_order_and_only_after_their_copies():
    releases, ran = _Releases(), []
    events = [FakeEvent() for _ in range(3)]
    for i, event in enumerate(events):
        releases.add(Fence(event), lambda i=i: ran.append(i))
    assert releases.poll() == 0 and ran == []
    events[1].complete = True  # cannot overtake the first: same stream, so it did not really
    assert releases.poll() == 0 and ran == []
    events[0].complete = True
    assert releases.poll() == 2 and ran == [0, 1]
    assert releases.wait_one() and events[2].waited and ran == [0, 1, 2]
    assert not releases.wait_one() and len(releases) == 0


def test_host_views_are_checked():
    _check_host(torch.zeros(8, dtype=torch.uint8), 8)
    with pytest.raises(ValueError, match="needs 4"):
        _check_host(torch.zeros(8, dtype=torch.uint8), 4)
    with pytest.raises(ValueError, match="1-D uint8"):
        _check_host(torch.zeros(2, dtype=torch.float32), 8)
    with pytest.raises(ValueError, match="contiguous"):
        _check_host(torch.zeros(16, dtype=torch.uint8)[::2], 8)
    array = np.zeros(100, dtype=np.uint8)
    assert address_of(array) == (array.ctypes.data, 100)
    tensor = torch.zeros(10, dtype=torch.float32)
    assert address_of(tensor) == (tensor.data_ptr(), 40)
    with pytest.raises(ValueError):
        address_of(array[::2])


@pytest.mark.skipif(HAS_CUDA, reason="checks the no-CUDA error")
def test_cuda_devices_without_cuda_are_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="CUDA is not available"):
        PinnedCopier("cuda:0")
    with pytest.raises(ConfigError, match="CUDA is not available"):
        cuda_device("cuda")
    make_sharded_checkpoint(tmp_path / "ckpt", mixed_tensors(), n_shards=1)
    with pytest.raises(ConfigError, match="CUDA is not available"):
        streamer_client.load_state_dict(tmp_path / "ckpt", device="cuda:0")


def test_non_cuda_devices_are_refused_by_the_copier():
    with pytest.raises(ConfigError, match="not a CUDA device"):
        cuda_device("cpu")
    with pytest.raises(ConfigError, match="unusable device"):
        cuda_device("no-such-device")


# =========================================================================== GPU


def _bytes_equal(got: torch.Tensor, expected: torch.Tensor) -> bool:
    """Bit-exact, on the GPU (NaN payloads included)."""
    if got.dtype != expected.dtype or got.shape != expected.shape:
        return False
    a = got.contiguous().reshape(-1).view(torch.uint8)
    b = expected.to(got.device).contiguous().reshape(-1).view(torch.uint8)
    return bool(torch.equal(a, b))


def _random_host_bytes(nbytes: int, seed: int = 0) -> np.ndarray:
    """Random bytes in a private anonymous mapping (like a ring slot)."""
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    array = np.frombuffer(memory, dtype=np.uint8)
    array[:] = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    return array


def _copy_all(copier: PinnedCopier, array: np.ndarray, layout) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Copy consecutive (dtype, shape) pieces of ``array``; (device tensor, CPU reference) pairs."""
    out, offset = [], 0
    for dtype, shape in layout:
        n = int(np.prod(shape)) * dtype.itemsize
        host = torch.from_numpy(array[offset : offset + n])
        out.append((copier.copy(host, dtype, shape), host.clone().view(dtype).reshape(shape)))
        offset += n
    return out


LAYOUT = [
    (torch.bfloat16, (1024, 1024)),
    (torch.float32, ()),
    (torch.float16, (0, 4)),
    (torch.bool, (7, 3)),
    (torch.float8_e4m3fn, (33,)),
    (torch.int64, (5, 5)),
    (torch.float32, (3, 1000, 17)),
]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_copier_pins_once_and_copies_byte_exact():
    array = _random_host_bytes(8 * MIB)
    address, nbytes = address_of(array)
    with PinnedCopier("cuda:0") as copier:
        assert copier.register(address, nbytes)
        assert copier.register(address, nbytes)  # once: a lookup the second time
        assert registered_ranges() == {address: nbytes}
        for _ in range(3):  # reused, as ring slots are
            pairs = _copy_all(copier, array, LAYOUT)
            copier.fence()
            for got, expected in pairs:
                assert got.device == torch.device("cuda", 0)
                assert _bytes_equal(got, expected)
        stats = copier.stats
        assert stats.pinned_bytes == stats.bytes > 0 and stats.pageable_bytes == 0
        assert stats.fallback is None
    assert registered_ranges() == {}


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_a_range_registered_elsewhere_is_used_pinned_and_left_registered():
    array = _random_host_bytes(4 * MIB, seed=1)
    address, nbytes = address_of(array)
    rt = torch.cuda.cudart()
    assert int(rt.cudaHostRegister(address, nbytes, 0)) == 0
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            with PinnedCopier("cuda:0") as copier:
                assert copier.register(address, nbytes)  # cudaErrorHostMemoryAlreadyRegistered: pinned
                pairs = _copy_all(copier, array, LAYOUT)
                copier.fence()
                assert all(_bytes_equal(g, e) for g, e in pairs)
        torch.ones(4, device="cuda:0").sum().item()  # no stale error from the refused registration
    finally:
        assert int(rt.cudaHostUnregister(address)) == 0, "the copier must not unregister what it did not register"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_a_registration_the_driver_refuses_falls_back_to_pageable_with_one_warning():
    array = _random_host_bytes(4 * MIB, seed=2)
    address, nbytes = address_of(array)
    with PinnedCopier("cuda:0") as copier:
        with pytest.warns(RuntimeWarning, match="cudaHostRegister .* failed.*pageable") as record:
            assert not copier.register(0x8, 4096)  # page 0 is never mapped: CUDA refuses for real
        assert len([w for w in record if issubclass(w.category, RuntimeWarning)]) == 1
        # The failure must not linger as CUDA's "last error" (torch checks it after launches).
        torch.ones(1024, device="cuda:0").mul_(2).sum().item()
        torch.cuda.synchronize()
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            assert not copier.register(address, nbytes)  # this copier has stopped trying
            pairs = _copy_all(copier, array, LAYOUT)
        copier.fence()
        assert all(_bytes_equal(g, e) for g, e in pairs)
        assert copier.stats.pageable_bytes == copier.stats.bytes > 0
        assert "failed" in copier.stats.fallback
    assert registered_ranges() == {}


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_a_read_only_shared_memory_mapping_is_pinned_with_the_read_only_flag(tmp_path):
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path
    path = shm / f"streamer-test-{os.getpid()}"
    data = np.random.default_rng(3).integers(0, 256, 6 * MIB, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    try:
        with open(path, "rb") as f:
            memory = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ, flags=mmap.MAP_SHARED)
        array = np.frombuffer(memory, dtype=np.uint8)
        with PinnedCopier("cuda:0") as copier, warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # torch: "the given NumPy array is not writable"
            assert copier.register(*address_of(array), read_only=True)
            host = torch.from_numpy(array)
            got = copier.copy(host, torch.bfloat16, (3 * MIB,))
            copier.fence()
            assert torch.equal(got.view(torch.uint8).cpu(), torch.from_numpy(data))
            assert copier.stats.pinned_bytes == 6 * MIB
        del host, array
        memory.close()
    finally:
        path.unlink()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_a_load_s_tensors_are_carved_out_of_one_reservation():
    from streamer_client import _delivery as delivery

    device = torch.device("cuda", 0)
    torch.cuda.empty_cache()
    sizes = [32 * MIB] * 6 + [3 * MIB + 5]
    delivery.reserve(device, sizes)
    reserved = torch.cuda.memory_reserved(device)
    assert reserved >= sum(sizes)
    tensors = [torch.empty(n, dtype=torch.uint8, device=device) for n in sizes]
    assert torch.cuda.memory_reserved(device) == reserved, "no allocation of its own for any tensor"
    del tensors
    delivery.reserve(device, sizes)  # the allocator holds that much unused already: nothing more
    assert torch.cuda.memory_reserved(device) == reserved


# --------------------------------------------------------------------------- engine


_POOLS: list = []  # every pool _engine made; closed after each test


@pytest.fixture(autouse=True)
def close_engine_pools():
    """What one test's loads left pinned never leaks into the next test's registrations."""
    yield
    while _POOLS:
        _POOLS.pop().close()


def release_process_pins() -> None:
    """Give back what a process keeps page-locked on purpose between its loads — the pinned pool's
    idle slots, the staging ring, mapped daemon segments — so that a test asserting the process's
    registrations sees its own only, whichever tests ran before it in this process."""
    from streamer_client import _delivery as delivery
    from streamer_client import _segments as segments
    from streamer_service.embedded.buffers import pinned_pool

    pinned_pool().close()
    for maps in list(segments._ALL.values()):
        maps.close()
    if delivery._RING.claim():  # not in use by a load
        try:
            delivery._RING.release()
        finally:
            delivery._RING.give_back()
    assert registered_ranges() == {}, "a range is still page-locked that no process-wide cache holds"


@pytest.fixture(autouse=True)
def own_registrations():
    """Each GPU test starts with nothing page-locked (see release_process_pins)."""
    if HAS_CUDA:
        release_process_pins()


def _engine(directory: Path, budget: int, slot: int, pool=None, *, ring: bool = True, versions: bool = False):
    """An engine whose CUDA loads keep their pinned slots in ``pool`` (default: one of its own,
    ``engine.pool``, so that tests see only their own registrations).

    ``ring``: its device loads go through its ring, read by Run:ai (as from object storage, or with
    ``STREAMER_LOCAL_READER=runai``); else the reader is the engine's own choice, which for a
    local directory stages straight from the files' mappings (``embedded.staged``).
    ``versions``: each batch's files are checked against the catalog's versions."""
    from streamer_service.checkpoint.catalog import build_catalog
    from streamer_service.checkpoint.versions import ObjectVersions
    from streamer_service.embedded.buffers import PinnedPool
    from streamer_service.embedded.engine import EmbeddedEngine, EngineConfig
    from streamer_service.readers.runai.reader import NativeReader
    from streamer_service.settings import Settings
    from streamer_service.storage import open_storage
    from streamer_service.uri import parse_uri

    uri = parse_uri(directory)
    catalog = build_catalog(open_storage(uri, Settings()))
    pool = pool if pool is not None else PinnedPool()
    _POOLS.append(pool)
    checks = ObjectVersions(uri, catalog.files, Settings()) if versions else None
    engine = EmbeddedEngine(
        uri, catalog, EngineConfig(budget=budget, slot_size=slot), pool=pool,
        reader_factory=NativeReader if ring else None, versions=checks,
    )  # fmt: skip
    engine.pool = pool
    return engine


@pytest.fixture(scope="module")
def many_batches(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """Every dtype, 0-d and empty tensors, 3000 small tensors and one tensor larger than a slot."""
    directory = tmp_path_factory.mktemp("many")
    tensors = mixed_tensors()
    tensors["huge.weight"] = torch.randn(256, 1024, generator=torch.Generator().manual_seed(1))  # 1 MiB
    tensors.update({f"small.{k}": v for k, v in many_small_tensors(3000).items()})
    make_sharded_checkpoint(directory, tensors, n_shards=3)
    return directory, ground_truth(directory)


def _slow_copies(monkeypatch, cycles: int = 20_000_000) -> None:
    """Delay every batch's copies on the copy stream (~10 ms): a buffer recycled before its copies
    completed is overwritten by the next read before the DMA reads it; a consumer stream that did
    not wait reads the result before it is written."""
    original = PinnedCopier.copy_pieces  # every copy, whole tensors and the parts of oversized ones

    def copy_pieces(self, host, pieces):
        if not self._issued:
            with torch.cuda.stream(self.stream):
                torch.cuda._sleep(cycles)
        return original(self, host, pieces)

    monkeypatch.setattr(PinnedCopier, "copy_pieces", copy_pieces)


def _stream_checked(engine, plan, truth: dict[str, torch.Tensor]) -> None:
    """Stream ``plan`` to cuda:0, each tensor checked at once on the current stream, in plan order."""
    names = []
    for name, tensor in engine.stream(plan, device="cuda:0"):
        assert tensor.device == torch.device("cuda", 0)
        assert _bytes_equal(tensor, truth[name]), name
        names.append(name)
    assert names == [t.name for t in plan.tensors]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("slots", [1, 3])
def test_engine_recycles_a_slot_only_after_its_copies_completed(many_batches, monkeypatch, slots):
    directory, truth = many_batches
    _slow_copies(monkeypatch)
    slot = 8 * KIB
    engine = _engine(directory, budget=slots * slot, slot=slot)
    plan = engine.plan()
    assert len(plan.batches) > 3 * slots
    _stream_checked(engine, plan, truth)
    assert engine.stats.buffer_bytes == 0
    # The oversized tensor came in parts through the slots: no buffer of its own, none kept.
    assert plan.oversized_bytes and engine.stats.peak_buffer_bytes <= slots * slot
    assert registered_ranges() == engine.pool.idle_ranges() and len(engine.pool.idle_ranges()) == slots
    engine.pool.close()
    assert registered_ranges() == {}


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_engine_tensors_are_owned_and_survive_the_rest_of_the_load(many_batches):
    directory, truth = many_batches
    engine = _engine(directory, budget=16 * KIB, slot=8 * KIB)
    kept = dict(engine.stream(engine.plan(), device="cuda:0"))  # every slot reused many times since
    torch.cuda.synchronize()
    assert kept.keys() == truth.keys()
    for name, tensor in kept.items():
        assert _bytes_equal(tensor, truth[name]), name


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_engine_falls_back_to_pageable_copies_with_one_warning(many_batches, monkeypatch):
    directory, truth = many_batches
    monkeypatch.setattr(pinning._TorchCudart, "host_register", lambda self, address, nbytes, flags: 2)
    engine = _engine(directory, budget=32 * KIB, slot=8 * KIB)
    with pytest.warns(RuntimeWarning, match="pageable") as record:
        got = dict(engine.stream(engine.plan(), device="cuda:0"))
    assert len([w for w in record if "pageable" in str(w.message)]) == 1
    for name, tensor in got.items():
        assert _bytes_equal(tensor, truth[name]), name
    assert registered_ranges() == {} and engine.pool.stats.pinned == 0  # nothing pinned, nothing kept


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_abandoning_a_device_stream_waits_for_its_copies_and_unpins(many_batches):
    directory, truth = many_batches
    engine = _engine(directory, budget=32 * KIB, slot=8 * KIB)
    stream = engine.stream(engine.plan(), device="cuda:0")
    for _ in range(500):
        name, tensor = next(stream)
        assert _bytes_equal(tensor, truth[name])
    assert registered_ranges()  # slots are pinned while the load runs
    stream.close()
    assert engine.stats.buffer_bytes == 0
    assert registered_ranges() == engine.pool.idle_ranges() != {}  # kept pinned for the next load
    engine.pool.close()
    assert registered_ranges() == {}


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_a_second_device_load_pins_nothing_and_the_first_pins_only_what_it_uses(many_batches):
    directory, truth = many_batches
    engine = _engine(directory, budget=64 * KIB, slot=8 * KIB)  # a ring of up to 8 slots
    small = engine.plan([n for n in truth if n.startswith("small.")])  # many slot batches, no oversized
    assert not small.oversized_bytes and len(small.batches) > 8
    few = engine.plan([n for n in truth if n.startswith("small.layers.1")][:30])

    def load(plan) -> None:
        got = dict(engine.stream(plan, device="cuda:0"))
        assert got.keys() == {t.name for t in plan.tensors}
        for name, tensor in got.items():
            assert _bytes_equal(tensor, truth[name]), name

    load(few)
    stats = engine.pool.stats
    first = sum(b.kind is BatchKind.SLOT and bool(b.ranges) for b in few.batches)
    assert 0 < stats.pinned == first < 8, "the first load pins the slots it fills, not the budget's ring"
    load(small)
    load(small)
    assert stats.pinned == 8, "later loads pinned only the slots the first one had not"
    assert stats.reused == first + 8 and stats.idle == 8
    huge = engine.plan(["huge.weight"])  # one oversized tensor (1 MiB > a slot)
    load(huge)
    load(huge)
    assert stats.pinned == 8 and stats.reused == first + 8 + 16, "it came in parts through the 8 slots: nothing pinned"
    assert registered_ranges() == engine.pool.idle_ranges() and stats.idle == 8
    engine.pool.close()
    assert registered_ranges() == {} and stats.pinned_bytes == 0


def _staging_ring_only() -> bool:
    """Whether what the process has page-locked is the staging ring and nothing else."""
    from streamer_client._delivery import STAGING_SLOT_BYTES, STAGING_SLOTS

    return sorted(registered_ranges().values()) == [STAGING_SLOT_BYTES] * STAGING_SLOTS


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_a_local_device_load_is_staged_from_the_files_mappings(many_batches, monkeypatch):
    from streamer_service.readers.mapped import file_maps

    directory, truth = many_batches
    _slow_copies(monkeypatch)  # a staging slot reused before its copies completed would corrupt tensors
    engine = _engine(directory, budget=32 * KIB, slot=8 * KIB, ring=False)
    plan = engine.plan()
    _stream_checked(engine, plan, truth)
    assert {str(p) for p in directory.glob("*.safetensors")} <= set(file_maps().paths())
    # No ring of the engine's: nothing of its pool, only the process's staging ring is page-locked.
    assert engine.stats.peak_buffer_bytes == 0 and engine.pool.stats.pinned == 0
    assert _staging_ring_only()
    assert engine.stats.tensors == len(truth) and engine.stats.bytes_read == sum(t.nbytes for t in plan.tensors)
    again = dict(engine.stream(engine.plan(), device="cuda:0"))
    torch.cuda.synchronize()
    assert again.keys() == truth.keys() and all(_bytes_equal(again[n], truth[n]) for n in truth)
    assert _staging_ring_only(), "a reload registers nothing more"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_abandoning_a_staged_load_waits_for_its_copies_and_keeps_only_the_staging_ring(many_batches):
    directory, truth = many_batches
    engine = _engine(directory, budget=32 * KIB, slot=8 * KIB, ring=False)
    stream = engine.stream(engine.plan(), device="cuda:0")
    for _ in range(500):
        name, tensor = next(stream)
        assert _bytes_equal(tensor, truth[name])
    stream.close()
    assert _staging_ring_only()
    got = dict(engine.stream(engine.plan(), device="cuda:0"))  # the ring was given back: usable again
    torch.cuda.synchronize()
    assert all(_bytes_equal(got[n], truth[n]) for n in truth)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_a_staged_load_of_a_file_shorter_than_its_header_says_names_the_tensor(many_batches, tmp_path):
    from streamer_client.errors import ObjectChangedError

    source, truth = many_batches
    directory = Path(shutil.copytree(source, tmp_path / "ckpt"))
    engine = _engine(directory, budget=32 * KIB, slot=8 * KIB, ring=False)  # no version checks: the bytes' own check
    plan = engine.plan()
    last = max((t for t in plan.tensors if t.nbytes), key=lambda t: (t.file, t.end))  # a file's last tensor
    path = directory / last.file
    os.truncate(path, last.end - 1)
    got = {}
    with pytest.raises(ObjectChangedError) as caught:
        for name, tensor in engine.stream(plan, device="cuda:0"):
            got[name] = tensor
    assert str(caught.value) == (
        f"{path}: bytes [{last.offset}, {last.end}): End of file: the file has {last.end - 1} bytes, fewer than "
        f"the checkpoint's header says; tensors {last.name!r}"
    )
    assert caught.value.key == last.name and last.name not in got
    torch.cuda.synchronize()
    assert got and all(_bytes_equal(t, truth[n]) for n, t in got.items())  # every batch before it, exact
    assert _staging_ring_only()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_a_staged_load_of_a_file_changed_since_its_header_was_read_delivers_nothing_of_it(many_batches, tmp_path):
    from streamer_client.errors import ObjectChangedError

    source, _ = many_batches
    directory = Path(shutil.copytree(source, tmp_path / "ckpt"))
    engine = _engine(directory, budget=32 * KIB, slot=8 * KIB, ring=False, versions=True)
    plan = engine.plan()
    first = plan.batches[0].files[0]
    stat = (directory / first).stat()
    os.utime(directory / first, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # rewritten in place, same size
    got = []
    with pytest.raises(
        ObjectChangedError, match=f"^{re.escape(str(directory / first))} changed while it was being loaded"
    ) as caught:
        for name, _ in engine.stream(plan, device="cuda:0"):
            got.append(name)
    assert caught.value.key == first and got == []
    assert _staging_ring_only()


# --------------------------------------------------------------------------- a few GB


def _gpu_random(shape, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """Random bits made on the GPU (fast), returned on the CPU for saving."""
    n = int(np.prod(shape)) * dtype.itemsize
    bits = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda:0", generator=generator)
    return bits.view(dtype).reshape(shape).cpu()


@pytest.fixture(scope="module")
def few_gb_checkpoint(tmp_path_factory) -> Path:
    """``STREAMER_TEST_GPU_GB`` (default 2) GB of random bf16 weights in 3 shards: 32 MiB matrices,
    small norms, odd dtypes, and a 320 MiB embedding, larger than a 256 MiB ring slot."""
    if not HAS_CUDA:
        pytest.skip("needs CUDA")
    target = float(os.environ.get("STREAMER_TEST_GPU_GB", "2")) * 1e9
    g = torch.Generator(device="cuda:0").manual_seed(5)
    tensors = {"model.embed_tokens.weight": _gpu_random((40960, 4096), torch.bfloat16, g)}  # 320 MiB
    tensors.update({f"extra.{k}": v for k, v in mixed_tensors().items()})
    total, i = 320 * MIB, 0
    while total < target:
        tensors[f"model.layers.{i}.mlp.weight"] = _gpu_random((4096, 4096), torch.bfloat16, g)
        tensors[f"model.layers.{i}.norm.weight"] = _gpu_random((4096,), torch.float32, g)
        total += 32 * MIB + 16 * KIB
        i += 1
    directory = tmp_path_factory.mktemp("fewgb")
    make_sharded_checkpoint(directory, tensors, n_shards=3)
    return directory


def _check_against_truth(directory: Path, got: dict[str, torch.Tensor], device: torch.device) -> None:
    weight_map = json.loads((directory / INDEX_NAME).read_text())["weight_map"]
    assert got.keys() == weight_map.keys()
    for shard in dict.fromkeys(weight_map.values()):
        for name, expected in load_file(directory / shard).items():
            assert got[name].device == device, name
            assert _bytes_equal(got[name], expected), name


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_a_few_gb_checkpoint_loads_byte_exact_through_the_public_api(few_gb_checkpoint):
    # Staged through the 3 x 32 MiB staging ring: every slot is reused many times; the 320 MiB
    # embedding crosses windows.
    from streamer_service.embedded.buffers import pinned_pool

    got = streamer_client.load_state_dict(few_gb_checkpoint, device="cuda:0", budget="1GiB")
    torch.cuda.synchronize()
    _check_against_truth(few_gb_checkpoint, got, torch.device("cuda", 0))
    del got
    # Staged from the files' mappings: the staging ring is all that is page-locked, kept.
    assert pinned_pool().stats.pinned == 0 and _staging_ring_only()
    again = streamer_client.load_state_dict(few_gb_checkpoint, device="cuda:0", budget="1GiB")
    torch.cuda.synchronize()
    _check_against_truth(few_gb_checkpoint, again, torch.device("cuda", 0))
    assert _staging_ring_only(), "a reload in the same process registers nothing"
    release_process_pins()  # and nothing else is left page-locked


_RANK_SCRIPT = textwrap.dedent(
    """
    import json, sys, time
    import torch
    from safetensors.torch import load_file
    import streamer_client

    directory, device, rank = sys.argv[1], sys.argv[2], int(sys.argv[3])
    torch.cuda.init()
    start = time.perf_counter()
    got = streamer_client.load_state_dict(directory, device=device, rank=rank, world_size=2, budget="1GiB")
    torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    weight_map = json.load(open(f"{directory}/model.safetensors.index.json"))["weight_map"]
    assert got.keys() == weight_map.keys()
    nbytes = 0
    for shard in dict.fromkeys(weight_map.values()):
        for name, expected in load_file(f"{directory}/{shard}").items():
            t = got[name]
            assert t.device == torch.device(device) and t.dtype == expected.dtype and t.shape == expected.shape, name
            a = t.contiguous().reshape(-1).view(torch.uint8)
            b = expected.contiguous().reshape(-1).view(torch.uint8).to(device)
            assert torch.equal(a, b), name
            nbytes += a.numel()
    print(f"OK rank={rank} device={device} bytes={nbytes} seconds={seconds:.2f}")
    """
)


def _run_ranks(directory: Path, devices: list[str]) -> list[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "client"), str(REPO), env.get("PYTHONPATH", "")])
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RANK_SCRIPT, str(directory), device, str(rank)],
            env=env,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank, device in enumerate(devices)
    ]
    outputs = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-4000:]
        outputs.append(out.strip().splitlines()[-1])
    return outputs


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize(
    "devices",
    [
        pytest.param(["cuda:0", "cuda:0"], id="two-ranks-one-gpu"),
        pytest.param(
            ["cuda:0", "cuda:1"],
            id="one-rank-per-gpu",
            marks=pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
        ),
    ],
)
def test_two_processes_load_byte_exact_at_once(few_gb_checkpoint, devices):
    outputs = _run_ranks(few_gb_checkpoint, devices)
    for rank, line in enumerate(outputs):
        assert line.startswith(f"OK rank={rank} device={devices[rank]}"), line
    print("\n".join(outputs))
