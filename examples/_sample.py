"""A tiny Llama checkpoint for the examples (and their tests): config + sharded safetensors + index.

Built with transformers' own ``save_pretrained``, so names, shapes, index and config are what a
real Hugging Face checkpoint has; ~90 kB in 7 shards, so every adapter sees several files.
"""

from __future__ import annotations

from pathlib import Path


def tiny_llama(directory: str | Path, seed: int = 0) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(directory, max_shard_size="20KB")
    return Path(directory)
