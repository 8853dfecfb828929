"""benchmarks/tp_node.py: the TP rule it slices by, its bit-exact check, and a small run end to end
on the CPU (real rank processes, a plain daemon and a retaining one). Speed is never asserted: the
run is checked for what each rank kept and received and what the daemons read."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "tp_node.py"


def _bench():
    spec = importlib.util.spec_from_file_location("tp_node", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


tp_node = _bench()


def test_the_tp_rule_splits_by_megatron_and_replicates_kv_heads_over_groups_of_ranks():
    config = tp_node.llama_config(6.4, 8, None)
    assert (config["hidden_size"], config["num_key_value_heads"], config["vocab_size"]) == (4096, 4, 128256)
    shapes = tp_node.llama_shapes(config)
    plans = [tp_node.tp_slices(config, shapes, r, 8) for r in range(8)]
    layer = "model.layers.0."
    # KV heads: 4 heads of 128 rows over 8 ranks, each head kept by a pair of ranks.
    assert [p[layer + "self_attn.k_proj.weight"] for p in plans] == [
        (0, h * 128, (h + 1) * 128) for h in (0, 0, 1, 1, 2, 2, 3, 3)
    ]
    assert plans[3][layer + "self_attn.v_proj.weight"] == (0, 128, 256)
    assert plans[3][layer + "self_attn.q_proj.weight"] == (0, 3 * 512, 4 * 512)
    assert plans[3][layer + "mlp.gate_proj.weight"] == plans[3][layer + "mlp.up_proj.weight"] == (0, 3 * 1792, 4 * 1792)
    assert plans[3][layer + "self_attn.o_proj.weight"] == (1, 3 * 512, 4 * 512)
    assert plans[3][layer + "mlp.down_proj.weight"] == (1, 3 * 1792, 4 * 1792)
    assert plans[7]["model.embed_tokens.weight"] == plans[7]["lm_head.weight"] == (0, 7 * 16032, 128256)
    assert plans[5][layer + "input_layernorm.weight"] == plans[5]["model.norm.weight"] == (0, 0, 4096)
    # Every byte is kept by one rank, but a KV head's by two and a norm's by all eight.
    size = {n: tp_node.slice_bytes(s, (0, 0, s[0])) for n, s in shapes.items()}
    kept = sum(tp_node.slice_bytes(shapes[n], p) for plan in plans for n, p in plan.items())
    kv = sum(b for n, b in size.items() if n.split(".")[-2] in ("k_proj", "v_proj"))
    norms = sum(b for n, b in size.items() if len(shapes[n]) == 1)
    assert kept == sum(size.values()) + kv + 7 * norms


def test_more_kv_heads_than_ranks_are_split_and_a_layout_that_does_not_divide_is_refused():
    config = tp_node.llama_config(0.05, 2, 4)
    shapes = tp_node.llama_shapes(config)
    assert [tp_node.tp_slices(config, shapes, r, 2)["model.layers.0.self_attn.k_proj.weight"] for r in (0, 1)] == [
        (0, 0, 256),
        (0, 256, 512),
    ]
    with pytest.raises(SystemExit, match="attention heads 4 is not divisible by 3 ranks"):
        tp_node.llama_config(0.05, 3, 1)


def test_the_check_finds_a_changed_byte_a_wrong_shape_and_a_missing_tensor(tmp_path):
    config = tp_node.llama_config(0.001, 2, None)
    shapes = tp_node.llama_shapes(config)
    tp_node.write_checkpoint(tmp_path, config, shapes, 2, "cpu")
    files = sorted(tmp_path.glob("*.safetensors"))
    plan = tp_node.tp_slices(config, shapes, 1, 2)
    from safetensors import safe_open

    state = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118
                state[name] = tp_node._narrow(f.get_tensor(name), plan[name]).clone()
    assert tp_node.check(state, plan, files) == 0
    o_proj = "model.layers.0.self_attn.o_proj.weight"
    state[o_proj].view(torch.uint8)[3, 5] ^= 1
    state["model.norm.weight"] = state["model.norm.weight"][:-1].clone()
    del state["lm_head.weight"]
    assert tp_node.check(state, plan, files) == 3


@pytest.mark.timeout(300)
def test_a_small_cpu_run_keeps_every_shard_bit_exact_and_each_rank_receives_only_its_slices(tmp_path):
    out = tmp_path / "tp.json"
    cmd = [sys.executable, str(SCRIPT), "--device", "cpu", "--ranks", "2", "--size-gb", "0.05", "--rounds", "1",
           "--rows", "cold,warm", "--warmup", "0", "--disk-dir", str(tmp_path), "--json", str(out)]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["ok"] is True and report["problems"] == []
    model, kept = report["checkpoint"]["bytes"], report["checkpoint"]["kept_per_rank"]
    assert sum(kept) > model  # the one KV head is kept by both ranks
    assert {s["row"]: s["bad_tensors"] for s in report["rows"]} == {"cold": 0, "warm": 0}
    for rounds in report["raw"].values():
        for go in rounds:
            assert [r["received"] for r in go["ranks"]] == kept
            assert [r["to_device"] for r in go["ranks"]] == kept
            assert {r["tensors"] for r in go["ranks"]} == {report["checkpoint"]["tensors"]}
    cold, warm = report["raw"]["cold"][0]["daemon"], report["raw"]["warm"][0]["daemon"]
    assert (cold["read"], cold["served"]) == (model, 0)  # the checkpoint read once for both ranks
    assert (warm["read"], warm["served"]) == (0, model)  # every byte from the resident copy
    assert "node host-memory bytes copied" in result.stdout and "page-locked" in result.stdout
