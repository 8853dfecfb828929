"""The TensorRT-LLM adapter's group path: a rank's plan (pipeline stage, its ``moe_ep_rank``'s
experts, the tensors outside the layers) loaded group by group, in-process and through a real
daemon with real rank processes that run our registered loader against the engine stand-ins
(tests/engine_fakes, see tests/test_engine_interfaces.py)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from checkpoints import ground_truth, make_sharded_checkpoint
from safetensors.torch import load_file

from streamer_client.errors import ConfigError
from streamer_client.integrations.tensorrt_llm import expert_index, load_groups, rank_groups

FAKES = Path(__file__).resolve().parent / "engine_fakes"


def _stand_in_mapping():
    """TensorRT-LLM's ``Mapping`` as the stand-in has it, without putting the stand-ins on sys.path."""
    spec = importlib.util.spec_from_file_location("trtllm_mapping", FAKES / "tensorrt_llm" / "mapping.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Mapping


Mapping = _stand_in_mapping()


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def moe_checkpoint(directory: Path, *, layers: int, experts: int, hidden: int, inter: int, shards: int = 3) -> dict:
    """A Mixtral-named MoE checkpoint (HF names, an index, ``config.json``); returns its tensors."""
    g = torch.Generator().manual_seed(0)
    tensors = {"model.embed_tokens.weight": torch.randn(256, hidden, generator=g)}
    for i in range(layers):
        prefix = f"model.layers.{i}."
        tensors[prefix + "self_attn.q_proj.weight"] = torch.randn(hidden, hidden, generator=g)
        tensors[prefix + "block_sparse_moe.gate.weight"] = torch.randn(experts, hidden, generator=g)
        for e in range(experts):
            for w in ("w1", "w2", "w3"):
                tensors[f"{prefix}block_sparse_moe.experts.{e}.{w}.weight"] = torch.randn(inter, hidden, generator=g)
    tensors["model.norm.weight"] = torch.randn(hidden, generator=g)
    tensors["lm_head.weight"] = torch.randn(256, hidden, generator=g)
    make_sharded_checkpoint(directory, tensors, shards)
    config = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_hidden_layers": layers}
    (directory / "config.json").write_text(json.dumps(config))
    return tensors


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("trtllm") / "moe"
    moe_checkpoint(directory, layers=3, experts=4, hidden=32, inter=64)
    return directory


def wanted(names, *, experts: set[int] | None = None, layers: set[int] | None = None) -> set[str]:
    keep = set()
    for name in names:
        if experts is not None and expert_index(name) is not None and expert_index(name) not in experts:
            continue
        if layers is not None and ".layers." in name and int(name.split(".layers.")[1].split(".")[0]) not in layers:
            continue
        keep.add(name)
    return keep


def test_rank_groups_split_experts_contiguously_and_keep_the_rest_on_every_rank(moe):
    names = sorted(ground_truth(moe))
    for ep_rank, mine in ((0, {0, 1}), (1, {2, 3})):
        plan = rank_groups(names, Mapping(world_size=2, rank=ep_rank, tp_size=2, moe_ep_size=2))
        assert {n for group in plan.values() for n in group} == wanted(names, experts=mine)
        assert sorted(plan) == sorted(["lm_head", "model.embed_tokens", "model.norm"] + [f"model.layers.{i}" for i in range(3)])
        assert all(n.startswith(key + ".") for key, group in plan.items() for n in group)
    # moe_tp only (moe_ep_size 1): every expert on every rank.
    plan = rank_groups(names, Mapping(world_size=2, rank=1, tp_size=2))
    assert sorted(n for group in plan.values() for n in group) == names
    # A pipeline stage and its experts together: layer 2 on stage 1, experts 2-3 on EP rank 1.
    plan = rank_groups(names, Mapping(world_size=4, rank=3, tp_size=2, pp_size=2, moe_ep_size=2), 3)
    assert {n for group in plan.values() for n in group} == wanted(names, experts={2, 3}, layers={2})
    with pytest.raises(ConfigError, match="4 experts do not split evenly over moe_ep_size 3"):
        rank_groups(names, Mapping(world_size=3, rank=0, tp_size=3, moe_ep_size=3))
    with pytest.raises(ConfigError, match="pipeline parallelism needs num_layers"):
        rank_groups(names, Mapping(world_size=2, rank=0, pp_size=2))


def test_a_tied_tensor_in_two_groups_is_read_once_and_handed_to_both(moe):
    truth = ground_truth(moe)
    tied = "model.embed_tokens.weight"
    layer0 = [n for n in truth if n.startswith("model.layers.0.")]
    groups = {"embedding": [tied], "head": [tied, "lm_head.weight", "model.norm.weight"], "layer.0": layer0}
    got = list(load_groups(moe, groups))
    assert sorted(key for key, _ in got) == sorted(groups)  # each group once
    for key, tensors in got:
        assert sorted(tensors) == sorted(groups[key])
        assert all(torch.equal(t, truth[n]) for n, t in tensors.items())
    by_key = dict(got)
    assert by_key["embedding"][tied] is by_key["head"][tied]  # one tensor, streamed once
    with pytest.raises(ConfigError, match=rf"tensor '{tied}' is twice in group 'a'"):
        load_groups(moe, {"a": [tied, tied]})


RANK = """
import json, sys, threading
import torch
import streamer_client.integrations.tensorrt_llm_loader  # registers STREAMER
from tensorrt_llm._torch.models.checkpoints.base_checkpoint_loader import BaseCheckpointLoader
from tensorrt_llm.mapping import Mapping

model, mode, world, rank, ep, out, store = sys.argv[1:8]
world, rank, ep = int(world), int(rank), int(ep)
if store != "-":  # the engine's ranks, over which our loader agrees on one daemon session
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", world_size=world, rank=rank)
mapping = Mapping(world_size=world, rank=rank, tp_size=world, moe_ep_size=ep)
loader = BaseCheckpointLoader.get("STREAMER")                # what checkpoint_format selects

def anon():  # resident anonymous memory of this process, bytes
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:")) * 1024

peak, done = [0], threading.Event()
def sample():
    while not done.is_set():
        peak[0] = max(peak[0], anon())
        done.wait(0.0005)

base = anon()
sampler = threading.Thread(target=sample, daemon=True)
sampler.start()
groups, received = [], {}
if mode == "groups":
    def load_group(key, tensors):
        peak[0] = max(peak[0], anon())  # the group and whatever else is held, at its fullest
        groups.append([key, sorted(tensors), sum(t.numel() * t.element_size() for t in tensors.values())])
        if out != "-":
            received.update({n: t.clone() for n, t in tensors.items()})
    order = loader.weight_loader.load_weights_in_groups(model, mapping, load_group)
    assert order == [key for key, _, _ in groups], order
else:
    weights = loader.load_weights(model, mapping=mapping)
    groups.append([None, sorted(weights), sum(t.numel() * t.element_size() for t in weights.values())])
    received = weights if out != "-" else {}
done.set()
sampler.join()
growth = max(peak[0], anon()) - base
if out != "-":
    from safetensors.torch import save_file
    save_file({k: v.contiguous() for k, v in received.items()}, out)
print(json.dumps({"groups": groups, "peak": growth}))
"""


def start_rank(model: Path, mode: str, world: int, rank: int, ep: int, out: str, store, env: dict) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", RANK, str(model), mode, str(world), str(rank), str(ep), out, str(store)],
        env={**env, "PYTHONPATH": str(FAKES)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def result(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-4000:]
    return json.loads(out.splitlines()[-1])


def test_groups_come_once_each_complete_in_process(moe, tmp_path):
    truth = ground_truth(moe)
    out = tmp_path / "rank1.st"
    got = result(start_rank(moe, "groups", 2, 1, 2, str(out), "-", dict(os.environ)))  # rank 1 alone
    plan = rank_groups(sorted(truth), Mapping(world_size=2, rank=1, tp_size=2, moe_ep_size=2))
    assert sorted(key for key, _, _ in got["groups"]) == sorted(plan)  # each group once
    for key, names, _ in got["groups"]:
        assert names == sorted(plan[key])  # complete when handed over
    loaded = load_file(out)
    assert set(loaded) == wanted(truth, experts={2, 3})
    assert all(torch.equal(loaded[n], truth[n]) for n in loaded)


def test_expert_parallel_ranks_receive_only_their_experts_through_a_daemon(moe, tmp_path, daemon):
    truth = ground_truth(moe)
    d = daemon()
    ranks = [start_rank(moe, "groups", 2, r, 2, str(tmp_path / f"r{r}.st"), tmp_path / "store", d.rank_env()) for r in range(2)]
    outs = [result(p) for p in ranks]
    summary = d.finished(1)[-1]
    for r, mine in ((0, {0, 1}), (1, {2, 3})):
        want = wanted(truth, experts=mine)
        assert {n for _, names, _ in outs[r]["groups"] for n in names} == want
        loaded = load_file(tmp_path / f"r{r}.st")
        assert set(loaded) == want and all(torch.equal(loaded[n], truth[n]) for n in want)
        sent = summary["ranks"][str(r)]
        assert sent["bytes_delivered"] == sent["bytes_selected"] == sum(nbytes(truth[n]) for n in want)
    # One session for both ranks: the node read every byte once (the shared tensors too).
    stats = d.stats()
    assert len(stats["finished"]) == 1
    assert stats["bytes_read"] == sum(map(nbytes, truth.values()))


SHM_BUDGET = 8 << 20  # the daemon's ring: what the rank's copies can run ahead of the loader by
ALLOWANCE = 8 << 20  # allocator slack and the tensors of groups still arriving


def test_group_path_holds_one_group_not_the_rank_s_selection(tmp_path, daemon):
    model = tmp_path / "moe"
    truth = moe_checkpoint(model, layers=8, experts=4, hidden=256, inter=512)  # ~50 MB, ~6 MB a layer
    total = sum(map(nbytes, truth.values()))
    d = daemon({"STREAMER_SHM_BUDGET": str(SHM_BUDGET)})
    grouped = result(start_rank(model, "groups", 1, 0, 1, "-", "-", d.rank_env()))
    whole = result(start_rank(model, "dict", 1, 0, 1, "-", "-", d.rank_env()))
    largest = max(size for _, _, size in grouped["groups"])
    assert sum(size for _, _, size in grouped["groups"]) == total == whole["groups"][0][2]
    assert grouped["peak"] <= largest + SHM_BUDGET + ALLOWANCE, (grouped["peak"] >> 20, largest >> 20)
    assert whole["peak"] >= 0.9 * total, (whole["peak"] >> 20, total >> 20)  # the dict holds it all
