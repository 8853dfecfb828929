"""Ingest from object storage with a request latency: the latency proxy, and the pipeline's bytes in flight.

Loopback answers in microseconds, so there a pipeline that keeps one request in flight reads as
fast as one that keeps many. Behind ``LatencyProxy`` (each request held 30 ms, as a remote
object store answers), a load must keep several batches in flight, and no more bytes than its
bound. Real parts: moto on 127.0.0.1, the proxy's real sockets, Run:ai's native reader.
"""

from __future__ import annotations

import contextlib
import http.client
import http.server
import threading
import time
from types import SimpleNamespace

import boto3
import pytest
import torch
from botocore.config import Config
from checkpoints import ground_truth, make_sharded_checkpoint

from streamer_client.errors import ObjectChangedError
from streamer_service.bench.latency import LatencyProxy
from streamer_service.checkpoint.catalog import build_catalog
from streamer_service.checkpoint.plan import build_plan
from streamer_service.checkpoint.versions import CHECK_THREADS, ObjectVersions
from streamer_service.embedded.engine import EmbeddedEngine, EngineConfig
from streamer_service.load.pipeline import LoadStats, Pipeline
from streamer_service.readers import mapped
from streamer_service.readers.base import FileReads, ReadRange
from streamer_service.settings import Settings
from streamer_service.sizing import submission_size
from streamer_service.storage import open_storage
from streamer_service.uri import parse_uri

KIB = 1024


def _new_memory(batch):
    """A pipeline's buffer source: new memory for each batch (``memory`` keeps it alive)."""
    memory = torch.empty(batch.buffer_bytes, dtype=torch.uint8)
    return SimpleNamespace(address=memory.data_ptr(), nbytes=memory.numel(), memory=memory), None


DELAY_S = 0.030


def test_the_proxy_holds_every_request_and_passes_bytes_unchanged(s3_service):
    body = bytes(range(256)) * 4096  # 1 MiB
    bucket = s3_service.new_backend()
    try:
        bucket.put("blob", body)
        with LatencyProxy.for_url(s3_service.emulator.endpoint, 0.2) as proxy:
            client = boto3.client(
                "s3", endpoint_url=proxy.endpoint, region_name="us-east-1", aws_access_key_id="testing",
                aws_secret_access_key="testing", config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}),
            )  # fmt: skip
            started = time.monotonic()
            got = []
            for first in (0, 1000, 500_000):  # three ranged GETs, on one keep-alive connection
                reply = client.get_object(Bucket=bucket.bucket, Key="blob", Range=f"bytes={first}-{first + 99_999}")
                got.append((reply["ResponseMetadata"]["HTTPStatusCode"], reply["Body"].read()))
            elapsed = time.monotonic() - started
            client.close()
        assert got == [(206, body[f : f + 100_000]) for f in (0, 1000, 500_000)]
        assert proxy.counts.requests == 3  # moto closes each connection after its response
        assert proxy.counts.bytes_down > 300_000
        assert elapsed >= 3 * 0.2  # each request was held (a lower bound: a loaded machine only adds)
    finally:
        bucket.close()


def test_the_proxy_holds_each_request_of_a_keep_alive_connection():
    """HTTP/1.1 clients send the next request on the same connection once the response came: each
    is held again."""

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self):
            body = self.path.encode() * 50_000
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with LatencyProxy("127.0.0.1", server.server_address[1], 0.2) as proxy:
            connection = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=60)
            started = time.monotonic()
            bodies = []
            for path in ("/a", "/bb", "/ccc"):
                connection.request("GET", path)
                bodies.append(connection.getresponse().read())
            elapsed = time.monotonic() - started
            connection.close()
        assert bodies == [p.encode() * 50_000 for p in ("/a", "/bb", "/ccc")]
        assert (proxy.counts.requests, proxy.counts.connections) == (3, 1)
        assert elapsed >= 3 * 0.2
    finally:
        server.shutdown()
        server.server_close()


