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


def tiny_llama_for_engines(directory: str | Path, seed: int = 0) -> Path:
    """A 3-layer Llama that real engines serve: head_dim 64 (vLLM's CPU attention needs >= 64),
    a word-level tokenizer (``t0`` ... ``t252``), and a ``generation_config.json`` (top_k=7) whose
    arrival the engine tests check; ~2 MB in 5 shards.
    """
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i + 3 for i in range(253)}}
    config = LlamaConfig(
        hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, vocab_size=len(vocab), max_position_embeddings=128,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(directory, max_shard_size="500KB")
    GenerationConfig(bos_token_id=1, eos_token_id=2, top_k=7, do_sample=True).save_pretrained(directory)
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>", bos_token="<s>", eos_token="</s>").save_pretrained(
        directory
    )
    return Path(directory)
