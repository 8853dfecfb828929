"""Host bytes -> tensors (streamer_client._delivery), and the request checks both modes share.

Through a real daemon where the mode matters; ground truth is safetensors. The CUDA paths
(staged and pinned segments) are checked where a GPU is present (tests/test_cuda_daemon.py has
the rest of the device cases).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
from checkpoints import ground_truth, tensor_bytes
from smaps import mapping

import streamer_client
from streamer_client import _delivery as delivery
from streamer_client import _native_copier as copier
from streamer_client.errors import ConfigError, DaemonError, SettingsError

HAS_CUDA = torch.cuda.is_available()


def _assert_equal(got: dict[str, torch.Tensor], truth: dict[str, torch.Tensor]) -> None:
    assert got.keys() == truth.keys()
    for name, tensor in truth.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert tensor_bytes(got[name].cpu()) == tensor_bytes(tensor), name


def test_borrowed_cuda_tensors_through_a_daemon_are_the_documented_config_error(sample, daemon):
    d = daemon()
    with pytest.raises(ConfigError, match=r"^borrowed views are CPU memory; device 'cuda:0' needs a copy anyway$"):
        streamer_client.stream(sample, device="cuda:0", borrowed=True, socket=d.socket)
    assert d.stats()["finished"] == []  # refused before any session was joined
    assert d.healthy()


def test_borrowed_cuda_tensors_in_process_are_the_same_error(sample, monkeypatch):
    monkeypatch.setenv("STREAMER_SOCKET", str(sample / "no-daemon.sock"))
    with pytest.raises(ConfigError, match=r"^borrowed views are CPU memory; device 'cuda:0' needs a copy anyway$"):
        streamer_client.stream(sample, device="cuda:0", borrowed=True)


def test_a_bad_budget_through_a_daemon_is_refused_before_the_load(sample, daemon):
    d = daemon()
    with pytest.raises(SettingsError, match=r"^invalid argument: budget='lots': "):
        streamer_client.stream(sample, socket=d.socket, budget="lots")
    assert d.stats()["finished"] == []


def test_a_budget_through_a_daemon_says_the_daemon_s_budget_applies(sample, daemon):
    d = daemon({"STREAMER_SLOT_SIZE": "1MiB"}, "--shm-budget", "4MiB")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = streamer_client.load_state_dict(sample, socket=d.socket, budget="256KiB")
    said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert said == [
        f"budget= applies to in-process loads only; the daemon at {d.socket} loads with its own (serve --shm-budget, --cache-dir)"
    ]
    _assert_equal(got, ground_truth(sample))


CPU_LOAD = """
import json, sys
import streamer_client
from streamer_client import _native_copier as copier
state = streamer_client.load_state_dict(sys.argv[1])
print(json.dumps({"pool": copier._POOL.peek() is not None, "n": len(state)}))
"""


def test_owned_cpu_tensors_from_a_daemon_are_copied_by_the_copier_threads(sample, daemon, tmp_path):
    d = daemon({"STREAMER_SLOT_SIZE": "2MiB"}, "--shm-budget", "8MiB")
    result = subprocess.run(
        [sys.executable, "-c", CPU_LOAD, str(sample)], env=d.rank_env(), capture_output=True, text=True, timeout=180
    )
    assert result.returncode == 0, result.stderr[-2000:]
    reply = json.loads(result.stdout.splitlines()[-1])
    assert reply == {"pool": copier.available(), "n": len(ground_truth(sample))}
    # Byte-exact, in this process too (the same path).
    _assert_equal(streamer_client.load_state_dict(sample, socket=d.socket), ground_truth(sample))


def _mapped_source(tmp_path, size: int, seed: int):
    """Random bytes in a file and a read-only mapping of it: (bytes, path, mapping, array over it)."""
    import mmap

    data = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
    path = tmp_path / "source"
    path.write_bytes(data.tobytes())
    with open(path, "rb") as f:
        mapping = mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ)
    return data, path, mapping, np.frombuffer(mapping, dtype=np.uint8)


@pytest.mark.skipif(not copier.available(), reason="the native copier is not built")
def test_a_source_cut_short_under_a_cpu_copy_is_the_callers_error_not_a_crash(tmp_path):
    size = 4 * copier.CHUNK_BYTES
    data, path, mapping, array = _mapped_source(tmp_path, size, seed=2)
    os.truncate(path, copier.CHUNK_BYTES)
    head = copier.CHUNK_BYTES // 2
    items = [(array[:head], "U8", (head,)), (array[head:], "U8", (size - head,))]
    with pytest.raises(DaemonError, match=r"^item 1 was cut short$"):
        delivery.copy_to_cpu(items, lambda i: DaemonError(f"item {i} was cut short"))
    got = delivery.copy_to_cpu(items[:1], lambda i: DaemonError(f"item {i} was cut short"))
    assert got[0].numpy().tobytes() == data[:head].tobytes()


def test_small_and_empty_cpu_copies_are_byte_exact():
    data = np.arange(1000, dtype=np.uint8)
    items = [(data[:0], "F32", (0, 3)), (data[:8], "F32", (2,)), (data[8:1000], "U8", (992,))]
    got = delivery.copy_to_cpu(items, lambda i: AssertionError(i))
    assert [t.shape for t in got] == [(0, 3), (2,), (992,)]
    assert got[1].numpy().tobytes() == data[:8].tobytes() and got[2].numpy().tobytes() == data[8:].tobytes()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("pin", ["never", "always", "auto"])
def test_cuda_loads_through_a_daemon_are_byte_exact_staged_or_pinned(sample, daemon, monkeypatch, pin):
    from streamer_client._cuda import registered_ranges
    from streamer_client._segments import segment_maps

    d = daemon({"STREAMER_SLOT_SIZE": "1MiB"}, "--shm-budget", "4MiB")
    monkeypatch.setenv("STREAMER_PIN_SEGMENTS", pin)
    before = set(registered_ranges())
    got = streamer_client.load_state_dict(sample, socket=d.socket, device="cuda:0")
    torch.cuda.synchronize()
    _assert_equal(got, ground_truth(sample))
    # Counted, not looked up: the daemon (idle segments off) unlinks the segments once the load
    # ends, and the rank unmaps them as soon as it sees them gone.
    maps = segment_maps(d.shm_dir)
    if pin == "always":
        assert maps.stats.mapped and maps.stats.pinned  # page-locked, kept for the next load of this process
    else:  # staged (auto: this process's first load of these segments)
        assert maps.stats.mapped and maps.stats.pinned == 0 and delivery.staging_pinned()
    maps.close()
    assert set(registered_ranges()) - before <= {b.ctypes.data for b in delivery._RING._slots or []}


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or not copier.available(), reason="needs CUDA and the native copier")
def test_staged_windows_are_byte_exact_and_a_source_cut_short_names_its_item(tmp_path):
    """Items crossing the staging ring's windows (one window filled while the one before is queued
    to the device); a source truncated under its mapping fails its item and leaves the ring whole."""
    from streamer_client._cuda import PinnedCopier

    window = delivery.STAGING_SLOT_BYTES
    size = 2 * window + window // 2
    data, path, mapping, array = _mapped_source(tmp_path, size, seed=7)
    cuts = [0, 1000, 1000 + window, size - 7, size]  # item 2 runs from the second window into the third
    items = [(array.ctypes.data + a, "U8", (b - a,)) for a, b in zip(cuts, cuts[1:])]
    pinned = PinnedCopier("cuda:0")
    staging = delivery.Staging(pinned)
    try:
        outs = staging.copy(items, lambda i: DaemonError(f"item {i} was cut short"))
        torch.cuda.synchronize()
        assert b"".join(t.cpu().numpy().tobytes() for t in outs) == data.tobytes()
        os.truncate(path, 2 * window)  # the third window's sources are gone
        with pytest.raises(DaemonError, match=r"^item 2 was cut short$"):
            staging.copy(items, lambda i: DaemonError(f"item {i} was cut short"))
        outs = staging.copy(items[:2], lambda i: DaemonError(f"item {i} was cut short"))  # the ring is whole
        torch.cuda.synchronize()
        assert b"".join(t.cpu().numpy().tobytes() for t in outs) == data[: cuts[2]].tobytes()
    finally:
        staging.close()
        pinned.close()
        del array, items
        mapping.close()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or not copier.available(), reason="needs CUDA and the native copier")
def test_held_windows_are_finished_by_the_next_copy_and_a_cut_short_one_names_its_own_item(tmp_path):
    """Copies with ``hold`` stream into one another: each call's last window is finished by the
    next call (or ``flush``), byte-exact; a held window whose source was cut short raises the error
    of its own call's item from the call that finishes it; ``abandon`` and ``close`` take a held
    window back."""
    from streamer_client._cuda import PinnedCopier

    window = delivery.STAGING_SLOT_BYTES
    size = 3 * window
    data, path, mapping, array = _mapped_source(tmp_path, size, seed=11)
    base = array.ctypes.data
    # Three calls: one and a half windows, half a window plus one, the rest; then an empty call.
    calls = [[(0, 1000), (1000, window + window // 2)], [(window + window // 2, 2 * window + 1)], [(2 * window + 1, size)]]
    pinned = PinnedCopier("cuda:0")
    staging = delivery.Staging(pinned)
    try:
        outs = []
        for n, call in enumerate(calls):
            items = [(base + a, "U8", (b - a,)) for a, b in call]
            outs += staging.copy(items, lambda i, n=n: DaemonError(f"call {n} item {i}"), hold=True)
        assert staging.copy([], lambda i: DaemonError(f"empty call item {i}"), hold=True) == []  # finishes the held one
        torch.cuda.synchronize()
        assert b"".join(t.cpu().numpy().tobytes() for t in outs) == data.tobytes()

        os.truncate(path, window)  # from here on the mapping's second window is cut short
        first = [(base, "U8", (window + window // 2,))]  # its held last window reads the cut-short part
        staging.copy(first, lambda i: DaemonError(f"first item {i}"), hold=True)  # returns before it is finished
        with pytest.raises(DaemonError, match=r"^first item 0$"):
            staging.copy([(base, "U8", (100,))], lambda i: DaemonError(f"second item {i}"), hold=True)
        outs = staging.copy([(base, "U8", (window,))], lambda i: AssertionError(i))  # the ring is whole
        torch.cuda.synchronize()
        assert outs[0].cpu().numpy().tobytes() == data[:window].tobytes()

        staging.copy([(base, "U8", (window // 2,))], lambda i: AssertionError(i), hold=True)
        staging.abandon()  # the held window is waited for and dropped: the next copy starts afresh
        outs = staging.copy([(base + 5, "U8", (window - 5,))], lambda i: AssertionError(i))
        torch.cuda.synchronize()
        assert outs[0].cpu().numpy().tobytes() == data[5:window].tobytes()

        staging.copy([(base, "U8", (window // 2,))], lambda i: AssertionError(i), hold=True)
    finally:
        staging.close()  # a window still held: waited for, its slot taken back
        pinned.close()
        del array
        mapping.close()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or not copier.available(), reason="needs CUDA and the native copier")
def test_staged_batches_are_finished_in_order_once_their_last_window_is_copied_out(tmp_path):
    """``copy_batch`` names what each call finishes: the batch held before (its last window
    finished by this call's first), and this one unless its last window is held; a batch of no
    items finishes at once; ``flush_batch`` finishes the held one; ``abandon`` drops it."""
    from streamer_client._cuda import PinnedCopier

    window = delivery.STAGING_SLOT_BYTES
    size = 2 * window
    data, _, mapping, array = _mapped_source(tmp_path, size, seed=13)
    base = array.ctypes.data
    cut = window + window // 2
    batches = {"a": [(0, 1000), (1000, cut)], "b": [(cut, size)]}  # "a" ends in the middle of its second window
    pinned = PinnedCopier("cuda:0")
    staging = delivery.Staging(pinned)
    fault = lambda i: AssertionError(i)  # noqa: E731
    try:
        items = {k: [(base + a, "U8", (b - a,)) for a, b in spans] for k, spans in batches.items()}
        assert staging.copy_batch("a", items["a"], fault, hold=True) == []  # its last window still filling
        finished = staging.copy_batch("b", items["b"], fault, hold=True)
        assert [k for k, _ in finished] == ["a"] and staging.holding
        assert [k for k, _ in staging.copy_batch("empty", [], fault, hold=True)] == ["b", "empty"]
        assert staging.flush_batch() == [] and not staging.holding
        torch.cuda.synchronize()
        got = finished[0][1]
        assert b"".join(t.cpu().numpy().tobytes() for t in got) == data[:cut].tobytes()

        assert staging.copy_batch("c", items["b"], fault, hold=True) == []
        [(key, outs)] = staging.flush_batch()
        torch.cuda.synchronize()
        assert key == "c" and outs[0].cpu().numpy().tobytes() == data[cut:].tobytes()

        staging.copy_batch("d", items["a"], fault, hold=True)
        staging.abandon()  # "d" is dropped, never finished
        assert staging.flush_batch() == [] and [k for k, _ in staging.copy_batch("e", items["b"], fault)] == ["e"]
    finally:
        staging.close()
        pinned.close()
        del array
        mapping.close()


@pytest.mark.skipif(
    not copier.available() or not hasattr(__import__("mmap"), "MADV_HUGEPAGE"), reason="needs the native copier and THP"
)
def test_large_owned_cpu_tensors_are_advised_for_huge_pages_before_they_are_written():
    data = np.random.default_rng(3).integers(0, 256, 6 * 1024 * 1024 + 10, dtype=np.uint8)
    items = [(data[:10], "U8", (10,)), (data[10:], "BF16", (3 * 1024 * 1024,))]
    small, large = delivery.copy_to_cpu(items, lambda i: AssertionError(i))
    assert small.numpy().tobytes() == data[:10].tobytes()
    assert large.view(torch.uint8).numpy().tobytes() == data[10:].tobytes()
    middle = large.data_ptr() + large.nbytes // 2
    assert "hg" in mapping(middle)["VmFlags"].split()
