"""The contract with Run:ai's non-public native entry points (docs/architecture.md, "Data-path rules").

These tests are meant to fail loudly when runai-model-streamer changes: the
pinned version, the entry points and their parameter names, the response
codes we map, the C symbol we bind ourselves, and the behaviour we rely on
(ranged reads land byte-exact at the addresses we give).
"""

from __future__ import annotations

import gc
import importlib
import inspect
import json
import mmap
import os
import subprocess
import sys
import types
import weakref

import numpy as np
import pytest

from streamer_client.errors import ConfigError, ObjectChangedError, StorageError
from streamer_service.readers import runai
from streamer_service.readers.base import FileReads, ReadRange
from streamer_service.readers.runai import NativeReader, ResponseCode, contract

PINNED = "0.17.0"

# Written out here, not imported from streamer_service/readers/runai: a change on either side must fail this file.
EXPECTED_PARAMETERS = {
    "runai_start": (),
    "runai_request": ("streamer", "paths", "num_ranges", "range_offsets", "range_sizes", "range_dsts"),
    "runai_response": ("streamer", "timeout_ms"),
    "runai_response_str": ("response_code",),
    "runai_end": ("streamer",),
}

# Codes we treat differently, with a fragment of Run:ai's own description at 0.17.0.
EXPECTED_CODE_TEXT = {
    ResponseCode.SUCCESS: "successfuly",
    ResponseCode.FINISHED: "Finished all responses",
    ResponseCode.FILE_ACCESS_ERROR: "File access error",
    ResponseCode.END_OF_FILE: "End of file",
    ResponseCode.UNKNOWN_ERROR: "Unknown Error",
    ResponseCode.RANGE_SIZE_MISMATCH: "unexpected number of bytes",
    ResponseCode.TIMED_OUT: "Timed out",
    ResponseCode.RETRYABLE_ACCESS_ERROR: "Retryable object storage",
    ResponseCode.FS_STRATEGY_CONFLICT: "strategy was already set",
    ResponseCode.FS_STRATEGY_UNAVAILABLE: "None of the filesystem read strategies",
    ResponseCode.ASYNC_READER_FAILED: "asynchronous filesystem reader",
}


@pytest.fixture(scope="module")
def native():
    return importlib.import_module(runai.NATIVE_MODULE)


@pytest.fixture
def data_file(tmp_path):
    data = os.urandom(3 * 1024 * 1024 + 123)
    path = tmp_path / "data.bin"
    path.write_bytes(data)
    return path, data


class _Holder:
    """Owns a destination buffer; weak-referenceable, so a test can see when the reader drops it."""

    def __init__(self, buf: np.ndarray) -> None:
        self.buf = buf


def _buffer(nbytes: int) -> np.ndarray:
    return np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8)


# --------------------------------------------------------------------------- pins


@pytest.mark.parametrize("distribution", runai.DISTRIBUTIONS)
def test_every_distribution_is_the_pinned_version(distribution):
    assert runai.PINNED_VERSION == PINNED
    assert runai.installed_versions()[distribution] == PINNED, (
        f"{distribution} is not {PINNED}: the native entry points in streamer_service/readers/runai/ were "
        "written against it; re-check them and this file before moving the pin"
    )


def test_entry_points_have_the_expected_parameters(native):
    assert runai.ENTRY_POINTS == EXPECTED_PARAMETERS
    for name, params in EXPECTED_PARAMETERS.items():
        function = getattr(native, name)
        assert tuple(inspect.signature(function).parameters) == params, name


def test_fs_strategy_symbol_is_exported(native):
    assert hasattr(native.dll.lib, runai.FS_STRATEGY_SYMBOL)


@pytest.mark.parametrize("code, fragment", EXPECTED_CODE_TEXT.items(), ids=lambda v: str(v))
def test_response_codes_mean_what_we_map(native, code, fragment):
    assert fragment in native.runai_response_str(int(code)).decode()


