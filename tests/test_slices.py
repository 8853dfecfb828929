"""Slices: a rank asks for part of a tensor and receives only that part, in both modes.

Every tensor is compared with safetensors' read of the file, narrowed and concatenated by torch;
bytes read in-process are counted at the storage side (the ranges the proxy in front of moto
passed); a bad slice is refused naming the tensor before any byte of tensor data is read.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch
from conftest import _make_backend
from daemon_harness import finish
from safetensors import safe_open
from safetensors.torch import save, save_file

import streamer_client
from streamer_client import _slicing as slicing
from streamer_client.errors import ConfigError, SelectionError

TENSORS = {
    "embed": (torch.bfloat16, (64, 48)),  # vocab-parallel: dim 0
    "o_proj": (torch.bfloat16, (48, 64)),  # row-parallel: dim 1
    "qkv": (torch.float32, (96, 16)),  # fused q, k, v along dim 0
    "experts": (torch.float16, (4, 24, 8)),  # a later dim of a 3-d tensor
    "packed": (torch.float4_e2m1fn_x2, (16, 8)),  # F4: two values per element
    "norm": (torch.float32, (48,)),  # 1-d
}

# What a rank of a TP=2 layout keeps: (dim, start, stop) pieces along one dim, per tensor.
SLICES = {
    0: {"embed": [(0, 0, 32)], "o_proj": [(1, 0, 32)], "qkv": [(0, 0, 16), (0, 64, 72), (0, 80, 88)],
        "experts": [(1, 12, 24)], "packed": [(1, 0, 4)], "norm": [(0, 0, 48)]},
    1: {"embed": [(0, 32, 64)], "o_proj": [(1, 32, 64)], "qkv": [(0, 16, 32), (0, 72, 80), (0, 88, 96)],
        "experts": [(1, 0, 12)], "packed": [(0, 8, 16)], "norm": [(0, 16, 32)]},
}  # fmt: skip


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, (dtype, shape) in TENSORS.items():
        if dtype == torch.float4_e2m1fn_x2:
            out[name] = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g).view(dtype)
        else:
            out[name] = torch.randn(shape, generator=g).to(dtype)
    return out


def _expected(t: torch.Tensor, pieces) -> torch.Tensor:
    """torch's own cut: narrow each piece, concatenate along the dim (on bytes: F4 has no cat)."""
    dim = pieces[0][0]
    raw = t.view(torch.uint8) if t.dtype == torch.float4_e2m1fn_x2 else t
    return torch.cat([raw.narrow(dim, a, b - a) for _, a, b in pieces], dim).view(t.dtype)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.fixture
def checkpoint(tmp_path):
    src = tmp_path / "ckpt"
    src.mkdir()
    tensors = _tensors()
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": dict.fromkeys(tensors, "model.safetensors")}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    return src, tensors


# --------------------------------------------------------------------------- the form and the bounds


@pytest.mark.parametrize(
    ("slices", "message"),
    [
        ([("a", 0, 1)], "slices must map tensor names to (dim, start, stop) or a list of them, got list"),
        ({"a": (0, 1)}, "slices['a']: expected (dim, start, stop) or a non-empty list of them, got (0, 1)"),
        ({"a": []}, "slices['a']: expected (dim, start, stop) or a non-empty list of them, got []"),
        ({"a": [(0, 0, 1), (0, 1.5, 2)]}, "slices['a']: (0, 1.5, 2) is not (dim, start, stop) of integers"),
        ({"a": [(0, 0, 1), (1, 0, 1)]}, "slices['a']: the pieces of one tensor run along one dimension, got dims [0, 1]"),
        ({"a": (True, 0, 1)}, "slices['a']: expected (dim, start, stop) or a non-empty list of them, got (True, 0, 1)"),
    ],
)
def test_slices_of_the_wrong_form_are_refused_naming_the_tensor(checkpoint, slices, message):
    src, _ = checkpoint
    with pytest.raises(ConfigError) as info:
        streamer_client.stream(src, slices=slices)
    assert info.value.message == message


