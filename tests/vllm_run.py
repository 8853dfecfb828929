"""Run a real vLLM (the venv scripts/vllm-venv makes) on one model; print what tests/test_vllm.py checks.

    .venv-vllm/bin/python tests/vllm_run.py MODEL LOAD_FORMAT OUT_JSON [EXTRA_CONFIG_JSON [ENGINE_JSON]]

Greedy generation of a fixed prompt; writes token ids, text, the default sampling parameters
(from generation_config.json) and the model config vLLM ended up with. ENGINE_JSON holds more
arguments for ``LLM()`` (``tensor_parallel_size``); ``VLLM_RUN_GENERATE=0`` builds the engine and
generates nothing. vLLM starts its engine and worker processes with
spawn, which imports this file again in each: hence the ``__main__`` guard, and the load format
below is registered at import, so that every worker has it.

LOAD_FORMAT ``shards-check`` (with ``VLLM_RUN_SHARDS_DIR`` set): vLLM's default loader, then this
rank's plan from ``streamer_client.integrations._vllm_shards`` loaded over it, from the same files
cut as ``stream(slices=)`` cuts them (the pieces of a tensor concatenated along their dim). Each
rank writes ``rank<N>.json`` there: the plan, and which parameters differ from vLLM's own load.
Generation then runs on what the plan loaded.
"""

from __future__ import annotations

import json
import os
import sys

PROMPTS = ["t3 t1 t4 t1 t5 t9 t2 t6", "t10 t20 t30"]
MAX_TOKENS = 12
SHARDS_DIR = os.environ.get("VLLM_RUN_SHARDS_DIR")
GENERATE = os.environ.get("VLLM_RUN_GENERATE", "1") != "0"


def main(model: str, load_format: str, out: str, extra: str | None = None, engine: str | None = None) -> None:
    from vllm import LLM, SamplingParams

    loader_config = json.loads(extra) if extra else {}
    options = {"model_loader_extra_config": loader_config} if loader_config else {}
    llm = LLM(
        model=model,
        load_format=load_format,
        **options,
        **json.loads(engine or "{}"),
        dtype="float32",
        max_model_len=64,
        gpu_memory_utilization=0.08,
        enforce_eager=True,
        seed=0,
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(PROMPTS, greedy, use_tqdm=False) if GENERATE else []
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


def register_shards_check(out_dir: str) -> None:
    import dataclasses
    import glob

    import torch
    from safetensors import safe_open
    from vllm.distributed import get_tensor_model_parallel_rank
    from vllm.model_executor.model_loader import register_model_loader
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    from streamer_client.integrations._tensor_use import TensorSpec
    from streamer_client.integrations._vllm_shards import plan_shards

    dtypes = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
    marks = ("tp_rank", "is_sharded_weight", "weight_loader")

    @register_model_loader("shards-check")
    class ShardsCheck(BaseModelLoader):
        def __init__(self, load_config):
            super().__init__(load_config)
            self.default = DefaultModelLoader(dataclasses.replace(load_config, load_format="auto"))

        def download_model(self, model_config):
            self.default.download_model(model_config)

        def load_weights(self, model, model_config):
            self.default.load_weights(model, model_config)
            params = dict(model.named_parameters())
            reference = {name: p.detach().clone() for name, p in params.items()}
            attributes = {name: {k: v for k, v in vars(p).items() if k in marks} for name, p in params.items()}
            files, tensors = {}, {}
            for path in sorted(glob.glob(os.path.join(model_config.model, "*.safetensors"))):
                with safe_open(path, "pt") as f:
                    for name in f.keys():
                        files[name] = path
                        tensors[name] = TensorSpec(dtypes[f.get_slice(name).get_dtype()], tuple(f.get_slice(name).get_shape()))
            plan = plan_shards(model, tensors)
            for p in params.values():
                p.data.fill_(float("nan"))

            def cut():
                for name in plan.select:
                    with safe_open(files[name], "pt") as f:
                        tensor = f.get_tensor(name)
                    pieces = plan.slices.get(name)
                    if pieces:
                        dim = pieces[0][0]
                        tensor = torch.cat([tensor.narrow(dim, start, stop - start) for _, start, stop in pieces], dim=dim)
                    yield name, tensor

            with plan.loading(model):
                loaded = model.load_weights(cut())
            rank = get_tensor_model_parallel_rank()
            result = {
                "rank": rank,
                "summary": plan.summary(),
                "uses": {n: [u.use.value, [list(p) for p in u.pieces], list(u.targets), u.reason] for n, u in plan.uses.items()},
                "slices": {n: [list(p) for p in pieces] for n, pieces in plan.slices.items()},
                "marked": {n: h.how for n, h in plan.marked.items()},
                "fallbacks": plan.fallbacks,
                "requested_bytes": plan.requested_bytes(),
                "parameter_bytes": sum(p.numel() * p.element_size() for p in params.values()),
                "loaded": sorted(loaded),
                "differ": [n for n, p in params.items() if not _same_bytes(p.detach(), reference[n])],
                "marks_left": [n for n, p in params.items() if {k: v for k, v in vars(p).items() if k in marks} != attributes[n]],
            }
            with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
                json.dump(result, f)


def _same_bytes(a, b) -> bool:
    import torch

    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


if SHARDS_DIR:
    register_shards_check(SHARDS_DIR)

if __name__ == "__main__":
    main(*sys.argv[1:])
