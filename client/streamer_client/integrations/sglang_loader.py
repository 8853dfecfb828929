"""SGLang loader class: ``sglang.Engine(load_format=StreamerModelLoader, ...)`` (see :mod:`.sglang`).

Written against sgl-project/sglang ``python/sglang/srt/model_loader/loader.py`` at 005cbe0e:
``BaseModelLoader.__init__(load_config)``, ``download_model(model_config)``,
``load_model(*, model_config, device_config)``, and ``DefaultModelLoader.load_model``'s steps
(``_get_quantization_config``, ``_initialize_model`` under ``set_default_torch_dtype`` and the
target device, ``load_weights_and_postprocess``), which this follows with the weights from
:func:`.weights.weights_iterator`. SGLang's tensor-parallel ranks each narrow full tensors, so every
rank streams every tensor; through the daemon the node reads each byte once. Ranks and one session
key come from SGLang's world group (``sglang.srt.distributed``). SGLang is not installed here
(its kernels need CUDA): tests/test_engine_interfaces.py pins that interface.
"""

from __future__ import annotations

import json

import torch
from sglang.srt.model_loader.loader import (
    BaseModelLoader,
    DefaultModelLoader,
    _get_quantization_config,
    _initialize_model,
)
from sglang.srt.model_loader.utils import set_default_torch_dtype

from .. import pull_metadata
from ._engine import LoaderOptions, agree_on_node, source_uri, torch_all_gather
from .weights import weights_iterator

__all__ = ["StreamerModelLoader"]


class StreamerModelLoader(BaseModelLoader):
    def __init__(self, load_config):
        super().__init__(load_config)
        extra = load_config.model_loader_extra_config
        self.options = LoaderOptions.parse(json.loads(extra) if isinstance(extra, str) else extra, where="StreamerModelLoader")

    def checkpoint_uri(self, model_config) -> str:
        return self.options.uri or source_uri(model_config.model_path)

    def download_model(self, model_config) -> None:
        pull_metadata(self.checkpoint_uri(model_config))

    def load_model(self, *, model_config, device_config):
        uri = self.checkpoint_uri(model_config)
        gather, global_rank = torch_all_gather()
        ranks = agree_on_node(gather, global_rank=global_rank, session=self.options.session, uri=uri)
        target_device = torch.device(device_config.device)
        quant_config = _get_quantization_config(model_config, self.load_config)
        with set_default_torch_dtype(model_config.dtype):
            with target_device:
                model = _initialize_model(model_config, self.load_config, quant_config)
            weights = weights_iterator(
                uri, rank=ranks.rank, world_size=ranks.world_size, session=ranks.session, **self.options.stream_kwargs()
            )
            DefaultModelLoader.load_weights_and_postprocess(model, weights, target_device)
        return model.eval()
