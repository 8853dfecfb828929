"""The engine adapters in streamer_client.integrations, in-process (the examples run them as users do)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from checkpoints import ground_truth, make_sharded_checkpoint, many_small_tensors
from streamer_client.errors import CheckpointError, ConfigError, SelectionError
from streamer_client.integrations.huggingface import from_pretrained
from streamer_client.integrations.tensorrt_llm import load_groups
from streamer_client.integrations.vllm import weights_iterator

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from _sample import tiny_llama  # noqa: E402


@pytest.fixture
def ckpt(tmp_path) -> Path:
    make_sharded_checkpoint(tmp_path / "ckpt", many_small_tensors(12), 3)
    return tmp_path / "ckpt"


def test_adapters_import_no_engine():
    code = (
        "import sys, streamer_client.integrations.vllm, streamer_client.integrations.tensorrt_llm, "
        "streamer_client.integrations.huggingface\n"
        "print(sorted(m for m in ('vllm', 'tensorrt_llm', 'transformers', 'tqdm', 'streamer_service') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_weights_iterator_filters_names_in_checkpoint_order(ckpt):
    truth = ground_truth(ckpt)
    keep = [n for n in truth if n.endswith(("1.weight", "3.weight"))]
    got = list(weights_iterator(ckpt, name_filter=lambda n: n in keep))
    assert [n for n, _ in got] == keep  # checkpoint order
    assert all(torch.equal(t, truth[n]) and t.device.type == "cpu" for n, t in got)


def test_groups_come_complete_in_arrival_order(ckpt):
    truth = ground_truth(ckpt)
    names = list(truth)  # checkpoint order
    # "outer" needs the first and the last tensor: it completes last, after "inner".
    groups = {"outer": [names[0], names[-1]], "inner": names[3:6]}
    got = list(load_groups(ckpt, groups))
    assert [key for key, _ in got] == ["inner", "outer"]
    for key, tensors in got:
        assert sorted(tensors) == sorted(groups[key])
        assert all(torch.equal(t, truth[n]) for n, t in tensors.items())


def test_group_errors_name_the_tensor(ckpt):
    names = list(ground_truth(ckpt))
    with pytest.raises(ConfigError, match=rf"tensor '{names[1]}' is in group 'a' and in group 'b'"):
        load_groups(ckpt, {"a": names[:2], "b": names[1:3]})
    with pytest.raises(ConfigError, match="group 'a' must be a non-empty list of tensor names"):
        load_groups(ckpt, {"a": []})
    with pytest.raises(ConfigError, match="borrowed views cannot be kept"):
        load_groups(ckpt, {"a": names[:1]}, borrowed=True)
    with pytest.raises(SelectionError, match="layers.99.weight"):
        load_groups(ckpt, {"a": ["layers.99.weight"]})
    # An entry that is only a prefix of names selects those, but no group names them.
    with pytest.raises(SelectionError, match="received 'layers.1.weight', which no group names"):
        list(load_groups(ckpt, {"a": ["layers.1."]}))


def test_huggingface_model_equals_transformers_own_and_is_strict(tmp_path):
    from transformers import AutoModelForCausalLM

    llama = tiny_llama(tmp_path / "llama")
    ids = torch.tensor([[3, 1, 4, 1, 5, 9]])
    model = from_pretrained(llama)
    reference = AutoModelForCausalLM.from_pretrained(llama).eval()
    assert not model.training
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)
    everything_but_norm = [n for n in ground_truth(llama) if n != "model.norm.weight"]
    with pytest.raises(CheckpointError, match=r"does not fit LlamaForCausalLM: missing keys: model\.norm\.weight"):
        from_pretrained(llama, stream_kwargs={"select": everything_but_norm})
