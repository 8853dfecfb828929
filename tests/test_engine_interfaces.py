"""TensorRT-LLM's and SGLang's calls into our loaders, against the interface each was written for.

Neither engine installs here (both need CUDA), so tests/engine_fakes holds their interface as read
upstream (files and revisions named in each module there and in our loaders' docstrings):
registries, base classes, the call that selects the loader and the call into it. The loaders run
in a subprocess with that dir on sys.path, on a checkpoint in S3 (moto), in-process. A change of
either call's shape upstream means changing the stand-in, and this test then says what broke.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from checkpoints import ground_truth
from safetensors.torch import load_file

FAKES = Path(__file__).resolve().parent / "engine_fakes"
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from _sample import tiny_llama_for_engines  # noqa: E402


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return tiny_llama_for_engines(tmp_path_factory.mktemp("engines") / "llama")


def run_with_engine(code: str, *args: str, env: dict) -> str:
    """``code`` in a subprocess that imports the engine stand-ins (and the backend's credentials)."""
    result = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=240,
        env={**os.environ, **env, "PYTHONPATH": str(FAKES)},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout


TRTLLM = """
import sys, torch
from safetensors.torch import save_file
import streamer_client
import streamer_client.integrations.tensorrt_llm_loader  # registers STREAMER
from tensorrt_llm._torch.models.checkpoints.base_checkpoint_loader import BaseCheckpointLoader
from tensorrt_llm._torch.models.modeling_utils import get_checkpoint_weight_loader
from tensorrt_llm.mapping import Mapping

uri, rank, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
model_dir = str(streamer_client.pull_metadata(uri))          # LLM(model=<this>, checkpoint_format="STREAMER")
loader = BaseCheckpointLoader.get("STREAMER")                # what checkpoint_format selects
assert get_checkpoint_weight_loader("STREAMER") is type(loader.weight_loader)
config = loader.load_config(model_dir)
weights = loader.load_weights(model_dir, mapping=Mapping(world_size=2, rank=rank, tp_size=1, pp_size=2))
mapper = loader.get_initialized_weight_mapper(model=None, config=config)
save_file({k: v.contiguous() for k, v in weights.items()}, out)
print(type(mapper).__name__, config.pretrained_config.architectures[0], config.pretrained_config.num_hidden_layers)
"""


@pytest.mark.parametrize("backend", ["s3"], indirect=True)
def test_tensorrt_llm_pipeline_stages_load_what_their_mapping_needs(backend, llama, tmp_path):
    backend.put_tree("llama", {p.name: p.read_bytes() for p in llama.iterdir()})
    truth = ground_truth(llama)
    outside = {n for n in truth if ".layers." not in n}  # embedding, final norm, LM head
    stages = {0: {0, 1}, 1: {2}}  # Mapping.pp_layers(3) for pp_size 2
    for rank, layers in stages.items():
        out = tmp_path / f"stage{rank}.safetensors"
        printed = run_with_engine(TRTLLM, backend.uri("llama"), str(rank), str(out), env=backend.env)
        assert printed.split() == ["HfWeightMapper", "LlamaForCausalLM", "3"]
        got = load_file(out)
        want = {n for n in truth if n in outside or any(f".layers.{i}." in n for i in layers)}
        assert set(got) == want
        assert all(torch.equal(got[n], truth[n]) for n in want)


SGLANG = """
import json, sys, torch
from types import SimpleNamespace
from transformers import AutoConfig
from streamer_client.integrations.sglang import engine_kwargs
from sglang.srt.model_loader.loader import get_model

uri = sys.argv[1]
kwargs = engine_kwargs(uri)                                   # sglang.Engine(**kwargs)
load_config = SimpleNamespace(load_format=kwargs["load_format"], model_loader_extra_config=kwargs["model_loader_extra_config"])
model_config = SimpleNamespace(model_path=kwargs["model_path"], hf_config=AutoConfig.from_pretrained(kwargs["model_path"]),
                               dtype=torch.float32, quantization=None)
model = get_model(model_config=model_config, load_config=load_config, device_config=SimpleNamespace(device="cpu"))
with torch.no_grad():
    logits = model(torch.tensor([[3, 1, 4, 1, 5, 9]]))
torch.save(logits, sys.argv[2])
print(kwargs["load_format"].__name__, json.loads(kwargs["model_loader_extra_config"])["uri"] == uri, len(model.loaded))
"""


@pytest.mark.parametrize("backend", ["s3"], indirect=True)
def test_sglang_engine_takes_the_loader_class(backend, llama, tmp_path):
    from transformers import AutoModelForCausalLM

    backend.put_tree("llama", {p.name: p.read_bytes() for p in llama.iterdir()})
    out = tmp_path / "logits.pt"
    printed = run_with_engine(SGLANG, backend.uri("llama"), str(out), env=backend.env)
    assert printed.split() == ["StreamerModelLoader", "True", str(len(ground_truth(llama)))]
    reference = AutoModelForCausalLM.from_pretrained(llama).eval()
    with torch.no_grad():
        assert torch.equal(torch.load(out), reference(torch.tensor([[3, 1, 4, 1, 5, 9]])).logits)


def test_engine_loaders_reject_unknown_options_by_name():
    from streamer_client.errors import ConfigError
    from streamer_client.integrations.sglang import engine_kwargs

    with pytest.raises(
        ConfigError, match=r"engine_kwargs: unknown option 'budgett' \(known: socket, session, budget, borrowed, uri\)"
    ):
        engine_kwargs("s3://bucket/model", budgett="1GiB")
    with pytest.raises(ConfigError, match=r"engine_kwargs: borrowed must be true or false, got 'yes'"):
        engine_kwargs("s3://bucket/model", borrowed="yes")
