"""Run:ai readers kept started between loads (``streamer_service.readers.kept``): real Run:ai readers
reading real files (a daemon reading S3 twice through one reader: tests/test_daemon.py)."""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
import pytest

from streamer_service.readers.base import FileReads, ReadRange
from streamer_service.readers.kept import KeptReaders
from streamer_service.readers.runai import NativeReader
from streamer_service.uri import parse_uri

PIECE = 1 << 20


@pytest.fixture
def blob(tmp_path: Path) -> tuple[Path, bytes]:
    data = np.random.default_rng(7).integers(0, 256, 3 * PIECE + 1234, dtype=np.uint8).tobytes()
    path = tmp_path / "ckpt" / "model.safetensors"  # the reader reads any bytes; the name is for its URI
    path.parent.mkdir()
    path.write_bytes(data)
    return path, data


@pytest.fixture
def kept():
    """``kept(idle_s, **kwargs)``: a KeptReaders closed after the test, so that no reader it keeps
    stays started (a started reader keeps Run:ai's variables in this process's environment)."""
    made: list[KeptReaders] = []

    def make(idle_s: float, **kwargs) -> KeptReaders:
        readers = KeptReaders(idle_s, **kwargs)
        made.append(readers)
        return readers

    yield make
    for readers in made:
        readers.close()
        assert readers.idle == 0


def _load(reader, path: Path, size: int, *, drain: bool = True) -> bytes:
    """Read the whole file through ``reader`` into a new buffer, in 1 MiB ranges; its bytes."""
    buffer = mmap.mmap(-1, size)
    base = np.frombuffer(buffer, dtype=np.uint8).ctypes.data
    ranges = tuple(ReadRange(o, min(PIECE, size - o), base + o) for o in range(0, size, PIECE))
    reader.submit([FileReads(str(path), ranges)], buffer)
    if not drain:
        return b""
    for answer in iter(reader.answer, None):
        assert answer.error is None, answer.error
    return bytes(buffer)


def test_a_reader_that_served_a_load_serves_the_next(blob, kept):
    path, data = blob
    uri = parse_uri(str(path.parent))
    readers = kept(60)
    with readers.reader(uri, NativeReader) as (first, was_kept):
        assert not was_kept
        assert _load(first, path, len(data)) == data
    assert readers.idle == 1 and first.reusable  # still started: runai_end was not called
    with readers.reader(uri, NativeReader) as (second, was_kept):
        assert second is first and was_kept
        assert _load(second, path, len(data)) == data
    assert readers.reused == 1
    # Another storage environment is another kind of reader: a new one, the kept one stays idle.
    with readers.reader(uri, NativeReader, {"RUNAI_STREAMER_CHUNK_BYTESIZE": str(PIECE)}) as (other, was_kept):
        assert other is not first and not was_kept
        assert _load(other, path, len(data)) == data
    assert readers.idle == 2
    readers.close()
    assert readers.idle == 0 and not first.reusable and not other.reusable  # both ended
    with readers.reader(uri, NativeReader) as (after, was_kept):
        assert not was_kept and _load(after, path, len(data)) == data
    assert readers.idle == 0 and not after.reusable  # a closed set keeps nothing


def test_a_reader_is_not_kept_after_a_failed_or_unfinished_load_nor_with_idle_s_0(blob, kept):
    path, data = blob
    uri = parse_uri(str(path.parent))
    readers = kept(60)
    with pytest.raises(RuntimeError, match="the load failed"), readers.reader(uri, NativeReader) as (failed, _):
        _load(failed, path, len(data))
        raise RuntimeError("the load failed")
    assert readers.idle == 0 and not failed.reusable
    # Reads still owed when the load ended (a load cut short): runai_end waits for them.
    with readers.reader(uri, NativeReader) as (cut, _):
        _load(cut, path, len(data), drain=False)
        assert not cut.reusable
    assert readers.idle == 0
    never = kept(0)
    with never.reader(uri, NativeReader) as (reader, _):
        assert _load(reader, path, len(data)) == data
    assert never.idle == 0 and not reader.reusable


def test_idle_readers_are_closed_after_idle_s_and_none_is_used_past_its_age(blob, kept):
    path, data = blob
    uri = parse_uri(str(path.parent))
    now = [100.0]
    readers = kept(30, max_age_s=600, clock=lambda: now[0])
    with readers.reader(uri, NativeReader) as (reader, _):
        _load(reader, path, len(data))
    now[0] = 129.0
    readers.trim(now[0])
    assert readers.idle == 1
    now[0] = 130.0
    readers.trim(now[0])
    assert readers.idle == 0 and not reader.reusable
    # Used again and again, a reader still goes once it is max_age_s old.
    with readers.reader(uri, NativeReader) as (old, _):  # started at 130
        _load(old, path, len(data))
    for t in (150.0, 170.0):
        now[0] = t
        with readers.reader(uri, NativeReader) as (same, was_kept):
            assert same is old and was_kept
    now[0] = 729.0
    with readers.reader(uri, NativeReader) as (same, was_kept):
        assert same is old and was_kept  # lent while still young enough...
        now[0] = 731.0
    assert readers.idle == 0 and not old.reusable  # ...and ended after a load that ended past its age
    with readers.reader(uri, NativeReader) as (new, was_kept):
        assert new is not old and not was_kept
        _load(new, path, len(data))
    now[0] = 1331.0
    with readers.reader(uri, NativeReader) as (newer, was_kept):  # an idle one as old as that is not lent
        assert newer is not new and not was_kept
    assert not new.reusable and readers.idle == 1  # newer, closed with the set after the test
