"""Streaming from Azure Blob (Azurite) through Run:ai's native reader, end to end.

Run:ai 0.17.0's Azure reader dials ``https://<account>.<AZURE_STORAGE_ENDPOINT_SUFFIX>`` and
trusts only the system CA bundle, so these tests run the code under test in a private mount
namespace where the bundle (and /etc/hosts) are bind-mounted copies that trust and resolve an
HTTPS Azurite; nothing outside that namespace changes. See ``tests/harness/azure_tls.py``.

Each load runs in a process of its own, as a rank would (Run:ai 0.17.0 keeps per-process state
per object store). Ground truth is computed here, outside, with safetensors.
"""

from __future__ import annotations

import json
import os
import socket
import ssl
import textwrap

import pytest
import torch
from checkpoints import INDEX_NAME, make_sharded_checkpoint, mixed_tensors
from harness.azure_tls import SYSTEM_CA_BUNDLE, host_state
from safetensors.torch import load_file

PREFIX = "models/tiny"

METADATA = {
    "config.json": b'{"architectures": ["TinyForCausalLM"], "auto_map": {"AutoModel": "modeling_tiny.TinyModel"}}\n',
    "generation_config.json": b'{"do_sample": false}\n',
    "tokenizer.json": b'{"version": "1.0", "model": {"type": "BPE"}}\n',
    "tokenizer/vocab.tiktoken": b"IQ== 0\nIg== 1\n",
    "modeling_tiny.py": b"class TinyModel:\n    pass\n",
}