def _python(code: str, *args: str) -> str:
    """What a fresh interpreter running ``code`` printed last."""
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1]


def test_nothing_native_is_loaded_at_import():
    code = (
        "import sys, streamer_service.readers.runai, streamer_service.embedded.engine; "
        "print([m for m in sys.modules if m.startswith('runai_model_streamer')])"
    )
    assert _python(code) == "[]"


_READ_WITHOUT_THE_PACKAGE = """
import ctypes, json, mmap, sys
from streamer_service.readers.base import FileReads, ReadRange
from streamer_service.readers.runai import NativeReader
path, size = sys.argv[1], int(sys.argv[2])
buf = mmap.mmap(-1, size)
with NativeReader(fs_strategy="sync_buffered") as reader:
    reader.submit([FileReads(path, (ReadRange(0, size, ctypes.addressof(ctypes.c_char.from_buffer(buf))),))], buf)
    (result,) = iter(reader.answer, None)
loaded = sorted(m for m in sys.modules if m in ("torch", "boto3") or m.startswith("runai_model_streamer"))
ok = result.error is None and buf[:] == open(path, "rb").read()
# Run:ai's own package is still whole for whoever imports it next (vLLM's Run:ai loader does).
from runai_model_streamer import SafetensorsStreamer
with SafetensorsStreamer() as streamer:
    streamer.stream_file(sys.argv[3])
    names = sorted(name for name, _ in streamer.get_tensors())
print(json.dumps({"ok": ok, "loaded": loaded, "names": names}))
"""


def test_the_native_reader_runs_without_runai_packages_init(data_file, tmp_path):
    # Run:ai's package __init__ imports torch, its Python streamers and (through its S3 helpers)
    # boto3: 0.24-0.33 s of a process's first load, and torch in every daemon. The wrapper needs none.
    from safetensors.numpy import save_file

    path, data = data_file
    checkpoint = tmp_path / "model.safetensors"
    save_file({"a": np.arange(6, dtype=np.float32), "b": np.ones(3, dtype=np.int64)}, str(checkpoint))
    got = json.loads(_python(_READ_WITHOUT_THE_PACKAGE, str(path), str(len(data)), str(checkpoint)))
    assert got == {"ok": True, "loaded": [], "names": ["a", "b"]}


def test_a_wrapper_imported_already_is_the_one_used():
    code = (
        "import runai_model_streamer.libstreamer.libstreamer as wrapper; "
        "from streamer_service.readers.runai.contract import load_native; print(load_native() is wrapper)"
    )
    assert _python(code) == "True"


# --------------------------------------------------------------------------- reads


@pytest.mark.parametrize("strategy", ["io_uring_buffered,sync_buffered", "sync_buffered", None])
def test_ranges_land_byte_exact_in_our_buffer(data_file, tmp_path, strategy):
    path, data = data_file
    other = tmp_path / "other.bin"
    other_data = os.urandom(5000)
    other.write_bytes(other_data)
    buf = _buffer(4 * 1024 * 1024)
    base = buf.ctypes.data
    # Unordered, non-contiguous ranges from two files, a zero-sized one, destinations anywhere.
    plan = {
        str(path): [(1_000_000, 2_000_000, 0), (7, 993, 3_000_000), (3_000_000, 0, 3_100_000), (0, 7, 3_100_001)],
        str(other): [(100, 4900, 3_200_003)],
    }
    files = [FileReads(p, tuple(ReadRange(o, n, base + d) for o, n, d in rs)) for p, rs in plan.items()]
    with NativeReader(fs_strategy=strategy) as reader:
        submission = reader.submit(files, keepalive=buf)
        results = list(iter(reader.answer, None))
    assert len(results) == 5 and {r.submission for r in results} == {submission}
    assert all(r.error is None for r in results)
    assert sum(r.submission_done for r in results) == 1
    sources = {str(path): data, str(other): other_data}
    for p, ranges in plan.items():
        for offset, nbytes, dst in ranges:
            assert buf[dst : dst + nbytes].tobytes() == sources[p][offset : offset + nbytes]


