"""The engine adapters in streamer_client.integrations, in-process (the examples run them as users do)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from checkpoints import ground_truth, make_sharded_checkpoint, many_small_tensors

from streamer_client.errors import CheckpointError, ConfigError, SelectionError
from streamer_client.integrations._engine import safetensors_table
from streamer_client.integrations.huggingface import from_pretrained
from streamer_client.integrations.tensorrt_llm import load_groups
from streamer_client.integrations.vllm import weights_iterator

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from _sample import tiny_llama, tiny_llama_for_engines  # noqa: E402


@pytest.fixture
def ckpt(tmp_path) -> Path:
    make_sharded_checkpoint(tmp_path / "ckpt", many_small_tensors(12), 3)
    return tmp_path / "ckpt"


def test_adapters_import_no_engine():
    code = (
        "import sys, streamer_client.integrations.vllm, streamer_client.integrations.tensorrt_llm, "
        "streamer_client.integrations.huggingface, streamer_client.integrations.sglang\n"
        "print(sorted(m for m in ('vllm', 'tensorrt_llm', 'sglang', 'transformers', 'tqdm', 'streamer_service') if m in sys.modules))"
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


def test_the_tensor_table_of_a_local_checkpoint_is_its_headers(ckpt, tmp_path):
    from safetensors import safe_open

    want = {}
    for path in sorted(ckpt.glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            for name in f.keys():
                want[name] = (f.get_slice(name).get_dtype(), tuple(f.get_slice(name).get_shape()))
    table = safetensors_table(ckpt)
    assert table == want
    assert safetensors_table("s3://bucket/model") is None
    assert safetensors_table(tmp_path / "missing") is None
    (tmp_path / "empty").mkdir()
    assert safetensors_table(tmp_path / "empty") is None
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "model.safetensors").write_bytes(b"\x04\x00\x00\x00\x00\x00\x00\x00{no}")
    with pytest.raises(CheckpointError, match="model.safetensors: not a safetensors header"):
        safetensors_table(bad)


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
    with pytest.raises(ConfigError, match=rf"tensor '{names[1]}' is twice in group 'a'"):
        load_groups(ckpt, {"a": [names[1], names[1]]})
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


def test_huggingface_through_a_daemon_warns_of_no_budget_it_was_not_given(tmp_path, daemon, caplog):
    """The in-process default budget is not passed through a daemon (whose own applies): no
    "budget= applies to in-process loads only" warning for an argument the caller never gave."""
    import logging
    import warnings

    from transformers import AutoModelForCausalLM

    llama = tiny_llama(tmp_path / "llama")
    d = daemon()
    with caplog.at_level(logging.WARNING, logger="streamer_client"), warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        model = from_pretrained(llama, stream_kwargs={"socket": d.socket})
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert len(d.finished(1)) == 1  # loaded through the daemon (filed once its thread ended)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9]])
    reference = AutoModelForCausalLM.from_pretrained(llama).eval()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)


def test_huggingface_keeps_generation_config_and_names_the_uri(tmp_path):
    llama = tiny_llama_for_engines(tmp_path / "llama")
    model = from_pretrained(llama)
    # transformers' state_dict= path would leave the defaults: top_k 50, no stop token from the file.
    assert model.generation_config.top_k == 7
    assert model.generation_config.eos_token_id == 2 and model.generation_config.do_sample is True
    assert model.name_or_path == str(llama) and model.config._name_or_path == str(llama)


def test_huggingface_device_map_goes_through_accelerate(tmp_path):
    from transformers import AutoModelForCausalLM

    llama = tiny_llama(tmp_path / "llama")
    ids = torch.tensor([[3, 1, 4, 1, 5, 9]])
    model = from_pretrained(llama, device_map={"": "cpu"})
    reference = AutoModelForCausalLM.from_pretrained(llama).eval()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)


def test_huggingface_device_map_without_accelerate_says_what_to_install(tmp_path):
    llama = tiny_llama(tmp_path / "llama")
    code = (
        "import sys; sys.modules['accelerate'] = None  # as if not installed\n"
        "from streamer_client.integrations.huggingface import from_pretrained\n"
        "try:\n"
        f"    from_pretrained({str(llama)!r}, device_map='auto')\n"
        "except Exception as e:\n"
        "    print(type(e).__name__, e)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == (
        f"ConfigError {llama}: device_map needs accelerate, which transformers uses to place the weights: "
        "pip install 'streamer-client[huggingface]' (or accelerate)"
    )


RSS_SCRIPT = """
import sys, torch, transformers
import streamer_client.integrations.huggingface, streamer_service.embedded.backend  # imports are not loading

def hwm():  # peak RSS of this process in KiB (ru_maxrss would start from the forking parent's)
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))

mode, path = sys.argv[1:]
before = hwm()
if mode == "transformers":
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
else:
    from streamer_client.integrations.huggingface import from_pretrained
    model = from_pretrained(path)
with torch.no_grad():  # every weight touched: transformers' mmap-ed pages count from here on
    model(torch.tensor([[1, 2, 3]]))
print(hwm() - before)
"""


def test_huggingface_peak_rss_within_one_and_a_half_times_transformers(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    # ~300 MB: large enough that the weights, not the interpreter, set the peak.
    config = LlamaConfig(
        hidden_size=768, intermediate_size=2048, num_hidden_layers=6, num_attention_heads=12,
        num_key_value_heads=12, vocab_size=32000, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "llama", max_shard_size="100MB")
    del config

    def peak_kib(mode: str) -> int:  # peak RSS growth in KiB
        result = subprocess.run(
            [sys.executable, "-c", RSS_SCRIPT, mode, str(tmp_path / "llama")], capture_output=True, text=True, timeout=240
        )
        assert result.returncode == 0, result.stderr[-3000:]
        return int(result.stdout.split()[-1])

    # What loading adds to the peak, above the interpreter with both libraries imported.
    theirs, ours = peak_kib("transformers"), peak_kib("streamer")
    assert ours <= 1.5 * theirs, f"peak RSS +{ours // 1024} MiB vs transformers' +{theirs // 1024} MiB"