# Runs inside the namespace. Prints one line "RESULT <json>".
SCRIPT = textwrap.dedent(
    r"""
    import json, os, sys, time
    import torch, streamer_client

    def err(e):
        return {"mro": [c.__name__ for c in type(e).__mro__], "message": str(e), "uri": getattr(e, "uri", None)}

    def dump(state):
        return {
            n: [str(t.dtype), list(t.shape), t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes().hex()]
            for n, t in state.items()
        }

    mode, uri = sys.argv[1], sys.argv[2]
    out = {}
    if mode == "load":
        t0 = time.monotonic()
        meta = streamer_client.pull_metadata(uri)
        t1 = time.monotonic()
        out["metadata"] = {p.relative_to(meta).as_posix(): p.read_bytes().hex() for p in meta.rglob("*") if p.is_file()}
        try:
            state = streamer_client.load_state_dict(uri, budget="256KiB")
        except Exception as e:
            out["error"] = err(e)
        else:
            out["tensors"] = dump(state)
        out["seconds"] = {"pull": t1 - t0, "load": time.monotonic() - t1}
    elif mode == "missing":
        shard_key, other_uri = sys.argv[3], sys.argv[4]
        streamer_client.load_state_dict(uri)  # metadata and catalog are now cached
        from azure.storage.blob import BlobServiceClient

        container = uri.split("/")[2]
        conn = os.environ["AZURE_STORAGE_CONNECTION_STRING"]
        BlobServiceClient.from_connection_string(conn).get_container_client(container).delete_blob(shard_key)
        for key, call in (
            ("deleted_shard", lambda: streamer_client.load_state_dict(uri)),
            ("no_container", lambda: streamer_client.pull_metadata(other_uri)),
        ):
            try:
                call()
                out[key] = None
            except Exception as e:
                out[key] = err(e)
    print("RESULT " + json.dumps(out))
    """
)


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A real 3-shard checkpoint (every dtype, a 0-d and an empty tensor, one tensor larger than
    the 256 KiB budget) with metadata files, and its ground truth."""
    src = tmp_path_factory.mktemp("azure-ckpt")
    tensors = mixed_tensors(seed=11)
    tensors["big.weight"] = torch.randn(512, 512, generator=torch.Generator().manual_seed(3))  # 1 MiB
    tensors["lm_head.weight"] = torch.randn(64, 96).to(torch.bfloat16)
    make_sharded_checkpoint(src, tensors, n_shards=3)
    for rel, data in METADATA.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(data)
    truth: dict[str, torch.Tensor] = {}
    for shard in set(json.loads((src / INDEX_NAME).read_text())["weight_map"].values()):
        truth.update(load_file(src / shard))
    files = {p.relative_to(src).as_posix(): p.read_bytes() for p in src.rglob("*") if p.is_file()}
    return files, truth


def _upload(backend, files) -> str:
    backend.put_tree(PREFIX, files)
    return backend.uri(PREFIX)


def _result(proc) -> dict:
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"rc={proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1][len("RESULT ") :])


def _assert_byte_exact(got: dict, truth: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(truth)
    for name, t in truth.items():
        dtype, shape, data = got[name]
        assert (dtype, shape) == (str(t.dtype), list(t.shape)), name
        assert bytes.fromhex(data) == _bytes(t), name


def _env_without(backend, *names: str, **extra: str) -> dict[str, str]:
    env = {**os.environ, **backend.env, **extra}
    for n in names:
        env.pop(n, None)
    return env


# --------------------------------------------------------------------------- tests


def test_azure_load_state_dict_is_byte_exact_and_metadata_pulls(azure_tls, checkpoint):
    files, truth = checkpoint
    uri = _upload(azure_tls, files)
    assert uri.startswith("az://")

    out = _result(azure_tls.python(SCRIPT, "load", uri, timeout=120))

    assert "error" not in out, out.get("error")
    _assert_byte_exact(out["tensors"], truth)
    # Metadata: everything but weights, byte for byte, with the completion marker.
    pulled = {k: bytes.fromhex(v) for k, v in out["metadata"].items()}
    expected = {k: v for k, v in files.items() if not k.endswith(".safetensors")}
    assert {k: v for k, v in pulled.items() if not k.startswith(".")} == expected
    assert ".runai_complete" in pulled
    assert host_state() == azure_tls.service.host_state_before


def test_azure_missing_object_is_a_storage_error_naming_the_uri(azure_tls, checkpoint):
    files, _ = checkpoint
    uri = _upload(azure_tls, files)
    shard = json.loads(files[INDEX_NAME])["weight_map"]["big.weight"]
    shard_key = f"{PREFIX}/{shard}"
    other = f"az://{azure_tls.bucket}-gone/{PREFIX}"

    out = _result(azure_tls.python(SCRIPT, "missing", uri, shard_key, other, timeout=120))

    # The shard vanished after its header was read: Run:ai's range read finds no object.
    deleted = out["deleted_shard"]
    assert deleted is not None, "loading a checkpoint whose shard was deleted succeeded"
    # Run:ai says only "file access error"; one HEAD through the SDK says the object is gone.
    assert deleted["mro"][:2] == ["ObjectNotFoundError", "StorageError"], deleted
    assert deleted["message"].startswith(f"object {shard_key!r} of {uri} does not exist"), deleted
    assert deleted["uri"] == uri, deleted
    # No such container: the service's own listing says so.
    gone = out["no_container"]
    assert gone is not None and "StorageError" in gone["mro"], gone
    assert other in gone["message"], gone


def test_tensor_bytes_come_through_runai_which_trusts_only_the_system_bundle(azure_tls, checkpoint):
    """Control: without the bind-mounted bundle, and with every CA variable pointing at the test
    CA, the SDK-based metadata pull works but Run:ai's reads fail. So the byte-exact test above
    really read through Run:ai, and the namespace trick is what makes that work."""
    files, _ = checkpoint
    uri = _upload(azure_tls, files)
    ca = str(azure_tls.service.pki.ca_cert)
    env = _env_without(azure_tls, REQUESTS_CA_BUNDLE=ca, SSL_CERT_FILE=ca, CURL_CA_BUNDLE=ca)

    out = _result(azure_tls.python(SCRIPT, "load", uri, env=env, trust=False, timeout=120))

    assert {k for k in out["metadata"] if not k.startswith(".")} == {k for k in files if not k.endswith(".safetensors")}
    error = out.get("error")
    assert error is not None, "Run:ai read over TLS without the test CA in the system bundle"
    assert "StorageError" in error["mro"] and "Run:ai" in error["message"], error


def test_the_namespace_leaves_the_machine_unchanged(azure_tls_service):
    """Outside the namespace: same CA bundle and hosts file, no new mounts, and the system
    bundle does not trust the test server."""
    assert host_state() == azure_tls_service.host_state_before
    ctx = ssl.create_default_context(cafile=str(SYSTEM_CA_BUNDLE) if SYSTEM_CA_BUNDLE.exists() else None)
    with socket.create_connection(("127.0.0.1", azure_tls_service.port), timeout=10) as raw:
        with pytest.raises(ssl.SSLCertVerificationError):
            ctx.wrap_socket(raw, server_hostname=azure_tls_service.host)


# ----------------------------------------------------- the two ways to configure an account


# The service's listing and Run:ai must agree on the endpoint given only the account variables,
# and a connection string alone (which Run:ai ignores) is refused before any read.
def test_azure_account_key_without_connection_string(azure_tls, checkpoint):
    files, truth = checkpoint
    uri = _upload(azure_tls, files)
    # No SDK retries: while the gap is open the listing dials a name that does not resolve.
    env = _env_without(azure_tls, "AZURE_STORAGE_CONNECTION_STRING", STREAMER_STORAGE_RETRIES="0")

    out = _result(azure_tls.python(SCRIPT, "load", uri, env=env, timeout=120))

    assert "error" not in out, out.get("error")
    _assert_byte_exact(out["tensors"], truth)


def test_azure_connection_string_only_loads_or_is_refused_up_front(azure_tls, checkpoint):
    files, truth = checkpoint
    uri = _upload(azure_tls, files)
    env = _env_without(azure_tls, "AZURE_STORAGE_ACCOUNT_NAME", "AZURE_STORAGE_ACCOUNT_KEY", "AZURE_STORAGE_ENDPOINT_SUFFIX")

    out = _result(azure_tls.python(SCRIPT, "load", uri, env=env, timeout=120))

    error = out.get("error")
    if error is not None:
        assert "ConfigError" in error["mro"] and "AZURE_STORAGE_ACCOUNT_NAME" in error["message"], error
    else:
        _assert_byte_exact(out["tensors"], truth)