@pytest.mark.parametrize(
    ("slices", "message"),
    [
        ({"embed": (0, 0, 65)}, "tensor 'embed' (torch shape [64, 48]): slice [0, 65) of dim 0 is outside [0, 64]"),
        ({"embed": (2, 0, 1)}, "tensor 'embed' (torch shape [64, 48]): slice dim 2 is outside its 2 dimensions"),
        ({"o_proj": (1, 40, 30)}, "tensor 'o_proj' (torch shape [48, 64]): slice [40, 30) of dim 1 is outside [0, 64]"),
        ({"packed": (1, 0, 9)}, "tensor 'packed' (torch shape [16, 8]): slice [0, 9) of dim 1 is outside [0, 8]"),
        ({"missing": (0, 0, 1)}, "slices name tensor 'missing', which this load does not select"),
    ],
)
def test_a_slice_outside_its_tensor_is_refused_before_any_read(checkpoint, slices, message):
    src, _ = checkpoint
    with pytest.raises(SelectionError) as info:
        streamer_client.stream(src, slices=slices, select=["embed", "o_proj", "packed"])
    assert info.value.message == message
    assert info.value.key == next(iter(slices))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.float4_e2m1fn_x2])
def test_a_cuts_runs_are_the_bytes_torch_narrows_to(dtype):
    """For every dim and several piece lists of a 4-d tensor: the bytes at the cut's runs, in
    order, are torch's narrow-and-concatenate of the tensor, and ``take`` gives the same tensor."""
    shape = (3, 4, 5, 6)
    raw = torch.arange(torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size(), dtype=torch.int64)
    t = (raw % 251).to(torch.uint8).view(dtype).reshape(shape)
    header = (*shape[:-1], shape[-1] * 2) if dtype == torch.float4_e2m1fn_x2 else shape
    dtype_name = {torch.float32: "F32", torch.bfloat16: "BF16", torch.int8: "I8", torch.float4_e2m1fn_x2: "F4"}[dtype]
    flat = t.reshape(-1).view(torch.uint8)

    class Info:
        name, dtype, shape = "t", dtype_name, header

    for dim in range(4):
        size = shape[dim]
        for pieces in ([(0, size)], [(1, size - 1)], [(size - 1, size), (0, 1)], [(0, 1), (0, 1)], [(1, 1)]):
            c = slicing.cut(Info, dim, pieces)
            want = _expected(t, [(dim, a, b) for a, b in pieces])
            gathered = torch.cat([flat[o : o + n] for o, n in zip(*c.runs())] or [flat[:0]])
            assert torch.equal(gathered, want.reshape(-1).view(torch.uint8)), (dim, pieces)
            assert c.shape == tuple(want.shape) and c.nbytes == gathered.numel()
            assert _same(slicing.take(t, c), want) and _same(slicing.take(t, c, view=True).contiguous(), want)


# --------------------------------------------------------------------------- in-process


@pytest.mark.parametrize("borrowed", [False, True], ids=["owned", "borrowed"])
@pytest.mark.parametrize("rank", [0, 1])
def test_in_process_slices_equal_safetensors(checkpoint, rank, borrowed):
    src, tensors = checkpoint
    got = {}
    for name, t in streamer_client.stream(src, slices=SLICES[rank], borrowed=borrowed):
        got[name] = t.clone()
    assert set(got) == set(TENSORS)
    for name, pieces in SLICES[rank].items():
        assert _same(got[name], _expected(tensors[name], pieces)), name


@pytest.fixture
def s3(request, isolated_env, tmp_path, monkeypatch):
    b = _make_backend(request, "s3", tmp_path, monkeypatch)
    yield b
    b.close()


