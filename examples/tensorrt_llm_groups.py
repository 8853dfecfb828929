"""TensorRT-LLM-style loading: a per-rank plan of tensor groups, each built as soon as it arrived.

    python examples/tensorrt_llm_groups.py [URI] [--rank R --world-size W] [--out FILE]

Pipeline-parallel split: rank R of W owns a contiguous run of decoder layers (the first rank
also the embedding, the last the final norm and LM head). Its plan is one group per layer,
named from the pulled ``model.safetensors.index.json``; each group is "built" (here: reported)
the moment its last tensor lands, while later layers are still streaming. Without URI a tiny
Llama checkpoint is written to a temp dir. ``--out`` saves every tensor this rank received.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path

import streamer_client
from streamer_client.integrations.tensorrt_llm import load_groups

LAYER = re.compile(r"model\.layers\.(\d+)\.")


def rank_plan(names: list[str], num_layers: int, rank: int, world_size: int) -> dict[str, list[str]]:
    """Groups for this pipeline stage: ``layer.<i>`` for its layers, plus ``embedding`` / ``head``."""
    per = -(-num_layers // world_size)
    mine = range(rank * per, min((rank + 1) * per, num_layers))
    groups: dict[str, list[str]] = {}
    for name in names:
        match = LAYER.match(name)
        if match:
            layer = int(match.group(1))
            if layer in mine:
                groups.setdefault(f"layer.{layer}", []).append(name)
        elif name.startswith("model.embed_tokens.") and rank == 0:
            groups.setdefault("embedding", []).append(name)
        elif rank == world_size - 1 and not name.startswith("model.embed_tokens."):
            groups.setdefault("head", []).append(name)  # model.norm, lm_head
    return groups


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("uri", nargs="?", help="checkpoint: s3://, gs://, az:// or a local dir (default: a tiny sample)")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--out", help="save every tensor this rank received here (safetensors)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        uri = args.uri
        if uri is None:
            from _sample import tiny_llama

            uri = str(tiny_llama(Path(tmp) / "tiny-llama"))
        metadata = streamer_client.pull_metadata(uri)
        config = json.loads((metadata / "config.json").read_text())
        names = sorted(json.loads((metadata / "model.safetensors.index.json").read_text())["weight_map"])
        plan = rank_plan(names, config["num_hidden_layers"], args.rank, args.world_size)
        received = {}
        # Through a daemon the stages form one session: the node reads the union of their plans once.
        for group, tensors in load_groups(uri, plan, rank=args.rank, world_size=args.world_size):
            nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
            print(f"rank {args.rank}: {group} ready ({len(tensors)} tensors, {nbytes} bytes)", flush=True)
            received.update(tensors)  # a real engine would build the layer here
        if args.out:
            from safetensors.torch import save_file

            save_file({k: v.contiguous() for k, v in received.items()}, args.out)
        print(f"rank {args.rank}/{args.world_size}: {len(plan)} groups, {len(received)} tensors")
    return 0


if __name__ == "__main__":
    sys.exit(main())
