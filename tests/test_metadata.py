"""The metadata cache on all four backends: contents, marker, no-op re-pull, errors, keys."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path

import pytest
from harness.faults import denied_fault

from streamer_client import pull_metadata
from streamer_client.errors import (
    CacheLockTimeoutError,
    CheckpointError,
    InvalidURIError,
    ObjectNotFoundError,
    StorageAccessDeniedError,
    StorageUnavailableError,
    UnsafeKeyError,
)
from streamer_service.metadata.cache import MARKER, Marker, MetadataCache, is_weight, safe_relative_path
from streamer_service.metadata.lock import FileLock
from streamer_service.settings import Settings
from streamer_service.uri import parse_uri

# A model tree as hubs and engines lay it out: metadata to pull, weights to leave.
METADATA = {
    "config.json": b'{"model_type": "llama", "hidden_size": 64}',
    "generation_config.json": b'{"do_sample": false}',
    "tokenizer.json": b'{"version": "1.0", "model": {}}',
    "tokenizer_config.json": b'{"model_max_length": 128}',
    "special_tokens_map.json": b"{}",
    "qwen.tiktoken": b"IQ== 0\nIg== 1\n",
    "configuration_custom.py": b"from transformers import PretrainedConfig\n",
    "code/modeling_custom.py": b"# remote code\nX = 1\n",
    "model.safetensors.index.json": b'{"metadata": {}, "weight_map": {}}',
    "tokenizer.model": b"\x0a\x0bspm",
    "merges.txt": b"a b\n",
    "chat_template.jinja": b"{{ messages }}",
    "original/tokenizer.model": b"\x0a\x0cspm",
}
# Neither weights nor anything a loader reads: left in storage.
NOT_PULLED = {
    "README.md": b"# tiny\n",
    "rank0.engine": b"TRT" * 100,
    "model.nemo": b"NEMO",
    "embeddings.npy": b"\x93NUMPY",
    "optimizer.pkl": b"\x80\x04",
}
WEIGHTS = {
    "model-00001-of-00002.safetensors": b"\x08" + b"\x00" * 63,
    "model-00002-of-00002.safetensors": b"\x09" + b"\x00" * 63,
    "pytorch_model.bin": b"PK\x03\x04",
    "original/consolidated.00.pth": b"PK",
    "model.gguf": b"GGUF",
}


def listing(cache_dir: Path) -> dict[str, bytes]:
    return {
        p.relative_to(cache_dir).as_posix(): p.read_bytes()
        for p in sorted(cache_dir.rglob("*"))
        if p.is_file() and p.name != MARKER
    }


@pytest.fixture
def model(backend):
    backend.put_tree("models/tiny", {**METADATA, **WEIGHTS, **NOT_PULLED})
    # A sibling prefix that shares the name's start must not leak in.
    backend.put_tree("models/tiny-other", {"config.json": b'{"other": true}'})
    return backend.uri("models/tiny")


def test_pull_brings_metadata_and_no_weights(backend, model):
    cache_dir = pull_metadata(model)
    assert cache_dir == Path(os.environ["STREAMER_CACHE_DIR"]) / parse_uri(model).cache_key
    assert listing(cache_dir) == METADATA
    for weight in {**WEIGHTS, **NOT_PULLED}:
        assert not (cache_dir / weight).exists()


def test_marker_records_what_was_pulled(backend, model):
    cache_dir = pull_metadata(model, launch_id="launch-a")
    data = json.loads((cache_dir / MARKER).read_text())
    assert data["uri"] == parse_uri(model).normalized
    assert data["launch_id"] == "launch-a"
    assert data["pulled_by"]["pid"] == os.getpid()
    assert {f["name"]: f["size"] for f in data["files"]} == {k: len(v) for k, v in METADATA.items()}
    assert {f["name"] for f in data["weights"]} == set(WEIGHTS)
    assert all(f["etag"] for f in data["files"] + data["weights"])
    assert data["pulled_at"].endswith("+00:00")
    # The marker is the last thing written: nothing else in the dir is newer.
    marker_mtime = (cache_dir / MARKER).stat().st_mtime_ns
    assert all(p.stat().st_mtime_ns <= marker_mtime for p in cache_dir.rglob("*") if p.is_file())


def test_second_pull_touches_no_storage(backend, model):
    first = pull_metadata(model)
    if backend.proxy is not None:
        assert backend.proxy.count() > 0
        backend.proxy.reset()
    # Remove the source altogether: a pull that looked at storage would now fail.
    for name in {**METADATA, **WEIGHTS, **NOT_PULLED}:
        backend.delete(f"models/tiny/{name}")
    timings = []
    for _ in range(5):
        started = time.perf_counter()
        assert pull_metadata(model) == first
        timings.append(time.perf_counter() - started)
    if backend.proxy is not None:
        assert backend.proxy.count() == 0
    assert listing(first) == METADATA
    logging.getLogger(__name__).info("warm pull_metadata: median %.2f ms", sorted(timings)[2] * 1e3)


def test_pulled_dir_loads_with_transformers(backend, tmp_path):
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    src = tmp_path / "hf"
    transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=16
    ).save_pretrained(src)
    vocab = {tok: i for i, tok in enumerate(["<unk>", "<s>", "</s>", "hello", "world"])}
    raw = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=raw, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    ).save_pretrained(src)
    backend.put_tree("hf", {p.name: p.read_bytes() for p in src.iterdir()})

    cache_dir = pull_metadata(backend.uri("hf"))
    config = transformers.AutoConfig.from_pretrained(cache_dir)
    assert (config.model_type, config.hidden_size, config.num_hidden_layers) == ("llama", 32, 2)
    tokenizer = transformers.AutoTokenizer.from_pretrained(cache_dir)
    assert tokenizer("hello world")["input_ids"] == [3, 4]


def test_incomplete_dir_without_marker_is_replaced(backend, model):
    settings = Settings()
    cache = MetadataCache(settings)
    stale = cache.dir_for(parse_uri(model))
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("half-written")
    (stale / "leftover.txt").write_text("junk")
    assert cache.pull(model) == stale
    assert listing(stale) == METADATA


# --- keys from storage are untrusted ------------------------------------------------------------


@pytest.mark.parametrize(
    "name, reason",
    [
        ("../evil.json", "'..' segment"),
        ("a/../../evil.json", "'..' segment"),
        ("/etc/passwd", "is absolute"),
        ("a//b.json", "empty, '.' or '..' segment"),
        ("./a.json", "'.'"),
        ("a\\..\\evil.json", "backslash"),
        ("a\x00b", "NUL"),
        ("a\nb", "control characters"),
        ("", "is empty"),
        ("x" * 256, "longer than 255 bytes"),
    ],
)
def test_unsafe_names_are_refused(name, reason):
    with pytest.raises(UnsafeKeyError) as info:
        safe_relative_path(name, "s3://b/m")
    assert reason.split("'")[0] in str(info.value)
    assert repr(name) in str(info.value) and "s3://b/m" in str(info.value)


@pytest.mark.parametrize("name", ["config.json", "a/b/c.py", "tokenizer..json", "é/ü.txt", ".hidden", "a b.json"])
def test_safe_names_pass(name):
    assert safe_relative_path(name, "s3://b/m").as_posix() == name


def _assert_nothing_left(backend, uri, root: Path):
    cache = MetadataCache(Settings())
    assert not cache.dir_for(parse_uri(uri)).exists()
    assert [p.name for p in Path(os.environ["STREAMER_CACHE_DIR"]).iterdir() if not p.name.endswith(".lock")] == []
    assert not (root / "evil.json").exists()


def test_backslash_key_refused_on_every_backend(backend, tmp_path):
    backend.put_tree("m", {"config.json": b"{}", "a\\..\\..\\evil.json": b"gotcha"})
    uri = backend.uri("m")
    # Azure stores '\\' as '/', which makes the key a '..' traversal: refused either way.
    with pytest.raises(UnsafeKeyError, match=r"refusing object key 'a(\\\\|/)\.\.(\\\\|/)\.\.(\\\\|/)evil\.json'"):
        pull_metadata(uri)
    _assert_nothing_left(backend, uri, Path(os.environ["STREAMER_CACHE_DIR"]))


@pytest.mark.parametrize("backend", ["s3"], indirect=True)
@pytest.mark.parametrize("key", ["../evil.json", "sub/../../evil.json", "/evil.json", "./evil.json"])
def test_traversal_keys_refused(backend, key):
    backend.put_tree("m", {"config.json": b"{}"})
    backend.put(f"m/{key}", b"gotcha")
    uri = backend.uri("m")
    with pytest.raises(UnsafeKeyError) as info:
        pull_metadata(uri)
    assert repr(key) in str(info.value) and uri in str(info.value)
    _assert_nothing_left(backend, uri, Path(os.environ["STREAMER_CACHE_DIR"]))


def test_file_and_directory_clash_refused(cloud_backend):  # a local dir cannot hold both
    backend = cloud_backend
    backend.put_tree("m", {"config.json": b"{}", "tokenizer": b"a file", "tokenizer/x.py": b"X = 1"})
    with pytest.raises(UnsafeKeyError, match="'tokenizer'.*another key uses it as a directory"):
        pull_metadata(backend.uri("m"))


def test_weights_filter():
    for name in ("a.safetensors", "B.SAFETENSORS", "x/pytorch_model.bin", "m.gguf", "c.pth", "d.pt", "e.ckpt"):
        assert is_weight(name)
    for name in ("model.safetensors.index.json", "tok.tiktoken", "tokenizer.model", "config.json", "x.py"):
        assert not is_weight(name)


# --- errors name the URI ------------------------------------------------------------------------


def test_missing_bucket(cloud_backend):
    uri = cloud_backend.uri("m").replace(cloud_backend.bucket, "no-such-bucket-here")
    with pytest.raises(ObjectNotFoundError) as info:
        pull_metadata(uri)
    assert "'no-such-bucket-here'" in str(info.value) and uri in str(info.value)
    word = "container" if cloud_backend.name == "azure" else "bucket"  # Azure's are containers
    assert str(info.value).startswith(f"{word} 'no-such-bucket-here' does not exist")
    assert _cache_root_entries() == []


def test_empty_prefix(backend):
    backend.put_tree("elsewhere", {"config.json": b"{}"})
    uri = backend.uri("nothing-here")
    with pytest.raises(ObjectNotFoundError, match=f"no objects under {parse_uri(uri).normalized}"):
        pull_metadata(uri)
    assert _cache_root_entries() == []  # no temp dir, no lock file: a bad URI leaves nothing


def test_access_denied(cloud_backend):
    cloud_backend.put_tree("m", {"config.json": b"{}"})
    cloud_backend.proxy.fault = denied_fault(cloud_backend.name)
    uri = cloud_backend.uri("m")
    with pytest.raises(StorageAccessDeniedError) as info:
        pull_metadata(uri)
    assert "access denied" in str(info.value) and parse_uri(uri).normalized in str(info.value)
    assert _cache_root_entries() == []


def test_endpoint_unreachable(cloud_backend, monkeypatch):
    cloud_backend.put_tree("m", {"config.json": b"{}"})
    for name, value in cloud_backend.unreachable_env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("STREAMER_STORAGE_RETRIES", "1")
    monkeypatch.setenv("STREAMER_STORAGE_RETRY_DEADLINE_S", "2")
    uri = cloud_backend.uri("m")
    started = time.monotonic()
    with pytest.raises(StorageUnavailableError) as info:
        MetadataCache(Settings()).pull(uri)
    assert time.monotonic() - started < 30
    assert "unreachable" in str(info.value) and parse_uri(uri).normalized in str(info.value)


def test_local_missing_dir(tmp_path):
    with pytest.raises(InvalidURIError, match="does not exist"):
        pull_metadata(tmp_path / "absent")


# --- the lock -----------------------------------------------------------------------------------


def test_waiting_puller_logs_and_times_out(backend, model, caplog):
    settings = Settings(lock_timeout_s=0.6, lock_log_interval_s=0.1)
    cache = MetadataCache(settings)
    cache.root.mkdir(parents=True, exist_ok=True)
    lock_path = cache.lock_path(parse_uri(model))
    holder = FileLock(lock_path, timeout_s=1, log_interval_s=1, what="test")
    with holder, caplog.at_level(logging.INFO, logger="streamer_service.metadata.lock"):
        with pytest.raises(CacheLockTimeoutError) as info:
            cache.pull(model)
    assert str(lock_path) in str(info.value) and parse_uri(model).normalized in str(info.value)
    waits = [r for r in caplog.records if "still waiting for lock" in r.getMessage()]
    assert len(waits) >= 3
    assert lock_path.parent == cache.root and not cache.dir_for(parse_uri(model)).exists()


def test_a_failed_pull_leaves_the_lock_to_its_waiter_and_nobody_else(backend, tmp_path, caplog):
    """A pull that cached nothing removes its lock file while it holds it; a puller that was waiting
    for that file then holds the lock at the path, so a third process cannot take it beside it."""
    backend.put_tree("elsewhere", {"config.json": b"{}"})
    uri = backend.uri("nothing-here")
    cache = MetadataCache(Settings())
    cache.root.mkdir(parents=True, exist_ok=True)
    path = cache.lock_path(parse_uri(uri))
    holder = FileLock(path, timeout_s=5, log_interval_s=1, what="holder")
    holder.acquire()
    waiter = FileLock(path, timeout_s=30, log_interval_s=0.05, what="waiter")
    waiting = threading.Event()

    class Seen(logging.Handler):
        def emit(self, record):
            if "pull of waiter" in record.getMessage():
                waiting.set()

    seen = Seen()
    logging.getLogger("streamer_service.metadata.lock").addHandler(seen)
    got = threading.Event()
    thread = threading.Thread(target=lambda: (waiter.acquire(), got.set()), daemon=True)
    try:
        with caplog.at_level(logging.INFO, logger="streamer_service.metadata.lock"):
            thread.start()
            assert waiting.wait(10), "the waiter never waited"  # it holds the file the holder will remove
            holder.discard()
            assert got.wait(10)
        assert path.exists()  # the waiter locked the file now at the path...
        with pytest.raises(CacheLockTimeoutError):  # ...so nobody takes that one beside it
            FileLock(path, timeout_s=0.3, log_interval_s=1, what="third").acquire()
        waiter.release()
        with pytest.raises(ObjectNotFoundError):  # a pull of the URI fails, and removes the file
            cache.pull(uri)
        assert _cache_root_entries() == []
    finally:
        logging.getLogger("streamer_service.metadata.lock").removeHandler(seen)
        waiter.release()
        thread.join(10)


def _cache_root_entries() -> list[str]:
    root = Path(os.environ["STREAMER_CACHE_DIR"])
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


def test_marker_reader_rejects_garbage(tmp_path):
    (tmp_path / MARKER).write_text("{not json")
    assert Marker.read(tmp_path) is None
    (tmp_path / MARKER).write_text(json.dumps({"version": 99}))
    assert Marker.read(tmp_path) is None


# --- what is pulled, and how much ---------------------------------------------------------------


def test_only_what_loaders_read_is_pulled_and_patterns_add_more(backend, model, monkeypatch):
    cache_dir = pull_metadata(model)
    assert listing(cache_dir) == METADATA
    assert {f["name"] for f in json.loads((cache_dir / MARKER).read_text())["files"]} == set(METADATA)
    monkeypatch.setenv("STREAMER_METADATA_PATTERNS", "*.md, *.npy")
    again = MetadataCache(Settings()).pull(model, force=True, launch_id="with-patterns")
    assert listing(again) == {**METADATA, "README.md": NOT_PULLED["README.md"], "embeddings.npy": NOT_PULLED["embeddings.npy"]}


def test_a_metadata_file_over_the_cap_fails_naming_it_before_any_download(backend):
    backend.put_tree("m", {"config.json": b"{}", "tokenizer.json": b"x" * 5000})
    uri = backend.uri("m")
    with pytest.raises(CheckpointError) as info:
        MetadataCache(Settings(metadata_max_file_bytes=4096)).pull(uri)
    assert str(info.value) == (
        f"refusing to pull 'tokenizer.json' of {parse_uri(uri).normalized}: 5000 bytes is over the per-file limit "
        "of 4096 bytes (STREAMER_METADATA_MAX_FILE_BYTES); raise it if a loader needs this file"
    )
    assert info.value.key == "tokenizer.json"
    with pytest.raises(
        CheckpointError,
        match=r"2 files of 5002 bytes are over the limit of 5000 bytes \(STREAMER_METADATA_MAX_TOTAL_BYTES\); the largest is 'tokenizer.json'",
    ):
        MetadataCache(Settings(metadata_max_total_bytes=5000)).pull(uri)
    _assert_nothing_left(backend, uri, Path(os.environ["STREAMER_CACHE_DIR"]))
    if backend.proxy is not None:  # refused from the listing: no object was downloaded
        assert not [r for r in backend.proxy.requests if r.method == "GET" and "tokenizer.json" in r.path]


def test_a_forced_pull_skipped_in_the_same_launch_says_so(backend, model, caplog):
    pull_metadata(model)
    with caplog.at_level(logging.INFO, logger="streamer_service.metadata.cache"):
        pull_metadata(model, force=True)  # same parent process as the first pull: the same launch
        pull_metadata(model, force=True, launch_id="job-7")  # a new launch: pulls, then skips
        pull_metadata(model, force=True, launch_id="job-7")
    skips = [r.getMessage() for r in caplog.records if "forced pull of" in r.getMessage()]
    ppid = os.getppid()
    assert len(skips) == 2, skips
    assert (
        f"launch ppid-{ppid}-" in skips[0] and f"(from the parent process {ppid} (no STREAMER_LAUNCH_ID or torchrun)" in skips[0]
    )
    assert skips[1].startswith(f"forced pull of {parse_uri(model).normalized} skipped: launch job-7 (given explicitly")
    assert "set STREAMER_LAUNCH_ID to a new value to pull again" in skips[1]


@pytest.mark.parametrize("backend", ["s3", "azure"], indirect=True)
def test_a_uri_naming_one_object_says_so(backend):
    backend.put_tree("m", {"config.json": b"{}", "model.safetensors": b"\x00" * 16})
    uri = backend.uri("m/model.safetensors")
    with pytest.raises(ObjectNotFoundError) as info:
        pull_metadata(uri)
    parent = parse_uri(backend.uri("m")).normalized
    assert (
        str(info.value)
        == f"{parse_uri(uri).normalized} names one object, not a checkpoint: give the prefix it is under, {parent}"
    )