def test_several_submissions_in_flight_are_demultiplexed(data_file):
    path, data = data_file
    buffers = [_buffer(1 << 20) for _ in range(3)]
    with NativeReader(fs_strategy="sync_buffered") as reader:
        ids = [
            reader.submit([FileReads(str(path), (ReadRange(i << 20, 1 << 20, b.ctypes.data),))], keepalive=b)
            for i, b in enumerate(buffers)
        ]
        assert reader.outstanding == 3
        seen = {r.submission: r for r in iter(reader.answer, None)}
        assert reader.outstanding == 0
    assert set(seen) == set(ids)
    for i, b in enumerate(buffers):
        assert b.tobytes() == data[i << 20 : (i + 1) << 20]


def test_missing_file_is_a_storage_error_naming_path_and_range(tmp_path):
    buf = _buffer(4096)
    missing = str(tmp_path / "gone.safetensors")
    with NativeReader() as reader:
        reader.submit([FileReads(missing, (ReadRange(8, 100, buf.ctypes.data),))], keepalive=buf)
        (result,) = iter(reader.answer, None)
    assert type(result.error) is StorageError
    assert missing in str(result.error) and "[8, 108)" in str(result.error)
    assert result.error.uri == missing


def test_read_past_end_is_an_object_changed_error(data_file):
    path, data = data_file
    buf = _buffer(8192)
    with NativeReader() as reader:
        reader.submit([FileReads(str(path), (ReadRange(len(data) - 10, 100, buf.ctypes.data),))], keepalive=buf)
        (result,) = iter(reader.answer, None)
    assert isinstance(result.error, ObjectChangedError)
    assert f"[{len(data) - 10}, {len(data) + 90})" in str(result.error)


def test_buffers_are_released_once_every_range_answered(data_file):
    path, _ = data_file
    buf = _buffer(4096)
    holder = _Holder(buf)
    alive = weakref.ref(holder)
    with NativeReader() as reader:
        reader.submit([FileReads(str(path), (ReadRange(0, 4096, buf.ctypes.data),))], keepalive=holder)
        del holder
        gc.collect()
        assert alive() is not None, "the reader must hold the destination while the read is in flight"
        list(iter(reader.answer, None))
        gc.collect()
        assert alive() is None


class _UnknownErrorOnce:
    """Run:ai's module, except that the first answer reports UnknownError."""

    def __init__(self, real):
        self._real = real
        self._fired = False

    def __getattr__(self, name):
        return getattr(self._real, name)

    def runai_response(self, streamer, timeout_ms=0):
        raw = self._real.runai_response(streamer, timeout_ms)
        if raw is not None and not self._fired:
            self._fired = True
            return (int(ResponseCode.UNKNOWN_ERROR),) + tuple(raw[1:])
        return raw


def test_unknown_error_aborts_and_keeps_buffers_until_end(data_file):
    path, _ = data_file
    buf = _buffer(8192)
    holder = _Holder(buf)
    alive = weakref.ref(holder)
    reader = NativeReader()
    reader.start()
    reader._native = _UnknownErrorOnce(reader._native)
    ranges = (ReadRange(0, 4096, buf.ctypes.data), ReadRange(4096, 4096, buf.ctypes.data + 4096))
    reader.submit([FileReads(str(path), ranges)], keepalive=holder)
    del holder
    with pytest.raises(StorageError, match=r"Unknown Error.*aborting"):
        list(iter(reader.answer, None))
    with pytest.raises(StorageError, match="aborted"):
        reader.submit([FileReads(str(path), ranges)], keepalive=buf)
    gc.collect()
    assert alive() is not None, "after UnknownError the destination must outlive runai_end"
    reader.close()
    gc.collect()
    assert alive() is None


# --------------------------------------------------------------------------- fallbacks