def _bytes_served(proxy, key: str) -> int:
    """The bytes of ``key`` the proxy passed for ranged GETs ("bytes=a-b")."""
    total = 0
    for r in proxy.requests:
        if r.method == "GET" and r.path.endswith(key) and r.range and r.status in (200, 206):
            first, last = map(int, re.fullmatch(r"bytes=(\d+)-(\d+)", r.range).groups())
            total += last - first + 1
    return total


def test_in_process_reads_only_the_rows_of_a_dim_0_slice_from_storage(s3):
    """A dim-0 slice reads only its rows; a later dim's slice reads its tensor once, all of it."""
    g = torch.Generator().manual_seed(3)
    tensors = {"embed": torch.randn(1024, 256, generator=g), "o_proj": torch.randn(256, 512, generator=g)}
    s3.put("m/model.safetensors", save(tensors, metadata={"format": "pt"}))
    uri = s3.uri("m")
    s3.proxy.reset()
    slices = {"embed": (0, 256, 512), "o_proj": (1, 128, 256)}
    got = {name: t for name, t in streamer_client.stream(uri, slices=slices)}
    assert torch.equal(got["embed"], tensors["embed"][256:512])
    assert torch.equal(got["o_proj"], tensors["o_proj"][:, 128:256])
    served = _bytes_served(s3.proxy, "model.safetensors")
    header = 8 + int.from_bytes(s3.get("m/model.safetensors")[:8], "little")
    assert served - header <= 256 * 256 * 4 + 256 * 512 * 4  # its rows of embed, all of o_proj (the header read aside)
    assert served >= 256 * 256 * 4 + 256 * 512 * 4


# --------------------------------------------------------------------------- through a daemon


def _truth_bytes(tensors, pieces_by_name) -> int:
    return sum(_expected(tensors[n], pieces_by_name[n]).nbytes for n in tensors)


@pytest.mark.parametrize("borrowed", [False, True], ids=["owned", "borrowed"])
def test_daemon_ranks_receive_only_their_slices(checkpoint, daemon, borrowed):
    """Two ranks of one session, each with its own slices: each yields exactly its parts,
    equal to safetensors', and receives only their bytes; the daemon reads the checkpoint once."""
    src, tensors = checkpoint
    d = daemon()
    ranks = [
        d.start_rank(str(src), k, 2, src, None, RANK_SLICES=json.dumps(SLICES[k]), RANK_BORROWED="1" if borrowed else "")
        for k in range(2)
    ]
    results = [finish(p) for p in ranks]
    for k, res in enumerate(results):
        assert res["bad"] == [] and sorted(res["got"]) == sorted(TENSORS)
        assert res["received"] == _truth_bytes(tensors, SLICES[k])
    (session,) = d.finished(1)
    assert session["state"] == "done"
    assert session["bytes_read"] == sum(t.nbytes for t in tensors.values())
    assert d.healthy()


def test_a_rank_s_bad_slice_is_refused_at_the_join_and_nothing_is_read(checkpoint, daemon):
    src, _ = checkpoint
    d = daemon()
    script = (
        "import json, sys, streamer_client\n"
        "try:\n"
        "    streamer_client.stream(sys.argv[1], slices={'o_proj': (1, 0, 65)})\n"
        "except streamer_client.errors.SelectionError as exc:\n"
        "    print(json.dumps([type(exc).__name__, exc.message, exc.key]))\n"
    )
    p = subprocess.run([sys.executable, "-c", script, str(src)], env=d.rank_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert json.loads(p.stdout.strip().splitlines()[-1]) == [
        "SelectionError",
        "tensor 'o_proj' (torch shape [48, 64]): slice [0, 65) of dim 1 is outside [0, 64]",
        "o_proj",
    ]
    assert d.stats()["bytes_read"] == 0
    assert d.healthy()


def test_safetensors_reads_the_test_checkpoint_as_written(checkpoint):
    """The ground truth itself: safetensors gives back what the fixture wrote (F4 included)."""
    src, tensors = checkpoint
    with safe_open(src / "model.safetensors", "pt") as f:
        for name, t in tensors.items():
            assert _same(f.get_tensor(name), t), name
