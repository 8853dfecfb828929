"""What a process imports. The daemon: no torch (0.8 s of start-up and ~240 MiB RSS); neither
does pulling metadata in-process (vLLM's and the CLI's first step). A rank's load, in-process or
through a daemon: nothing heavy (pydantic, the web stack, cloud SDKs), so that a fresh engine
process starts its first load without paying for them."""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from checkpoints import ground_truth, tensor_bytes

from streamer_client._deprecated import MOVED

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from import_time import DATACLASS_HOOK, HEAVY, OURS  # noqa: E402  (what a rank's load must not import; the benchmark reports it too)

BLOCK_TORCH = textwrap.dedent(
    """
    import importlib, importlib.abc, sys

    class NoTorch(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError(f"{name} imported by the daemon")

    sys.meta_path.insert(0, NoTorch())
    for module in sys.argv[1:]:
        importlib.import_module(module)
    from streamer_service.daemon.api import create_app
    from streamer_service.settings import Settings
    create_app(Settings())
    assert "torch" not in sys.modules
    print("ok")
    """
)


@pytest.mark.parametrize(
    "module",
    [
        "streamer_service.daemon.api",
        "streamer_service.daemon.core",
        "streamer_service.daemon.server",
        "streamer_client._connection",
    ],
)
def test_the_daemon_does_not_import_torch(module):
    result = subprocess.run([sys.executable, "-c", BLOCK_TORCH, module], capture_output=True, text=True, timeout=120)
    assert (result.returncode, result.stdout.strip()) == (0, "ok"), result.stderr[-3000:]


PULL_WITHOUT_TORCH = BLOCK_TORCH.split("for module in")[0] + textwrap.dedent(
    """
    import streamer_client
    path = streamer_client.pull_metadata(sys.argv[1], cache_dir=sys.argv[2])
    assert (path / "config.json").is_file() and "torch" not in sys.modules
    print("ok")
    """
)


