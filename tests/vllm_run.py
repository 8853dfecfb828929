"""Run a real vLLM (the venv scripts/vllm-venv makes) on one model; print what tests/test_vllm.py checks.

    .venv-vllm/bin/python tests/vllm_run.py MODEL LOAD_FORMAT OUT_JSON [EXTRA_CONFIG_JSON]

Greedy generation of a fixed prompt; writes token ids, text, the default sampling parameters
(from generation_config.json) and the model config vLLM ended up with. vLLM starts worker
processes with spawn, which re-imports this file: hence the ``__main__`` guard.
"""

from __future__ import annotations

import json
import sys

PROMPTS = ["t3 t1 t4 t1 t5 t9 t2 t6", "t10 t20 t30"]
MAX_TOKENS = 12


def main(model: str, load_format: str, out: str, extra: str | None = None) -> None:
    from vllm import LLM, SamplingParams

    options = {"model_loader_extra_config": json.loads(extra)} if extra else {}
    llm = LLM(
        model=model,
        load_format=load_format,
        **options,
        dtype="float32",
        max_model_len=64,
        gpu_memory_utilization=0.08,
        enforce_eager=True,
        seed=0,
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(PROMPTS, greedy, use_tqdm=False)
    config = llm.llm_engine.model_config
    defaults = llm.get_default_sampling_params()
    result = {
        "token_ids": [list(o.outputs[0].token_ids) for o in outputs],
        "prompt_token_ids": [list(o.prompt_token_ids) for o in outputs],
        "text": [o.outputs[0].text for o in outputs],
        "default_top_k": defaults.top_k,
        "default_repetition_penalty": defaults.repetition_penalty,
        "model": config.model,
        "weights_uri": llm.llm_engine.vllm_config.load_config.model_loader_extra_config.get("uri"),
        "tokenizer": config.tokenizer,
        "served_model_name": config.served_model_name,
    }
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
