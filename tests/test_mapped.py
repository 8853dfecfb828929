"""Local checkpoints read through file mappings by the native copier (streamer_service.readers.mapped).

Ground truth is ``safetensors``; the failure cases cut real files short under real mappings.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from array import array
from pathlib import Path

import numpy as np
import pytest
import torch
from checkpoints import ground_truth, make_sharded_checkpoint, mixed_tensors, tensor_bytes
from held_pages import HeldPages

from streamer_client.errors import ObjectChangedError, SettingsError, StorageError
from streamer_service.checkpoint.catalog import build_catalog
from streamer_service.embedded.engine import EmbeddedEngine, EngineConfig
from streamer_service.readers import choice, mapped
from streamer_service.readers.base import FileReads, ReadRange
from streamer_service.readers.choice import reader_for
from streamer_service.readers.mapped import FileMaps, MappedReader, file_maps
from streamer_service.readers.runai import NativeReader
from streamer_service.settings import Settings
from streamer_service.storage import open_storage
from streamer_service.uri import parse_uri

MIB = 1024 * 1024


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    tensors = mixed_tensors(seed)
    g = torch.Generator().manual_seed(seed)
    tensors["big"] = torch.randn(1024, 1024, generator=g)  # 4 MiB: copied in 2 MiB chunks, oversized
    return tensors


@pytest.fixture
def checkpoint(tmp_path) -> tuple[Path, dict[str, torch.Tensor]]:
    make_sharded_checkpoint(tmp_path / "ckpt", _tensors(0), n_shards=3)
    return tmp_path / "ckpt", ground_truth(tmp_path / "ckpt")


def _engine(directory: Path, reader_factory=MappedReader, **kwargs) -> EmbeddedEngine:
    """An engine reading through ``reader_factory`` (``None``: the engine's own choice)."""
    uri = parse_uri(directory)
    catalog = build_catalog(open_storage(uri, Settings()))
    config = EngineConfig.from_settings(Settings(shm_budget="2MiB", slot_size="512KiB"))
    return EmbeddedEngine(uri, catalog, config, reader_factory=reader_factory, **kwargs)


def _load(engine: EmbeddedEngine, device: str = "cpu") -> dict[str, torch.Tensor]:
    return {name: tensor.cpu() for name, tensor in engine.stream(engine.plan(), device=device)}


HAS_CUDA = torch.cuda.is_available()


def _assert_equal(got: dict[str, torch.Tensor], truth: dict[str, torch.Tensor]) -> None:
    assert got.keys() == truth.keys()
    for name, tensor in truth.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert tensor_bytes(got[name]) == tensor_bytes(tensor), name


def _mapped_paths() -> set[str]:
    with open("/proc/self/maps") as maps:
        return {line.split(None, 5)[5].strip() for line in maps if len(line.split(None, 5)) == 6}


def test_the_copier_is_built_here():
    # CI installs with a C compiler: a build that silently fell back to Run:ai would hide here.
    assert mapped.available()


def test_a_local_load_reads_through_mappings_kept_for_the_next_load(checkpoint):
    directory, truth = checkpoint
    engine = _engine(directory)
    before = file_maps().mapped
    _assert_equal(_load(engine), truth)
    shards = sorted(str(p) for p in directory.glob("*.safetensors"))
    assert file_maps().mapped == before + len(shards)
    assert set(shards) <= set(file_maps().paths()) and set(shards) <= _mapped_paths()
    _assert_equal(_load(engine), truth)  # again: the same mappings, none made anew
    assert file_maps().mapped == before + len(shards)


def test_a_file_replaced_since_the_last_load_is_mapped_anew(checkpoint, tmp_path):
    directory, _ = checkpoint
    _load(_engine(directory))
    make_sharded_checkpoint(tmp_path / "next", _tensors(1), n_shards=3)  # same layout, other bytes
    truth = ground_truth(tmp_path / "next")
    for shard in (tmp_path / "next").glob("*.safetensors"):
        os.replace(shard, directory / shard.name)  # a new inode under the same path
    before = file_maps().mapped
    _assert_equal(_load(_engine(directory)), truth)
    assert file_maps().mapped == before + 3


def test_a_file_changed_in_place_is_mapped_anew(checkpoint):
    directory, truth = checkpoint
    _load(_engine(directory))
    shard = sorted(directory.glob("*.safetensors"))[0]
    st = shard.stat()
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    before = file_maps().mapped
    _assert_equal(_load(_engine(directory)), truth)
    assert file_maps().mapped == before + 1


class _StaleMaps(FileMaps):
    """Hands out the mapping made before the file was cut short (as a load that mapped it first)."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.stale = super().open(path)

    def open(self, path: str):
        return self.stale


def test_a_file_cut_short_under_its_mapping_fails_that_range_and_the_process_goes_on(tmp_path):
    path = tmp_path / "shard.bin"
    path.write_bytes(os.urandom(8 * MIB))
    maps = _StaleMaps(str(path))
    os.truncate(path, 3 * MIB)  # pages past 3 MiB now raise SIGBUS on access
    dst = np.zeros(8 * MIB, dtype=np.uint8)
    reads = (ReadRange(0, 2 * MIB, dst.ctypes.data), ReadRange(4 * MIB, 4 * MIB, dst.ctypes.data + 4 * MIB))
    with MappedReader(maps=maps) as reader:
        reader.submit([FileReads(str(path), reads)], keepalive=dst)
        results = list(iter(reader.answer, None))
    assert [r.error is None for r in results] == [True, False]
    error = results[1].error
    assert type(error) is ObjectChangedError and error.uri == str(path)
    assert str(error) == f"{path}: bytes [{4 * MIB}, {8 * MIB}): the file was cut short while it was read"
    assert bytes(dst[: 2 * MIB]) == path.read_bytes()[: 2 * MIB]


def test_a_submission_not_copied_within_the_wait_answers_none_and_its_ranges_come_later(tmp_path):
    """The ranges' destination is held by the kernel (``held_pages``): ``answer(0)`` ends with
    nothing and the ranges still owed; once the pages are let go both answers come, in order."""
    path = tmp_path / "shard.bin"
    path.write_bytes(os.urandom(8 * MIB))
    held = HeldPages(8 * MIB)
    dst = held.array
    reads = (ReadRange(0, 4 * MIB, dst.ctypes.data), ReadRange(4 * MIB, 4 * MIB, dst.ctypes.data + 4 * MIB))
    with MappedReader(maps=FileMaps()) as reader:
        reader.submit([FileReads(str(path), reads)], keepalive=dst)
        assert reader.answer(0) is None and reader.outstanding == 2
        held.release()
        first, second = reader.answer(), reader.answer(0)
        assert (first.range_index, second.range_index) == (0, 1) and first.error is second.error is None
        assert second.submission_done and reader.outstanding == 0 and reader.answer() is None
    assert bytes(dst) == path.read_bytes()


def test_a_range_past_the_end_of_the_file_is_refused_without_a_copy(tmp_path):
    path = tmp_path / "shard.bin"
    path.write_bytes(b"x" * MIB)
    dst = np.zeros(2 * MIB, dtype=np.uint8)
    with MappedReader(maps=FileMaps()) as reader:
        reader.submit([FileReads(str(path), (ReadRange(MIB // 2, MIB, dst.ctypes.data),))], keepalive=dst)
        (result,) = iter(reader.answer, None)
    assert type(result.error) is ObjectChangedError
    assert str(result.error) == (
        f"{path}: bytes [{MIB // 2}, {MIB + MIB // 2}): End of file: the file has {MIB} bytes, fewer than the checkpoint's header says"
    )
    assert not dst.any()


def test_a_missing_file_is_a_storage_error_naming_it(tmp_path):
    path = tmp_path / "gone.safetensors"
    dst = np.zeros(4096, dtype=np.uint8)
    with MappedReader(maps=FileMaps()) as reader:
        reader.submit([FileReads(str(path), (ReadRange(0, 4096, dst.ctypes.data),))], keepalive=dst)
        (result,) = iter(reader.answer, None)
    assert type(result.error) is StorageError and result.error.uri == str(path)
    assert str(result.error) == f"{path}: bytes [0, 4096): cannot open or map: No such file or directory"


def test_kept_mappings_hold_no_file_descriptors(tmp_path):
    # A checkpoint of a thousand shards must not hold a thousand descriptors while it is mapped.
    paths = []
    for i in range(20):
        paths.append(tmp_path / f"shard-{i}.bin")
        paths[-1].write_bytes(bytes([i]) * 8192)
    maps = FileMaps()
    before = len(os.listdir("/proc/self/fd"))
    for path in paths:
        maps.open(str(path))
    assert len(maps.paths()) == 20
    assert len(os.listdir("/proc/self/fd")) == before
    assert {str(p) for p in paths} <= _mapped_paths()


def test_a_bus_error_outside_the_copier_still_ends_the_process(tmp_path):
    # The copier's SIGBUS handler catches only its own threads' faults; any other goes on as before.
    path = tmp_path / "cut.bin"
    script = textwrap.dedent(
        f"""
        import mmap, os
        from streamer_service.readers import mapped
        mapped._pool()  # installs the copier's handler
        with open({str(path)!r}, "wb") as f:
            f.write(b"x" * (4 << 20))
        with open({str(path)!r}, "rb") as f:
            m = mmap.mmap(f.fileno(), 4 << 20, prot=mmap.PROT_READ)
        os.truncate({str(path)!r}, 4096)
        print("touching", flush=True)
        m[3 << 20]
        print("survived", flush=True)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == -signal.SIGBUS, done.stderr
    assert done.stdout == "touching\n"


def test_idle_mappings_are_unmapped_and_none_while_a_reader_is_open(tmp_path):
    path = tmp_path / "shard.bin"
    path.write_bytes(b"y" * MIB)
    now = [0.0]
    maps = FileMaps(idle_s=30, clock=lambda: now[0])
    maps.enter()
    maps.open(str(path))
    now[0] = 100.0
    assert maps.sweep() == 0  # a reader is open: it may still copy out of it
    assert str(path) in _mapped_paths()
    maps.leave()
    assert maps.sweep() == 1
    assert maps.paths() == [] and str(path) not in _mapped_paths()


def test_readers_of_several_threads_share_the_copier(checkpoint):
    directory, truth = checkpoint
    results: list[dict[str, torch.Tensor] | BaseException] = []

    def load() -> None:
        try:
            results.append(_load(_engine(directory)))
        except BaseException as exc:  # noqa: BLE001 - reported below
            results.append(exc)

    threads = [threading.Thread(target=load) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(results) == 4
    for got in results:
        assert isinstance(got, dict), got
        _assert_equal(got, truth)


def test_which_reader_reads_what(monkeypatch, tmp_path):
    local, remote = parse_uri(tmp_path), parse_uri("s3://bucket/model")
    assert reader_for(local) is MappedReader
    assert reader_for(local, "runai") is NativeReader
    assert reader_for(remote) is NativeReader
    assert reader_for(local, into_callers_memory=True) is NativeReader  # an in-process CPU load
    assert (choice.fs_strategy_for(local), choice.fs_strategy_for(remote)) == ("sync_buffered", None)
    monkeypatch.setenv("RUNAI_STREAMER_FS_STRATEGY", "io_uring_direct")  # the operator chose Run:ai's
    assert reader_for(local) is NativeReader
    assert choice.fs_strategy_for(local) is None  # and Run:ai follows the variable


def _mapped_here(directory: Path) -> set[str]:
    return set(file_maps().paths()) & {str(p) for p in directory.glob("*.safetensors")}


def test_an_embedded_cpu_load_reads_through_runai_and_maps_nothing(checkpoint):
    # CPU tensors are read straight into memory the caller keeps; a mapping would only add the
    # checkpoint's pages to the process's RSS for as long as it is kept.
    directory, truth = checkpoint
    before = file_maps().mapped
    _assert_equal(_load(_engine(directory, reader_factory=None)), truth)
    assert file_maps().mapped == before and not _mapped_here(directory)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("local_reader", ["mapped", "runai"])
def test_an_embedded_cuda_load_reads_through_mappings_unless_set_otherwise(checkpoint, monkeypatch, local_reader):
    directory, truth = checkpoint
    monkeypatch.setenv("STREAMER_LOCAL_READER", local_reader)
    before = file_maps().mapped
    _assert_equal(_load(_engine(directory, reader_factory=None), "cuda:0"), truth)
    if local_reader == "mapped":
        assert file_maps().mapped == before + 3 and len(_mapped_here(directory)) == 3
    else:
        assert file_maps().mapped == before and not _mapped_here(directory)


def test_what_the_daemon_reports_it_reads_local_dirs_with(monkeypatch, tmp_path):
    assert choice.local_reader_in_force() == "mapped"
    assert choice.local_reader_in_force("runai") == "runai (STREAMER_LOCAL_READER=runai)"
    monkeypatch.setenv("RUNAI_STREAMER_FS_STRATEGY", "io_uring_direct")
    assert choice.local_reader_in_force() == "runai (RUNAI_STREAMER_FS_STRATEGY is set)"
    monkeypatch.delenv("RUNAI_STREAMER_FS_STRATEGY")
    monkeypatch.setattr(mapped, "_copier", None)  # as where the extension did not build
    assert choice.local_reader_in_force() == (
        "runai (the native copier is not built: reinstall streamer-service with a C compiler)"
    )
    assert reader_for(parse_uri(tmp_path)) is NativeReader


def test_a_bad_local_reader_setting_is_refused(monkeypatch):
    monkeypatch.setenv("STREAMER_LOCAL_READER", "fast")
    with pytest.raises(SettingsError, match="^STREAMER_LOCAL_READER='fast': not one of mapped, runai$"):
        Settings()


def test_the_copier_refuses_bad_batches():
    pool = mapped._pool()
    with pytest.raises(ValueError, match="one destination, source and size per copy"):
        mapped._copier.submit(pool, array("Q", [1]).tobytes(), b"", b"")
    with pytest.raises(ValueError, match="no batch 123456 is queued"):
        mapped._copier.wait(pool, 123456, 0)
    own = mapped._copier.pool(1, 4096)
    mapped._copier.close(own)
    with pytest.raises(ValueError, match="closed"):
        mapped._copier.submit(own, b"", b"", b"")


def _load_in_forked_child(directory: str, queue) -> None:
    try:
        got = _load(_engine(Path(directory)))
        queue.put({name: tensor_bytes(t) for name, t in got.items()})
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        queue.put(repr(exc))


# Forking a process whose copier threads run is the case under test (Python 3.12 warns of it).
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded, use of fork:DeprecationWarning")
def test_a_forked_child_reads_with_copier_threads_of_its_own(checkpoint):
    # The parent's copier threads are not in a fork: a child using the parent's pool would queue
    # copies nobody makes, and wait for ever.
    import multiprocessing

    directory, truth = checkpoint
    _load(_engine(directory))  # the parent's pool and mappings exist
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_load_in_forked_child, args=(str(directory), queue))
    child.start()
    try:
        got = queue.get(timeout=60)
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()
    assert isinstance(got, dict), got
    assert got == {name: tensor_bytes(t) for name, t in truth.items()}
    assert child.exitcode == 0