def test_pulling_metadata_in_process_does_not_import_torch(sample, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "STREAMER_SOCKET"}
    env["STREAMER_SOCKET"] = str(tmp_path / "no-daemon.sock")  # none there: in-process
    result = subprocess.run(
        [sys.executable, "-c", PULL_WITHOUT_TORCH, str(sample), str(tmp_path / "cache")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (result.returncode, result.stdout.strip()) == (0, "ok"), result.stderr[-3000:]


# Imports after torch and numpy (what an engine process has) are watched: a heavy one is
# refused and recorded, so that one imported under ``try: ... except ImportError`` shows too.
LIGHT_LOAD = DATACLASS_HOOK + textwrap.dedent(  # the hook: our dataclasses the load builds
    """
    import gc, hashlib, importlib.abc, json, sys
    import torch, numpy
    HEAVY = tuple(json.loads(sys.argv[3]))
    attempted, runai = [], []

    class RefuseHeavy(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if any(name == h or name.startswith(h + ".") for h in HEAVY):
                attempted.append(name)
                raise ImportError(f"{name} imported by a rank's load")
            if name.split(".")[0].startswith("runai_model_streamer"):
                runai.append(name)  # recorded here: the wrapper's import takes its modules out of sys.modules again

    sys.meta_path.insert(0, RefuseHeavy())
    OURS = tuple(json.loads(sys.argv[4]))
    full = []
    gc.callbacks.append(lambda phase, info: phase == "start" and info["generation"] == 2 and full.append(1))
    import streamer_client
    state = streamer_client.load_state_dict(sys.argv[1], device=sys.argv[2])
    digests = {n: hashlib.sha256(t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
               for n, t in state.items()}
    loaded = sorted(m for m in sys.modules if any(m == h or m.startswith(h + ".") for h in HEAVY))
    devices = sorted({str(t.device) for t in state.values()})
    ours = sorted(m for m in sys.modules if m.split(".")[0] in OURS)
    print(json.dumps({"digests": digests, "attempted": attempted, "loaded": loaded, "devices": devices,
                      "service": "streamer_service" in sys.modules, "full_collections": len(full),
                      "ours": ours, "runai": runai,
                      "dataclasses": sorted(c for c, _ in built if c.split(".")[0] in OURS)}))
    """
)
DEVICES = ["cpu", pytest.param("cuda:0", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"))]


def _light_load(uri, device: str, env: dict[str, str]) -> dict:
    result = subprocess.run([sys.executable, "-c", LIGHT_LOAD, str(uri), device, json.dumps(HEAVY), json.dumps(OURS)], env=env,
                            capture_output=True, text=True, timeout=180)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def _digests(directory) -> dict[str, str]:
    return {name: hashlib.sha256(tensor_bytes(t)).hexdigest() for name, t in ground_truth(directory).items()}


@pytest.mark.parametrize("device", DEVICES)
def test_an_in_process_load_imports_nothing_heavy(sample, tmp_path, device):
    env = {k: v for k, v in os.environ.items() if k != "STREAMER_SOCKET"}  # none at the default socket: in-process
    got = _light_load(sample, device, env)
    assert (got["attempted"], got["loaded"]) == ([], [])
    assert got["service"] and got["devices"] == [device]
    assert got["digests"] == _digests(sample)
    # The collector is left running: the engine's first import no longer sets off a full
    # collection (which, in a process with torch, walks every object torch made).
    assert got["full_collections"] == 0
    # Each dataclass compiles its methods from source as its module is imported; the records a
    # load makes per tensor, batch and read are NamedTuples, which compile nothing of their own.
    assert got["dataclasses"] == IN_PROCESS_DATACLASSES
    assert [m for m in got["ours"] if m in OLD_NAMES] == []


# The old names of the client's internal modules (deprecated): a load imports the modules themselves.
OLD_NAMES = {f"streamer_client.{old}" for old in MOVED}

# The dataclasses a first load builds: those that check their fields on construction.
IN_PROCESS_DATACLASSES = [
    "streamer_client._request.StreamRequest",
    "streamer_service.embedded.engine.EngineConfig",
]


@pytest.mark.parametrize("device", DEVICES)
def test_a_load_through_the_daemon_imports_nothing_heavy_nor_the_service(daemon, sample, device):
    d = daemon()
    got = _light_load(sample, device, d.rank_env())
    assert (got["attempted"], got["loaded"]) == ([], [])
    assert not got["service"], "the rank fell back to loading in-process, or imported the service"
    assert got["dataclasses"] == ["streamer_client._request.StreamRequest"]
    assert [m for m in got["ours"] if m in OLD_NAMES] == []
    assert got["devices"] == [device]
    assert got["digests"] == _digests(sample)


# What a load of a local directory has no use for: our object-storage backends, the daemon's
# client, and on a restart (the metadata cache warm) the cache's pull lock. Each way of loading
# is imported by the loads it serves: Run:ai's reader into the engine's ring for a CPU load (it
# reads into memory handed to the caller, readers/choice.py); the files' mappings staged to the
# device for a CUDA load, which imports nothing of Run:ai's nor of the ring.
NOT_FOR_A_LOCAL_LOAD = (
    "streamer_service.storage.s3",
    "streamer_service.storage.gcs",
    "streamer_service.storage.azure",
    "streamer_service.daemon",
    "streamer_client._connection",
    "streamer_client._daemon",
    "streamer_client._protocol",
)
OTHER_PATH = {
    "cpu": ("streamer_service.readers.mapped", "streamer_service.embedded.staged"),
    "cuda:0": (
        "streamer_service.readers.runai.reader",
        "streamer_service.readers.runai.contract",
        "streamer_service.embedded.ring_load",
        "streamer_service.embedded.slots",
        "streamer_service.embedded.buffers",
        "streamer_service.load.ring",
    ),
}


def _among(module: str, names) -> bool:
    return any(module == n or module.startswith(n + ".") for n in names)


@pytest.mark.parametrize("device", DEVICES)
def test_a_local_load_imports_its_own_path_and_nothing_of_object_storage(sample, device):
    env = {k: v for k, v in os.environ.items() if k != "STREAMER_SOCKET"}  # none at the default socket: in-process
    first = _light_load(sample, device, env)  # pulls the metadata into the node cache
    restart = _light_load(sample, device, env)  # a new process, the cache warm
    for got in (first, restart):
        assert got["digests"] == _digests(sample)
        assert [m for m in got["ours"] if _among(m, NOT_FOR_A_LOCAL_LOAD + OTHER_PATH[device])] == []
        # Run:ai's object-store plugins never; its wrapper only where Run:ai reads (a CPU load).
        assert [n for n in got["runai"] if n.split(".")[0] != "runai_model_streamer"] == []
        assert bool(got["runai"]) == (device == "cpu")
    assert "streamer_service.metadata.lock" in first["ours"]
    assert "streamer_service.metadata.lock" not in restart["ours"]


def test_every_scheme_has_a_backend():
    from streamer_service.storage import BACKENDS, Storage
    from streamer_service.uri import Scheme

    assert set(BACKENDS) == set(Scheme)
    for scheme, where in BACKENDS.items():
        module, _, name = where.partition(":")
        backend = getattr(importlib.import_module(f"streamer_service.storage.{module}"), name)
        assert issubclass(backend, Storage), scheme
