"""One rank of a torchrun launch: this rank's tensors, streamed through the node daemon.

    torchrun --nproc-per-node 4 examples/my_loader.py [URI] [--select PREFIX ...] [--out DIR]

Each process is one rank: ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` (torchrun sets both) are its
``rank`` and ``world_size``, and torchrun's ``TORCHELASTIC_RUN_ID`` is the launch id, so the ranks
of one launch join one session. With ``STREAMER_SOCKET`` set (a running ``streamer-service
serve``) the node reads each byte once, whatever the ranks share; without a daemon each process
reads its own selection. ``--select`` takes tensor names or name prefixes (default: every
tensor); ``--out DIR`` saves this rank's tensors to ``DIR/rank<R>.safetensors``. Without URI a
tiny Llama checkpoint is written to a temp dir (one per process: use a URI with several ranks).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import streamer_client


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("uri", nargs="?", help="checkpoint: s3://, gs://, az:// or a local dir (default: a tiny sample)")
    parser.add_argument("--select", nargs="+", help="tensor names or name prefixes (default: every tensor)")
    parser.add_argument("--out", help="save this rank's tensors to DIR/rank<R>.safetensors")
    args = parser.parse_args()
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    with tempfile.TemporaryDirectory() as tmp:
        uri = args.uri
        if uri is None:
            from _sample import tiny_llama

            uri = str(tiny_llama(Path(tmp) / "tiny-llama"))
        state = {}
        for name, tensor in streamer_client.stream(uri, select=args.select, rank=rank, world_size=world_size):
            state[name] = tensor  # a model would copy it into its parameter here
        if args.out:
            from safetensors.torch import save_file

            save_file({k: v.contiguous() for k, v in state.items()}, str(Path(args.out) / f"rank{rank}.safetensors"))
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        # One write: the ranks share torchrun's stdout, and an unbuffered print writes the newline apart.
        sys.stdout.write(f"rank {rank}/{world_size}: {len(state)} tensors, {nbytes} bytes\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
