"""The sample checkpoint of the demo and the benchmark: MoE-shaped, sharded, random bf16.

Also the tensor-parallel-like rank selection both use: every rank needs the
shared tensors, each rank its own experts.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["SampleShape", "build_sample", "rank_selection", "sample_shape"]


@dataclass(frozen=True)
class SampleShape:
    layers: int
    experts: int
    hidden: int
    expert_hidden: int
    vocab: int


def sample_shape(size_mb: int) -> SampleShape:
    """A checkpoint of roughly ``size_mb`` MB: 4 layers x 8 experts, hidden size scaled to fit."""
    layers, experts = 4, 8
    hidden = 256
    while True:
        shape = SampleShape(layers, experts, hidden, hidden * 2, 8192)
        if _param_count(shape) * 2 >= size_mb * 1e6 or hidden >= 8192:
            return shape
        hidden += 64


def _param_count(s: SampleShape) -> int:
    attn = 4 * s.hidden * s.hidden
    expert = 3 * s.hidden * s.expert_hidden
    shared = expert
    per_layer = attn + s.experts * expert + shared + 2 * s.hidden + s.experts * s.hidden
    return s.layers * per_layer + 2 * s.vocab * s.hidden + s.hidden


def build_sample(directory: Path, size_mb: int, seed: int = 0) -> list[str]:
    """Write an HF-style sharded bf16 checkpoint (+ index and config); return tensor names."""
    import torch
    from safetensors.torch import save_file

    s = sample_shape(size_mb)
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=g, dtype=torch.float32).to(torch.bfloat16)

    tensors: dict[str, torch.Tensor] = {"model.embed_tokens.weight": rand(s.vocab, s.hidden)}
    for i in range(s.layers):
        p = f"model.layers.{i}."
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            tensors[f"{p}self_attn.{proj}.weight"] = rand(s.hidden, s.hidden)
        tensors[f"{p}input_layernorm.weight"] = rand(s.hidden)
        tensors[f"{p}post_attention_layernorm.weight"] = rand(s.hidden)
        tensors[f"{p}mlp.gate.weight"] = rand(s.experts, s.hidden)
        for e in range(s.experts):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                shape = (s.hidden, s.expert_hidden) if proj == "down_proj" else (s.expert_hidden, s.hidden)
                tensors[f"{p}mlp.experts.{e}.{proj}.weight"] = rand(*shape)
        for proj in ("gate_proj", "up_proj", "down_proj"):
            shape = (s.hidden, s.expert_hidden) if proj == "down_proj" else (s.expert_hidden, s.hidden)
            tensors[f"{p}mlp.shared_expert.{proj}.weight"] = rand(*shape)
    tensors["model.norm.weight"] = rand(s.hidden)
    tensors["lm_head.weight"] = rand(s.vocab, s.hidden)

    directory.mkdir(parents=True, exist_ok=True)
    names = list(tensors)
    n_shards = 2
    per = -(-len(names) // n_shards)
    weight_map = {}
    for k in range(n_shards):
        shard = f"model-{k + 1:05d}-of-{n_shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[k * per : (k + 1) * per]}
        save_file(part, str(directory / shard), metadata={"format": "pt"})
        weight_map.update({n: shard for n in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))
    config = {
        "model_type": "qwen2_moe", "hidden_size": s.hidden, "num_hidden_layers": s.layers,
        "num_experts": s.experts, "moe_intermediate_size": s.expert_hidden, "vocab_size": s.vocab,
        "torch_dtype": "bfloat16",
    }  # fmt: skip
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return names


def rank_selection(names: Sequence[str], rank: int, world_size: int) -> list[str]:
    """TP-like: every non-expert tensor, plus the experts ``e`` with ``e % world_size == rank``."""
    chosen = []
    for name in names:
        parts = name.split(".")
        if "experts" in parts:
            expert = int(parts[parts.index("experts") + 1])
            if expert % world_size != rank:
                continue
        chosen.append(name)
    return chosen
