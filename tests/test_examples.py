"""The runnable examples (one per adapter), run as users run them: a subprocess each.

Embedded and through a real daemon; on local files and on S3 (moto). Every tensor an example
loaded is compared with safetensors' ground truth; the Hugging Face example's logits with a model
that transformers loaded itself.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from checkpoints import ground_truth
from daemon_harness import DaemonProcess
from safetensors.torch import load_file

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
sys.path.insert(0, str(EXAMPLES))

from _sample import tiny_llama  # noqa: E402
from tensorrt_llm_groups import rank_plan  # noqa: E402
from vllm_load_weights import TensorParallelLM  # noqa: E402


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("tiny") / "llama")


def run_example(script: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.Popen(
        [sys.executable, str(EXAMPLES / script), *args],
        env={**os.environ, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def finished(proc: subprocess.Popen) -> str:
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-3000:]
    return out


def _scrape(d: DaemonProcess) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    with d.client() as c:
        text = c.get("/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(text) for s in f.samples}


def test_vllm_example_two_ranks_through_a_daemon_read_each_byte_once(llama, tmp_path):
    truth = ground_truth(llama)
    total = sum(t.numel() * t.element_size() for t in truth.values())
    d = DaemonProcess(tmp_path, {}).start()
    try:
        env = d.rank_env(STREAMER_LAUNCH_ID="vllm-example")
        ranks = [
            run_example(
                "vllm_load_weights.py",
                str(llama),
                "--rank",
                str(r),
                "--world-size",
                "2",
                "--out",
                str(tmp_path / f"r{r}.st"),
                env=env,
            )
            for r in range(2)
        ]
        outs = [finished(p) for p in ranks]
        stats, metrics = d.stats(), _scrape(d)
    finally:
        d.stop()
    assert outs == [f"rank {r}/2: loaded {len(truth)} tensors into the model\n" for r in range(2)]
    for r in range(2):
        loaded = load_file(tmp_path / f"r{r}.st")
        assert loaded.keys() == truth.keys()
        for name, want in truth.items():
            dim = TensorParallelLM.shard_dim(name)
            if dim is not None:
                want = want.chunk(2, dim)[r]
            assert torch.equal(loaded[name], want), name
    # Two ranks, every tensor each: the node read each byte once.
    assert stats["bytes_read"] == total
    assert metrics[("streamer_storage_read_bytes_total", (("scheme", "file"),))] == total
    assert metrics[("streamer_rank_delivered_bytes_total", (("rank", "0"),))] == total
    assert metrics[("streamer_rank_delivered_bytes_total", (("rank", "1"),))] == total
    seconds = metrics[("streamer_storage_read_seconds_total", (("scheme", "file"),))]
    rate = metrics[("streamer_last_session_read_bytes_per_second", (("scheme", "file"),))]
    assert seconds > 0 and rate == pytest.approx(total / seconds)
    assert list(d.shm_dir.iterdir()) == []


@pytest.mark.parametrize("backend", ["s3"], indirect=True)
def test_tensorrt_llm_example_last_stage_on_s3(backend, llama, tmp_path):
    backend.put_tree("llama", {p.name: p.read_bytes() for p in llama.iterdir()})
    out = tmp_path / "stage1.st"
    stdout = finished(
        run_example("tensorrt_llm_groups.py", backend.uri("llama"), "--rank", "1", "--world-size", "2", "--out", str(out))
    )
    truth = ground_truth(llama)
    plan = rank_plan(sorted(truth), 2, rank=1, world_size=2)
    assert set(plan) == {"layer.1", "head"}
    ready = [line.split(" ready")[0].removeprefix("rank 1: ") for line in stdout.splitlines() if " ready " in line]
    assert sorted(ready) == sorted(plan)  # each group once, when complete
    loaded = load_file(out)
    assert sorted(loaded) == sorted(n for names in plan.values() for n in names)
    for name, tensor in loaded.items():
        assert torch.equal(tensor, truth[name]), name


def test_huggingface_example_matches_transformers_own_loading(llama, tmp_path):
    from huggingface_model import TOKENS
    from transformers import AutoModelForCausalLM

    out = tmp_path / "logits.pt"
    stdout = finished(run_example("huggingface_model.py", str(llama), "--out", str(out)))
    reference = AutoModelForCausalLM.from_pretrained(llama).eval()
    with torch.no_grad():
        want = reference(torch.tensor(TOKENS)).logits
    assert torch.equal(torch.load(out), want)
    assert stdout.startswith("LlamaForCausalLM: ")
    assert f"next token after {TOKENS[0]}: {int(want[0, -1].argmax())}" in stdout


def test_my_loader_under_torchrun_two_ranks_through_a_daemon_read_each_byte_once(llama, tmp_path):
    """docs/quickstart.md's rank script, under torchrun as it is run there: LOCAL_RANK and
    LOCAL_WORLD_SIZE are the ranks, TORCHELASTIC_RUN_ID joins them into one session."""
    truth = ground_truth(llama)
    select = ["model.layers.0.", "lm_head.weight"]
    chosen = {n: t for n, t in truth.items() if n.startswith(select[0]) or n == select[1]}
    d = DaemonProcess(tmp_path, {}).start()
    try:
        env = {k: v for k, v in d.rank_env().items() if k not in ("STREAMER_LAUNCH_ID", "TORCHELASTIC_RUN_ID")}
        torchrun = Path(sys.executable).with_name("torchrun")
        proc = subprocess.Popen(
            [str(torchrun), "--standalone", "--nproc-per-node", "2", str(EXAMPLES / "my_loader.py"), str(llama),
             "--select", *select, "--out", str(tmp_path)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        out = finished(proc)
        stats = d.stats()
    finally:
        d.stop()
    nbytes = sum(t.numel() * t.element_size() for t in chosen.values())
    assert sorted(out.splitlines()) == [f"rank {r}/2: {len(chosen)} tensors, {nbytes} bytes" for r in range(2)]
    for r in range(2):
        loaded = load_file(tmp_path / f"rank{r}.safetensors")
        assert loaded.keys() == chosen.keys()
        for name, want in chosen.items():
            assert loaded[name].dtype == want.dtype and torch.equal(loaded[name], want), name
    # One session for both ranks (torchrun's run id): the node read the selection once.
    assert len(stats["finished"]) == 1
    assert stats["bytes_read"] == nbytes


def test_my_loader_without_a_daemon_loads_in_process(llama, tmp_path):
    env = {"STREAMER_SOCKET": str(tmp_path / "none.sock"), "STREAMER_CACHE_DIR": str(tmp_path / "cache")}
    out = finished(run_example("my_loader.py", str(llama), "--out", str(tmp_path), env=env))
    truth = ground_truth(llama)
    assert out == f"rank 0/1: {len(truth)} tensors, {sum(t.numel() * t.element_size() for t in truth.values())} bytes\n"
    loaded = load_file(tmp_path / "rank0.safetensors")
    assert loaded.keys() == truth.keys()
    for name, want in truth.items():
        assert torch.equal(loaded[name], want), name
