"""python/sglang/srt/model_loader/loader.py at 005cbe0ea796446e420b6aab62ce51a488f5e7c7: the loader
interface, get_model_loader/get_model, and the steps of DefaultModelLoader.load_model. The model is a
transformers Llama with SGLang's ``load_weights(weights)`` contract (an iterable of (name, tensor)),
standing in for sglang.srt.models.llama."""

from abc import ABC, abstractmethod

import torch
from torch import nn


class _Llama(nn.Module):
    def __init__(self, config):
        super().__init__()
        from transformers import LlamaForCausalLM

        self.inner = LlamaForCausalLM(config)
        self.loaded = []

    def forward(self, ids):
        return self.inner(ids).logits

    def load_weights(self, weights):
        params = dict(self.inner.named_parameters())
        for name, tensor in weights:
            params[name].data.copy_(tensor)
            self.loaded.append(name)


def _get_quantization_config(model_config, load_config):
    return None


def _initialize_model(model_config, load_config, quant_config=None):
    return _Llama(model_config.hf_config)


class BaseModelLoader(ABC):
    def __init__(self, load_config):
        self.load_config = load_config

    @abstractmethod
    def download_model(self, model_config) -> None:
        raise NotImplementedError

    @abstractmethod
    def load_model(self, *, model_config, device_config) -> nn.Module:
        raise NotImplementedError


class DefaultModelLoader(BaseModelLoader):
    @staticmethod
    def load_weights_and_postprocess(model, weights, target_device):
        model.load_weights(weights)
        for _, module in model.named_modules():
            quant_method = getattr(module, "quant_method", None)
            if quant_method is not None:
                quant_method.process_weights_after_loading(module)


def get_model_loader(load_config) -> BaseModelLoader:
    if isinstance(load_config.load_format, type):
        return load_config.load_format(load_config)
    raise ValueError(f"stand-in: only a loader class, got {load_config.load_format!r}")


def get_model(*, model_config, load_config, device_config) -> nn.Module:
    loader = get_model_loader(load_config)
    return loader.load_model(model_config=model_config, device_config=device_config)
