"""A daemon's loads after idle spells: one fresh rank process per load, CPU tensors, a local dir.

    python scripts/probes/ring_probe.py [--size-mb 4096] [--loads 4] [--pause 3] [--idle 1] [--budget 8GiB]

Run from the root of the checkout to measure (the daemon and the ranks import the
``streamer_service`` and ``streamer_client`` of the working directory, ahead of any installed
one). Writes a sample checkpoint (``streamer_service.sample``) into ``--work`` once, starts a daemon
with ``STREAMER_SEGMENT_IDLE_S=--idle``, then loads the checkpoint ``--loads`` times, each in a
fresh process, with ``--pause`` seconds between loads: longer than ``--idle``, so that what a
load's ring grew past the standing ring is trimmed before the next load, as on a node where loads
come minutes apart. Prints each load's time at the rank and the daemon's line for it (``getting
buffers``: the time its loading thread spent getting segments; ``a ring of N slots``).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RANK = """
import sys, time
t = time.monotonic()
import streamer_client
n = sum(v.numel() * v.element_size() for v in streamer_client.load_state_dict(sys.argv[1]).values())
print(f"{time.monotonic() - t:.3f} {n}")
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=int, default=4096)
    parser.add_argument("--loads", type=int, default=4)
    parser.add_argument("--pause", type=float, default=3.0)
    parser.add_argument("--idle", type=float, default=1.0)
    parser.add_argument("--budget", default="8GiB")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "ring-probe")
    args = parser.parse_args()
    here = Path.cwd()
    sys.path[:0] = [str(here / "client"), str(here)]
    from streamer_service.daemon.server import ChildDaemon
    from streamer_service.sample import build_sample

    checkpoint = args.work / f"checkpoint-{args.size_mb}"
    if not (checkpoint / ".complete").exists():
        checkpoint.mkdir(parents=True, exist_ok=True)
        build_sample(checkpoint, args.size_mb)
        (checkpoint / ".complete").write_text("ok\n")
    root = Path(tempfile.mkdtemp(prefix="daemon-", dir=args.work))
    env = {"STREAMER_SEGMENT_IDLE_S": str(args.idle), "STREAMER_CACHE_DIR": str(root / "cache")}
    env["PYTHONPATH"] = os.pathsep.join([str(here / "client"), str(here), os.environ.get("PYTHONPATH", "")])
    daemon = ChildDaemon(root, args.budget, env=env)
    try:
        for i in range(args.loads):
            time.sleep(args.pause)
            out = subprocess.run(
                [sys.executable, "-c", RANK, str(checkpoint)], env={**os.environ, **env, **daemon.env()},
                capture_output=True, text=True, check=True,
            )  # fmt: skip
            seconds, nbytes = out.stdout.split()
            lines = re.findall(r"in [0-9.]+ s; .*", daemon.log.read_text())
            line = re.sub(r"first submission.*first bytes", "first bytes", lines[-1]) if lines else "(no line)"
            print(f"load {i + 1}: {float(seconds):.3f} s at the rank, {int(nbytes) / 1e9:.2f} GB; daemon: {line}", flush=True)
    finally:
        daemon.close()


if __name__ == "__main__":
    main()