def test_the_proxy_refuses_what_it_cannot_front():
    with pytest.raises(ValueError, match="plain http://host:port endpoint, got 'https://example.com'"):
        LatencyProxy.for_url("https://example.com", 0.03)
    with pytest.raises(ValueError, match="delay must be >= 0 s"):
        LatencyProxy("127.0.0.1", 1, -1)


@pytest.fixture
def slow_s3(s3_service, tmp_path, monkeypatch):
    """A 24-tensor checkpoint (256 KiB each, 2 shards) in a moto bucket reached through a 30 ms proxy."""
    src = tmp_path / "ckpt"
    make_sharded_checkpoint(src, {f"w{i:02d}": torch.full((64, 1024), float(i)) for i in range(24)}, n_shards=2)
    bucket = s3_service.new_backend()
    bucket.put_tree("m", {p.name: p.read_bytes() for p in src.iterdir() if p.is_file()})
    proxy = LatencyProxy.for_url(s3_service.emulator.endpoint, DELAY_S).start()
    for key, value in s3_service.env_for(proxy.endpoint).items():
        monkeypatch.setenv(key, value)
    try:
        yield bucket.uri("m"), ground_truth(src), proxy
    finally:
        proxy.close()
        bucket.close()


def test_a_load_behind_latency_keeps_batches_in_flight_within_its_bound(slow_s3):
    """Slots of 512 KiB, a budget of 16 of them, at most two slots' bytes in flight, in Run:ai
    requests of whole batches and up to half of that: more than one request is asked for (their
    waits overlap), never more bytes than the bound, and every tensor equals safetensors' own."""
    uri_text, truth, proxy = slow_s3
    uri = parse_uri(uri_text)
    catalog = build_catalog(open_storage(uri, Settings()))
    slot = 512 * KIB
    engine = EmbeddedEngine(uri, catalog, EngineConfig(budget=16 * slot, slot_size=slot, in_flight=2 * slot))
    before = proxy.counts.requests
    got = {name: tensor.clone() for name, tensor in engine.stream(engine.plan())}
    assert got.keys() == truth.keys()
    for name, tensor in truth.items():
        assert torch.equal(got[name], tensor), name
    assert engine.stats.bytes_read == sum(t.numel() * t.element_size() for t in truth.values())
    plan = engine.plan()
    batches = [b for b in plan.batches if b.ranges]
    per_request = max(1, slot // max(b.data_bytes for b in batches))  # whole batches in half the bound
    assert len(batches) >= 12 and len(batches) / per_request <= engine.stats.submissions < len(batches)
    assert engine.stats.peak_in_flight_bytes <= 2 * slot  # the bound, not the budget's 16 slots
    assert engine.stats.peak_in_flight >= 2  # the next request was asked for while one waited
    assert proxy.counts.requests - before >= engine.stats.submissions  # every batch through held requests


@pytest.mark.skipif(not mapped.available(), reason="the native copier is not built")
def test_a_local_load_reads_one_batch_a_request_whatever_its_bound(tmp_path):
    """A local directory has no request latency to hide, and its reader (the daemon's: mapped files)
    answers a request once all of it is copied: with a bound in flight that groups object-storage
    batches four to a request, each local batch is a request of its own, so the head batch is
    handed on as soon as it is in memory."""
    src = tmp_path / "ckpt"
    truth = {f"w{i}": torch.full((128, 256), float(i)) for i in range(16)}
    make_sharded_checkpoint(src, truth, n_shards=2)
    uri = parse_uri(str(src))
    catalog = build_catalog(open_storage(uri, Settings()))
    slot = 128 * KIB
    plan = build_plan(list(catalog.tensors), slot)
    batches = [b for b in plan.batches if b.ranges]
    assert len(batches) == 16 and submission_size(8 * slot) == 4 * slot

    stats = LoadStats()
    got = {}
    with mapped.MappedReader() as reader:
        pipeline = Pipeline(uri, plan, reader, _new_memory, stats, in_flight=8 * slot)
        for load in pipeline.loaded(lambda: None):
            for placed in load.batch.placements:
                start = placed.buffer_offset
                got[placed.tensor.name] = load.buffer.memory[start : start + placed.tensor.nbytes].clone()
    for name, tensor in truth.items():
        assert torch.equal(got[name].view(torch.float32).view(tensor.shape), tensor), name
    assert stats.submissions == len(batches)


def test_the_loads_line_counts_the_time_its_version_checks_held_the_loading_thread(tmp_path):
    src = tmp_path / "ckpt"
    make_sharded_checkpoint(src, {f"w{i}": torch.full((64, 64), float(i)) for i in range(4)}, n_shards=1)
    uri = parse_uri(str(src))
    plan = build_plan(list(build_catalog(open_storage(uri, Settings())).tensors), 16 * KIB)
    checked = []

    def check(batch, landed):
        checked.append(batch)
        time.sleep(0.01)  # a HEAD's round trip, at least

    versions = SimpleNamespace(
        expect=lambda batch, landed: expected.append(batch), answered=lambda b, landed, wait_s: True, check=check
    )
    expected = []
    stats = LoadStats()
    with mapped.MappedReader() as reader:
        loads = list(Pipeline(uri, plan, reader, _new_memory, stats, versions).loaded(lambda: None))
    assert len(checked) == len(loads) == sum(1 for b in plan.batches if b.ranges) == 4
    assert expected == checked  # each asked for as it landed, in the order they were delivered
    assert stats.verify_seconds >= 0.04
    assert stats.describe(time.monotonic()).endswith(f"{stats.verify_seconds:.3f} s checking versions")


@pytest.mark.skipif(not mapped.available(), reason="the native copier is not built")
def test_buffers_taken_while_a_check_is_out_count_as_getting_buffers_not_as_checking(tmp_path):
    """The first batch's HEAD is answered only once the third batch got its buffer, which takes
    0.2 s (a segment being made): those 0.2 s are the line's getting buffers, and not also its
    checking versions."""
    src = tmp_path / "ckpt"
    make_sharded_checkpoint(src, {f"w{i}": torch.full((64, 64), float(i)) for i in range(4)}, n_shards=1)
    uri = parse_uri(str(src))
    plan = build_plan(list(build_catalog(open_storage(uri, Settings())).tensors), 16 * KIB)
    first, _, third, _ = [b for b in plan.batches if b.ranges]
    made = threading.Event()

    def acquire(batch):
        if batch is third:  # asked for while the first batch's check is out
            time.sleep(0.2)
            made.set()
        return _new_memory(batch)

    versions = SimpleNamespace(
        expect=lambda batch, landed: None,
        answered=lambda batch, landed, wait_s: batch is not first or made.is_set(),
        check=lambda batch, landed: None,
    )
    stats = LoadStats()
    with mapped.MappedReader() as reader:
        loads = list(Pipeline(uri, plan, reader, acquire, stats, versions, in_flight=16 * KIB).loaded(lambda: None))
    assert len(loads) == 4 and made.is_set()
    assert stats.acquire_seconds >= 0.2
    assert stats.verify_seconds < 0.2  # the loop's own polls, not the buffer's 0.2 s again


def test_the_request_a_landed_batch_made_room_for_goes_out_before_its_version_check(tmp_path):
    """One batch's bytes in flight: the next batch is submitted as soon as the head lands, so the
    read goes on while the head waits for its HEAD's answer (and its hand-over)."""
    src = tmp_path / "ckpt"
    make_sharded_checkpoint(src, {f"w{i}": torch.full((64, 64), float(i)) for i in range(4)}, n_shards=1)
    uri = parse_uri(str(src))
    plan = build_plan(list(build_catalog(open_storage(uri, Settings())).tensors), 16 * KIB)
    batches = [b for b in plan.batches if b.ranges]
    submitted_at_check = []

    stats = LoadStats()
    versions = SimpleNamespace(
        expect=lambda batch, landed: None,
        answered=lambda b, landed, wait_s: True,
        check=lambda b, landed: submitted_at_check.append(stats.submissions),
    )
    with mapped.MappedReader() as reader:
        loads = list(Pipeline(uri, plan, reader, _new_memory, stats, versions, in_flight=16 * KIB).loaded(lambda: None))
    assert len(loads) == len(batches) == stats.submissions == 4
    # Checking batch k, batch k + 1 was already asked for (but after the last, there is none).
    assert submitted_at_check == [2, 3, 4, 4]


@pytest.mark.skipif(not mapped.available(), reason="the native copier is not built")
def test_while_the_head_batch_waits_for_its_check_the_reads_behind_it_land_and_more_go_out(tmp_path):
    """One batch's bytes in flight, and the first batch's HEAD unanswered until every read was
    collected: meanwhile the loop records the batches behind it and submits each next one, so by
    the time the first is checked all four were asked for; all are delivered in plan order."""
    src = tmp_path / "ckpt"
    make_sharded_checkpoint(src, {f"w{i}": torch.full((64, 64), float(i)) for i in range(4)}, n_shards=1)
    uri = parse_uri(str(src))
    plan = build_plan(list(build_catalog(open_storage(uri, Settings())).tensors), 16 * KIB)
    first = next(b for b in plan.batches if b.ranges)
    submitted_at_check = []
    stats = LoadStats()
    with mapped.MappedReader() as reader:
        versions = SimpleNamespace(
            expect=lambda batch, landed: None,
            answered=lambda batch, landed, wait_s: batch is not first or not reader.outstanding,
            check=lambda batch, landed: submitted_at_check.append(stats.submissions),
        )
        loads = list(Pipeline(uri, plan, reader, _new_memory, stats, versions, in_flight=16 * KIB).loaded(lambda: None))
    assert [load.index for load in loads] == sorted(load.index for load in loads) and len(loads) == 4
    assert submitted_at_check == [4, 4, 4, 4]
    for load in loads:  # every batch's bytes are its tensors' bytes, read before its check
        data = load.buffer.memory
        for placement in load.batch.placements:
            value = float(placement.tensor.name[1:])
            got = data[placement.buffer_offset : placement.buffer_offset + placement.tensor.nbytes].view(torch.float32)
            assert bool((got == value).all()), placement.tensor.name


def test_heads_of_batches_that_land_together_go_out_side_by_side(s3_service, monkeypatch):
    """Four objects' batches landed at once behind a store that takes 0.5 s a request: their HEADs
    go out on the checking threads together (as many connections open at once), not one after
    another; ``answered`` waits for them as long as it is told; each check passes."""
    with _recorded_behind_a_slow_store(s3_service, monkeypatch, CHECK_THREADS) as (uri, files, proxy):
        versions = ObjectVersions(uri, files, Settings())
        batches = [SimpleNamespace(files=(f.name,)) for f in files]
        landed = time.monotonic()
        for batch in batches:
            versions.expect(batch, landed)
        assert not versions.answered(batches[0], landed, 0.05)  # held 0.5 s: not within 50 ms
        assert versions.answered(batches[0], landed, 30)  # waited for, and then at once
        for batch in batches:
            versions.check(batch, landed)
        assert versions.checks == len(files) and proxy.counts.requests == len(files)
        assert proxy.counts.peak_connections == len(files)
        versions.close()


def test_the_run_ai_reader_answers_none_while_nothing_landed_within_the_wait(slow_s3):
    """A ranged read held 30 ms by the proxy: a 5 ms wait for an answer ends with none, the read
    still owed; the next wait gets it, its bytes the shard's own."""
    from streamer_service.readers.runai.environment import storage_environment
    from streamer_service.readers.runai.reader import NativeReader

    uri_text, _, _ = slow_s3
    uri = parse_uri(uri_text)
    storage = open_storage(uri, Settings())
    shard = build_catalog(storage).files[0]
    want = storage.read_range(shard.name, 1000, 4096)
    storage.close()
    buffer = torch.zeros(4096, dtype=torch.uint8)
    with NativeReader(environment=storage_environment(Settings())) as reader:
        reader.submit([FileReads(uri.child(shard.name), (ReadRange(1000, 4096, buffer.data_ptr()),))], keepalive=buffer)
        assert reader.answer(0.005) is None and reader.outstanding == 1
        result = reader.answer()
        assert result is not None and result.error is None and result.submission_done
        assert reader.outstanding == 0 and reader.answer(0.005) is None
    assert bytes(buffer.numpy()) == want


def test_a_batch_whose_read_failed_ends_the_reads(tmp_path):
    """Its first shard shrank after the plan was made: the head batch's read fails, and no request
    goes out for the batches after it (their bytes would only be thrown away)."""
    src = tmp_path / "ckpt"
    make_sharded_checkpoint(src, {f"w{i}": torch.full((64, 64), float(i)) for i in range(4)}, n_shards=2)
    uri = parse_uri(str(src))
    plan = build_plan(list(build_catalog(open_storage(uri, Settings())).tensors), 16 * KIB)
    first = plan.batches[0].files[0]
    assert [b.files[0] for b in plan.batches].count(first) == 2  # a batch after it in the same file, two in the other
    (src / first).write_bytes((src / first).read_bytes()[:100])
    stats = LoadStats()
    with pytest.raises(ObjectChangedError, match=r"model-00001-of-00002\.safetensors: bytes \[\d+, \d+\): End of file"):
        with mapped.MappedReader() as reader:
            list(Pipeline(uri, plan, reader, _new_memory, stats, in_flight=16 * KIB).loaded(lambda: None))
    assert stats.submissions == 1


@contextlib.contextmanager
def _recorded_behind_a_slow_store(s3_service, monkeypatch, count, *, then=None):
    """``count`` objects f0, f1, ... in a moto bucket, their versions recorded as a catalog records
    them, then ``then(bucket)``; yields ``(uri, files, proxy)`` with the storage settings pointing
    at a proxy that holds each request 0.5 s (its counts start after the recording)."""
    bucket = s3_service.new_backend()
    names = [f"f{i}" for i in range(count)]
    for name in names:
        bucket.put(f"m/{name}", b"old")
    uri = parse_uri(bucket.uri("m"))
    for key, value in s3_service.env_for(s3_service.emulator.endpoint).items():
        monkeypatch.setenv(key, value)
    storage = open_storage(uri, Settings())
    files = [storage.stat(name) for name in names]
    storage.close()
    if then is not None:
        then(bucket)
    proxy = LatencyProxy.for_url(s3_service.emulator.endpoint, 0.5).start()
    try:
        for key, value in s3_service.env_for(proxy.endpoint).items():
            monkeypatch.setenv(key, value)
        yield uri, files, proxy
    finally:
        proxy.close()
        bucket.close()


def test_a_failed_check_sends_none_of_the_heads_still_queued(s3_service, monkeypatch):
    """Sixteen objects' batches landed, their HEADs queued on the checking threads behind a 0.5 s
    store; the first object changed: its check fails the load, and closing the checks sends no
    HEAD that nothing would read (those already out are waited for)."""

    def rewrite_f0(bucket):
        bucket.put("m/f0", b"new bytes")

    with _recorded_behind_a_slow_store(s3_service, monkeypatch, 4 * CHECK_THREADS, then=rewrite_f0) as (uri, files, proxy):
        versions = ObjectVersions(uri, files, Settings())
        batches = [SimpleNamespace(files=(f.name,)) for f in files]
        landed = time.monotonic()
        for batch in batches:
            versions.expect(batch, landed)
        with pytest.raises(ObjectChangedError, match=r"/m/f0 changed while it was being loaded"):
            versions.check(batches[0], landed)
        versions.close()
        assert 1 <= proxy.counts.requests < len(files)


def test_the_nic_rate_bounds_a_loads_bytes_in_flight():
    """The settings' path: STREAMER_TARGET_GBPS x 100 ms, at least two slots, at most the budget."""
    config = EngineConfig.from_settings(Settings(shm_budget="4GiB", slot_size="256MiB", target_gbps=100))
    assert config.in_flight == 1_250_000_000
    small = EngineConfig.from_settings(Settings(shm_budget="4GiB", slot_size="256MiB", target_gbps=1))
    assert small.in_flight == 2 * 256 * 1024**2
    large = EngineConfig.from_settings(Settings(shm_budget="2GiB", slot_size="256MiB", target_gbps=400))
    assert large.in_flight == 2 * 1024**3


def test_a_head_sent_after_batches_landed_answers_for_them_and_a_later_batch_asks_again(tmp_path):
    """Version checks: batches that landed before a HEAD was sent share it; a batch that landed
    after it gets a HEAD of its own, and that one sees an object changed since."""
    import os

    from streamer_client.errors import ObjectChangedError
    from streamer_service.checkpoint.plan import build_plan
    from streamer_service.checkpoint.versions import ObjectVersions

    src = tmp_path / "ckpt"
    make_sharded_checkpoint(src, {f"w{i}": torch.full((256, 256), float(i)) for i in range(4)}, n_shards=1)
    uri = parse_uri(str(src))
    catalog = build_catalog(open_storage(uri, Settings()))
    first, second = [b for b in build_plan(list(catalog.tensors), 256 * 1024).batches if b.ranges][:2]
    versions = ObjectVersions(uri, catalog.files, Settings())
    versions.open_soon()
    try:
        landed = time.monotonic()
        versions.check(first, landed)
        versions.check(second, landed)  # landed before the first HEAD was sent: the same answer
        assert versions.checks == 1
        shard = src / first.ranges[0].file
        shard.write_bytes(shard.read_bytes() + b"\0")  # the object changed after that HEAD
        os.utime(shard, ns=(time.time_ns(), time.time_ns() + 10**9))
        with pytest.raises(ObjectChangedError, match="changed while it was being loaded") as caught:
            versions.check(second, time.monotonic())  # landed after it: asks again
        assert caught.value.key == first.ranges[0].file and versions.checks == 2
    finally:
        versions.close()


def test_a_batchs_head_goes_out_as_it_lands_and_its_check_waits_only_for_that_answer(tmp_path):
    """``expect`` sends a landed batch's HEAD on the checking thread; ``check`` then uses it (no
    second HEAD), and batches that landed before it was sent share it. A change after that HEAD
    is caught by the next batch that lands."""
    import os
    import threading

    from streamer_client.errors import ObjectChangedError
    from streamer_service.checkpoint.plan import build_plan
    from streamer_service.checkpoint.versions import ObjectVersions

    src = tmp_path / "ckpt"
    make_sharded_checkpoint(src, {f"w{i}": torch.full((256, 256), float(i)) for i in range(4)}, n_shards=1)
    uri = parse_uri(str(src))
    catalog = build_catalog(open_storage(uri, Settings()))
    first, second, third = [b for b in build_plan(list(catalog.tensors), 256 * 1024).batches if b.ranges][:3]
    versions = ObjectVersions(uri, catalog.files, Settings())
    try:
        landed = time.monotonic()
        versions.expect(first, landed)
        versions.expect(second, landed)  # landed before that HEAD went out: it answers for both
        assert versions.checks == 1
        assert [t.name for t in threading.enumerate() if t.name.startswith("versions")]  # sent off this thread
        versions.check(first, landed)
        versions.check(second, landed)
        assert versions.checks == 1
        shard = src / first.ranges[0].file
        shard.write_bytes(shard.read_bytes() + b"\0")
        os.utime(shard, ns=(time.time_ns(), time.time_ns() + 10**9))
        versions.expect(third, time.monotonic())
        assert versions.checks == 2
        with pytest.raises(ObjectChangedError, match="changed while it was being loaded") as caught:
            versions.check(third, time.monotonic() - 60)  # the HEAD asked for at landing answers
        assert caught.value.key == first.ranges[0].file and versions.checks == 2
    finally:
        versions.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("versions")]