def test_changed_entry_points_fail_at_start_naming_them(monkeypatch, native):
    def runai_request(streamer, paths, ranges):  # a changed signature
        raise AssertionError("must not be called")

    fake = types.SimpleNamespace(**{name: getattr(native, name) for name in EXPECTED_PARAMETERS})
    fake.runai_request = runai_request
    fake.dll = native.dll
    monkeypatch.setattr(contract, "_import_native", lambda: fake)
    with pytest.raises(ConfigError, match=r"runai_request.*0\.17\.0"):
        NativeReader().start()


def test_missing_native_module_fails_at_start(monkeypatch):
    def refuse():
        raise ImportError("No module named 'runai_model_streamer'")

    monkeypatch.setattr(contract, "_import_native", refuse)
    with pytest.raises(ConfigError, match="cannot load Run:ai's native reader"):
        NativeReader().start()


def test_unknown_fs_strategy_is_refused_at_start(monkeypatch):
    monkeypatch.delenv(runai.FS_STRATEGY_ENV, raising=False)
    with pytest.raises(ConfigError, match="no_such_strategy"):
        NativeReader(fs_strategy="no_such_strategy").start()


def test_operator_fs_strategy_wins(monkeypatch, data_file):
    # With the variable set no strategy of ours is applied: Run:ai follows the variable.
    from streamer_service.readers.choice import fs_strategy_for, open_reader
    from streamer_service.uri import parse_uri

    path, data = data_file
    uri = parse_uri(path.parent)
    monkeypatch.delenv(runai.FS_STRATEGY_ENV, raising=False)
    assert fs_strategy_for(uri) == runai.BUFFERED_FS_STRATEGY
    monkeypatch.setenv(runai.FS_STRATEGY_ENV, "sync_buffered")
    assert fs_strategy_for(uri) is None
    buf = _buffer(4096)
    with open_reader(uri, NativeReader) as reader:
        reader.submit([FileReads(str(path), (ReadRange(0, 4096, buf.ctypes.data),))], keepalive=buf)
        (result,) = iter(reader.answer, None)
    assert result.error is None and buf.tobytes() == data[:4096]


def test_storage_settings_reach_runai_only_while_a_reader_is_open(monkeypatch):
    from streamer_service.settings import Settings

    monkeypatch.setenv("RUNAI_STREAMER_S3_TIMEOUT", "7")  # the operator's own: it wins
    for name in ("RUNAI_STREAMER_S3_REQUEST_TIMEOUT_MS", "RUNAI_STREAMER_S3_MAX_RETRIES"):
        monkeypatch.delenv(name, raising=False)
    settings = Settings(storage_read_timeout_s=2.5, storage_retries=0, storage_retry_deadline_s=8.5)
    env = runai.storage_environment(settings)
    retries = {name: value for name, value in env.items() if "TIMEOUT" in name or "RETRIES" in name}
    assert retries == {"RUNAI_STREAMER_S3_REQUEST_TIMEOUT_MS": "2500", "RUNAI_STREAMER_S3_TIMEOUT": "9"}
    # The rest is the read parallelism the NIC rate asks for (tests/test_read_parallelism.py).
    assert set(env) - set(retries) <= {
        "RUNAI_STREAMER_OBJ_CONCURRENCY",
        "RUNAI_STREAMER_S3_TARGET_GBPS",
        "RUNAI_STREAMER_CHUNK_BYTESIZE",
    }
    assert runai.storage_environment(Settings(storage_retries=4))["RUNAI_STREAMER_S3_MAX_RETRIES"] == "4"
    with NativeReader(environment=env), NativeReader(environment=env):
        assert os.environ["RUNAI_STREAMER_S3_REQUEST_TIMEOUT_MS"] == "2500"
        assert os.environ["RUNAI_STREAMER_S3_TIMEOUT"] == "7"
    assert "RUNAI_STREAMER_S3_REQUEST_TIMEOUT_MS" not in os.environ  # restored once the last one closed
    assert os.environ["RUNAI_STREAMER_S3_TIMEOUT"] == "7"
