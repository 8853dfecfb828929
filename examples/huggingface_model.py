"""Hugging Face transformers: the model from the pulled config, its weights streamed.

    python examples/huggingface_model.py [URI] [--out FILE]

``from_pretrained`` pulls config (and tokenizer, remote code) into the node cache, streams the
weights through the daemon when ``STREAMER_SOCKET`` names one (else in-process) and builds the
model with transformers' own ``from_pretrained(state_dict=...)``. It then runs one forward pass
on fixed token ids and prints the next-token prediction. Without URI a tiny Llama checkpoint is
written to a temp dir. ``--out`` saves the logits (``torch.save``).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

from streamer_client.integrations.huggingface import from_pretrained

TOKENS = [[1, 5, 9, 17, 33, 65]]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("uri", nargs="?", help="checkpoint: s3://, gs://, az:// or a local dir (default: a tiny sample)")
    parser.add_argument("--out", help="save the logits of the forward pass here (torch.save)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        uri = args.uri
        if uri is None:
            from _sample import tiny_llama

            uri = str(tiny_llama(Path(tmp) / "tiny-llama"))
        model = from_pretrained(uri)
        with torch.no_grad():
            logits = model(torch.tensor(TOKENS)).logits
        if args.out:
            torch.save(logits, args.out)
        print(f"{type(model).__name__}: {sum(p.numel() for p in model.parameters())} parameters; "
              f"next token after {TOKENS[0]}: {int(logits[0, -1].argmax())}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
