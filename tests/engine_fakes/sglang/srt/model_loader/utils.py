"""python/sglang/srt/model_loader/utils.py: set_default_torch_dtype."""

import contextlib

import torch


@contextlib.contextmanager
def set_default_torch_dtype(dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)
