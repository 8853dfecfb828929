"""Every dtype safetensors writes, byte-exact in-process and through a real daemon to real rank
processes (F4 and F8_E8M0 among them); a dtype no torch tensor can hold refused in the plan,
before a tensor byte is read, in both modes.

Ground truth is safetensors itself: its writer makes the checkpoints, ``safe_open`` reads them back.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch
from checkpoints import make_sharded_checkpoint, write_raw_safetensors
from safetensors import safe_open
from safetensors.torch import save

import streamer_client
from streamer_client._dtypes import DTYPES, WITH_TORCH_DTYPE, torch_layout
from streamer_client.errors import CheckpointError

TORCH_DTYPES = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)


def _header(blob: bytes) -> dict:
    (n,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8 : 8 + n])


def _filled(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """A tensor of ``dtype``/``shape`` (a torch shape) whose bytes are random (bool: 0 or 1)."""
    size = torch.empty(0, dtype=dtype).element_size()
    numel = 1
    for d in shape:
        numel *= d
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 2 if dtype is torch.bool else 256, (numel * size,), generator=g, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def _written() -> dict[torch.dtype, str]:
    """What safetensors writes in its header for each torch dtype it saves."""
    written = {}
    for dtype in TORCH_DTYPES:
        try:
            blob = save({"t": torch.zeros(16, dtype=torch.uint8).view(dtype)})
        except Exception:  # a dtype safetensors does not save (or a view torch cannot make)
            continue
        written[dtype] = _header(blob)["t"]["dtype"]
    return written


def test_the_table_is_safetensors_dtypes_with_the_torch_dtype_it_writes_for_each():
    written = _written()
    # Each dtype safetensors saves from torch is in the table, mapped back to that torch dtype.
    assert {name: str(dtype).removeprefix("torch.") for dtype, name in written.items()} == {
        name: DTYPES[name].torch_name for name in WITH_TORCH_DTYPE
    }
    assert {"F4", "F8_E8M0", "U16", "U32", "U64", "C64", "BOOL"} <= set(written.values())
    # Its file format knows exactly the table's names: safe_open accepts a header declaring each
    # (F6_E2M3 and F6_E3M2, which no torch dtype holds, too) and refuses names near them.
    for name in [*DTYPES, "F6", "E8M0", "F8_E8M0FNU", "F8_E4M3FN", "FP4", "F4_E2M1", "C128", "U4"]:
        # One tensor of 8 elements: whole bytes for 4 and 6 bits.
        nbytes = 8 * DTYPES[name].bits // 8 if name in DTYPES else 8
        header = json.dumps({"t": {"dtype": name, "shape": [8], "data_offsets": [0, nbytes]}}).encode()
        blob = struct.pack("<Q", len(header)) + header + b"\0" * nbytes
        with tempfile.NamedTemporaryFile(suffix=".safetensors") as f:
            f.write(blob)
            f.flush()
            try:
                with safe_open(f.name, framework="pt"):
                    accepted = True
            except Exception:
                accepted = False
        assert accepted == (name in DTYPES), name


def test_f4_is_two_values_per_byte_along_the_last_dimension():
    # safetensors writes float4_e2m1fn_x2 of torch shape [3, 4] as F4 [3, 8] in 12 bytes.
    blob = save({"t": _filled(torch.float4_e2m1fn_x2, (3, 4), 0)})
    entry = _header(blob)["t"]
    assert (entry["dtype"], entry["shape"], entry["data_offsets"]) == ("F4", [3, 8], [0, 12])
    assert torch_layout("F4", [3, 8]) == (torch.float4_e2m1fn_x2, (3, 4))
    assert torch_layout("F4", [0, 8]) == (torch.float4_e2m1fn_x2, (0, 4))
    assert torch_layout("F8_E8M0", []) == (torch.float8_e8m0fnu, ())
    with pytest.raises(CheckpointError) as info:
        torch_layout("F4", [2, 3])
    assert str(info.value) == (
        "F4 shape [2, 3]: torch.float4_e2m1fn_x2 holds 2 values per element, so the last dimension must be a multiple of 2"
    )


def _every_dtype() -> dict[str, torch.Tensor]:
    """A tensor of each torch dtype safetensors writes, in several shapes: 2-D, 0-d (F4 has none:
    a single 4-bit value is not a whole byte), empty."""
    tensors = {}
    for i, dtype in enumerate(sorted(_written(), key=str)):
        name = str(dtype).removeprefix("torch.")
        tensors[f"{name}.matrix"] = _filled(dtype, (5, 6), 3 * i)
        if dtype is not torch.float4_e2m1fn_x2:
            tensors[f"{name}.scalar"] = _filled(dtype, (), 3 * i + 1)
        tensors[f"{name}.empty"] = _filled(dtype, (0, 4), 3 * i + 2)
    return tensors


@pytest.fixture(scope="module")
def every_dtype(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("dtypes") / "ckpt"
    make_sharded_checkpoint(src, _every_dtype(), n_shards=2)
    return src


def _truth(src: Path) -> dict[str, tuple[str, list[int], bytes]]:
    """``{name: (torch dtype, torch shape, bytes)}`` as safe_open reads each tensor."""
    truth = {}
    for shard in sorted(src.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                truth[name] = (str(t.dtype), list(t.shape), t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return truth


def _seen(name: str, t: torch.Tensor) -> tuple[str, list[int], bytes]:
    return str(t.dtype), list(t.shape), t.reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("borrowed", [False, True], ids=["owned", "borrowed"])
def test_every_dtype_loads_byte_exact_in_process(every_dtype, borrowed):
    truth = _truth(every_dtype)
    assert {"float4_e2m1fn_x2.matrix", "float8_e8m0fnu.scalar", "uint64.matrix", "complex64.empty"} <= set(truth)
    got = {name: _seen(name, t) for name, t in streamer_client.stream(str(every_dtype), borrowed=borrowed)}
    assert got == truth


RANK = textwrap.dedent(
    """
    import json, sys, torch, streamer_client
    uri, rank, borrowed = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
    got = {}
    for name, t in streamer_client.stream(uri, rank=rank, world_size=2, borrowed=borrowed):
        got[name] = [str(t.dtype), list(t.shape), t.reshape(-1).view(torch.uint8).numpy().tobytes().hex()]
    print(json.dumps(got))
    """
)


def _upload(backend, src: Path) -> str:
    backend.put_tree("ckpt", {p.name: p.read_bytes() for p in src.iterdir()})
    return backend.uri("ckpt")


@pytest.mark.parametrize("backend", ["s3"], indirect=True)
def test_every_dtype_loads_byte_exact_through_a_daemon(backend, every_dtype, daemon):
    uri = _upload(backend, every_dtype)
    truth = _truth(every_dtype)
    d = daemon(backend.env)
    ranks = [
        subprocess.Popen([sys.executable, "-c", RANK, uri, str(rank), str(rank)], env=d.rank_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for rank in range(2)
    ]  # fmt: skip
    for rank in ranks:  # rank 0 copies its tensors, rank 1 borrows views of the segments
        out, err = rank.communicate(timeout=300)
        assert rank.returncode == 0, err[-3000:]
        got = {name: (dtype, shape, bytes.fromhex(data)) for name, (dtype, shape, data) in json.loads(out).items()}
        assert got == truth
    assert d.finished()[-1]["state"] == "done"


# ------------------------------------------------------------------ dtypes no torch tensor holds


def _refused_checkpoint(directory: Path) -> dict[str, bytes]:
    """One shard: an F32 tensor, an F6_E2M3 one (no torch dtype) and an F4 one whose last dimension
    is odd (no torch.float4_e2m1fn_x2 shape). safetensors cannot write either from torch."""
    header = {
        "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "w.f6": {"dtype": "F6_E2M3", "shape": [4], "data_offsets": [8, 11]},
        "w.odd": {"dtype": "F4", "shape": [2, 3], "data_offsets": [11, 14]},
    }
    path = write_raw_safetensors(directory / "model.safetensors", header, struct.pack("<2f", 1.5, -2.0) + bytes(range(1, 7)))
    return {path.name: path.read_bytes()}


REFUSALS = {
    "w.f6": "tensor 'w.f6': safetensors dtype 'F6_E2M3' has no torch dtype",
    "w.odd": (
        "tensor 'w.odd': F4 shape [2, 3]: torch.float4_e2m1fn_x2 holds 2 values per element, "
        "so the last dimension must be a multiple of 2"
    ),
}


def _reads_beyond_headers(backend, files: dict[str, bytes]) -> list[str]:
    """Ranged GETs the storage served other than the two of each header (its length, its JSON)."""
    headers = set()
    for data in files.values():
        (n,) = struct.unpack("<Q", data[:8])
        headers |= {"bytes=0-7", f"bytes=8-{8 + n - 1}"}
    return [r.range for r in backend.proxy.requests if r.method == "GET" and r.range and r.range not in headers]


@pytest.mark.parametrize("backend", ["s3"], indirect=True)
def test_a_dtype_torch_cannot_hold_is_refused_in_the_plan_in_process(backend, tmp_path):
    files = _refused_checkpoint(tmp_path)
    backend.put_tree("m", files)
    uri = backend.uri("m")
    backend.proxy.reset()
    for name, message in REFUSALS.items():
        with pytest.raises(CheckpointError) as info:
            list(streamer_client.stream(uri, select=["a", name]))
        assert (str(info.value), info.value.key, info.value.uri) == (message, name, uri)
    assert backend.proxy.count(method="GET", has_range=True) > 0  # the headers were read
    assert _reads_beyond_headers(backend, files) == []  # and no tensor byte


@pytest.mark.parametrize("backend", ["s3"], indirect=True)
def test_a_dtype_torch_cannot_hold_is_refused_at_the_join_through_a_daemon(backend, tmp_path, daemon):
    files = _refused_checkpoint(tmp_path)
    backend.put_tree("m", files)
    uri = backend.uri("m")
    d = daemon(backend.env)
    backend.proxy.reset()
    code = textwrap.dedent(
        """
        import json, sys, streamer_client
        try:
            streamer_client.stream(sys.argv[1], select=["a", sys.argv[2]])
        except streamer_client.errors.StreamerError as exc:
            print(json.dumps([type(exc).__name__, str(exc), exc.key, exc.uri]))
        """
    )
    for name, message in REFUSALS.items():
        rank = subprocess.run(
            [sys.executable, "-c", code, uri, name], env=d.rank_env(), capture_output=True, text=True, timeout=300
        )
        assert rank.returncode == 0, rank.stderr[-3000:]
        assert json.loads(rank.stdout) == ["CheckpointError", message, name, uri]
    # A rank whose torch lacks a dtype the daemon's has says so in its join: refused there too.
    with d.client() as c:
        body = {"uri": uri, "session": "s", "rank": 0, "world_size": 1, "select": ["a"], "dtypes": ["U8"]}
        reply = c.post("/v1/sessions/join", json=body, timeout=60)
    assert reply.status_code == 422, reply.text
    assert reply.json()["error"] == {
        "type": "CheckpointError",
        "message": "tensor 'a': safetensors dtype 'F32' needs torch.float32, which rank 0's torch does not have",
        "uri": uri,
        "key": "a",
    }
    assert _reads_beyond_headers(backend, files) == []
    stats = d.stats()
    assert stats["bytes_read"] == 0 and stats["sessions"] == [] and list(d.shm_dir.iterdir()) == []
    # The tensor torch holds loads.
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys, streamer_client; print([(n, t.tolist()) for n, t in streamer_client.stream(sys.argv[1], select=['a'])])", uri],
        env=d.rank_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    assert loaded.stdout.strip() == "[('a', [1.5, -2.0])]"
