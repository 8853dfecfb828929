"""vLLM-style loading: a tensor-parallel model's ``load_weights`` consumes ``(name, tensor)`` pairs.

    python examples/vllm_load_weights.py [URI] [--rank R --world-size W] [--out FILE]

Without URI a tiny Llama checkpoint is written to a temp dir. With ``STREAMER_SOCKET`` set (a
running ``streamer-service serve``), start one process per rank with the same ``--world-size``:
the node reads each byte once and every rank gets the full tensors, which its weight loaders
narrow to its shard as vLLM's do. ``--out`` saves this rank's loaded parameters (safetensors).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

import streamer_client
from streamer_client.integrations.vllm import weights_iterator

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head")  # split dim 0
ROW = ("o_proj", "down_proj")  # split dim 1


class TensorParallelLM(nn.Module):
    """The parameters of a Llama model split as vLLM's parallel layers split them, with loaders."""

    def __init__(self, config: dict, rank: int, world_size: int) -> None:
        super().__init__()
        h, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
        kv = h // config["num_attention_heads"] * config["num_key_value_heads"]
        shapes = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,), "lm_head.weight": (vocab, h)}
        for i in range(config["num_hidden_layers"]):
            p = f"model.layers.{i}."
            shapes.update({
                p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
                p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                p + "mlp.down_proj.weight": (h, inter),
                p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            })  # fmt: skip
        self.rank, self.world_size = rank, world_size
        self.params = nn.ParameterDict()
        self.names = {}
        for name, shape in shapes.items():
            dim = self.shard_dim(name)
            if dim is not None:
                shape = tuple(s // world_size if d == dim else s for d, s in enumerate(shape))
            key = name.replace(".", "__")
            self.params[key] = nn.Parameter(torch.empty(shape, dtype=torch.float32), requires_grad=False)
            self.names[name] = key

    @staticmethod
    def shard_dim(name: str) -> int | None:
        module = name.split(".")[-2]
        return 0 if module in COLUMN else 1 if module in ROW else None

    def load_weights(self, weights) -> set[str]:
        """vLLM's contract: consume the iterator, copy each tensor (its shard) into its parameter."""
        loaded = set()
        for name, tensor in weights:
            param = self.params[self.names[name]]
            dim = self.shard_dim(name)
            if dim is not None:
                size = param.shape[dim]
                tensor = tensor.narrow(dim, self.rank * size, size)
            param.data.copy_(tensor)
            loaded.add(name)
        return loaded

    def loaded_state(self) -> dict[str, torch.Tensor]:
        return {name: self.params[key].data for name, key in self.names.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("uri", nargs="?", help="checkpoint: s3://, gs://, az:// or a local dir (default: a tiny sample)")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--out", help="save this rank's loaded parameters here (safetensors)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        uri = args.uri
        if uri is None:
            from _sample import tiny_llama

            uri = str(tiny_llama(Path(tmp) / "tiny-llama"))
        config = json.loads((streamer_client.pull_metadata(uri) / "config.json").read_text())
        model = TensorParallelLM(config, args.rank, args.world_size)
        loaded = model.load_weights(weights_iterator(uri, rank=args.rank, world_size=args.world_size))
        missing = set(model.names) - loaded
        if missing:
            print(f"rank {args.rank}: parameters without weights: {sorted(missing)}", file=sys.stderr)
            return 1
        if args.out:
            from safetensors.torch import save_file

            save_file({k: v.contiguous() for k, v in model.loaded_state().items()}, args.out)
        print(f"rank {args.rank}/{args.world_size}: loaded {len(loaded)} tensors into the model")
    return 0


if __name__ == "__main__":
    sys.exit(main())
