"""TensorRT-LLM (PyTorch backend) checkpoint format ``STREAMER``.

    import streamer_client.integrations.tensorrt_llm_loader  # registers "STREAMER"
    llm = LLM(model=str(streamer_client.pull_metadata(uri)), checkpoint_format="STREAMER")

Importing this module registers, with TensorRT-LLM's own decorators, a checkpoint loader and a
weight loader named ``STREAMER``. The model path is the pulled metadata dir (its marker names the
URI) or the URI itself. The checkpoint is a Hugging Face one read through
:func:`streamer_client.stream`, so the config loader and the weight mappers are TensorRT-LLM's HF
ones; only where the weights come from changes. Each rank's ``load_weights(checkpoint_dir,
mapping)`` selects what its ``mapping`` needs: with pipeline parallelism only the decoder layers of
its stage (``mapping.pp_layers``), plus the tensors outside the layers; with tensor parallelism the
whole checkpoint, which TensorRT-LLM's modules narrow. Through the daemon the node's ranks share
one session (agreed over torch.distributed or MPI, whichever TensorRT-LLM runs), so the node reads
the union of the ranks' selections once.

Written against TensorRT-LLM's ``tensorrt_llm/_torch/models/checkpoints/`` (``base_weight_loader.py``
at 0d93193e, ``base_checkpoint_loader.py`` at 03427565, ``hf/checkpoint_loader.py`` at 0d93193e,
``auto_mapper.py`` at 0b1d3205), ``tensorrt_llm/_torch/models/modeling_utils.py`` (the
``register_*`` decorators) and ``tensorrt_llm/mapping.py`` at b35ac1b6. TensorRT-LLM does not
install here (it needs CUDA): tests/test_engine_interfaces.py pins that interface.
"""

from __future__ import annotations

import os
from typing import Any

from tensorrt_llm._torch.models.checkpoints.auto_mapper import AutoCheckpointMapper
from tensorrt_llm._torch.models.checkpoints.base_weight_loader import BaseWeightLoader
from tensorrt_llm._torch.models.checkpoints.hf.checkpoint_loader import HfCheckpointLoader
from tensorrt_llm._torch.models.checkpoints.hf.config_loader import HfConfigLoader
from tensorrt_llm._torch.models.modeling_utils import register_checkpoint_loader, register_checkpoint_weight_loader

from .. import load_state_dict, pull_metadata
from ._engine import LoaderOptions, agree_on_node, config_value, select_names, source_uri, torch_all_gather, weight_names

__all__ = ["CHECKPOINT_FORMAT", "StreamerCheckpointLoader", "StreamerConfigLoader", "StreamerWeightLoader"]

CHECKPOINT_FORMAT = "STREAMER"


def _metadata_dir(checkpoint_dir: str) -> str:
    uri = source_uri(checkpoint_dir)
    return str(pull_metadata(uri)) if uri != os.fspath(checkpoint_dir) else os.fspath(checkpoint_dir)


def _all_gather():
    """The collective TensorRT-LLM's ranks share: torch.distributed if it runs, else MPI."""
    gather, rank = torch_all_gather()
    if gather is not None:
        return gather, rank
    try:
        from mpi4py import MPI
    except ImportError:
        return None, 0
    comm = MPI.COMM_WORLD
    return (comm.allgather, comm.Get_rank()) if comm.Get_size() > 1 else (None, 0)


class StreamerConfigLoader(HfConfigLoader):
    """TensorRT-LLM's HF config loader on the pulled metadata dir."""

    def load(self, checkpoint_dir: str, **kwargs):
        return super().load(_metadata_dir(checkpoint_dir), **kwargs)


@register_checkpoint_weight_loader(CHECKPOINT_FORMAT)
class StreamerWeightLoader(BaseWeightLoader):
    """``load_weights(checkpoint_dir, mapping) -> {name: tensor}``: what this rank's mapping needs."""

    def __init__(self, **options: Any) -> None:
        self.options = LoaderOptions.parse(options, where="StreamerWeightLoader")

    def load_weights(self, checkpoint_dir: str, mapping, **kwargs) -> dict[str, Any]:
        uri = self.options.uri or source_uri(checkpoint_dir)
        metadata = pull_metadata(uri)
        gather, global_rank = _all_gather()
        ranks = agree_on_node(gather, global_rank=global_rank, session=self.options.session, uri=uri)
        return load_state_dict(
            uri, select=self.selection(metadata, mapping), rank=ranks.rank, world_size=ranks.world_size,
            session=ranks.session, **self.options.stream_kwargs(),
        )  # fmt: skip

    @staticmethod
    def selection(metadata_dir, mapping) -> list[str] | None:
        """This pipeline stage's layers and everything outside the layers; None: every tensor."""
        names = weight_names(metadata_dir)
        if names is None or mapping.pp_size == 1:
            return None
        stage = set(mapping.pp_layers(config_value(metadata_dir, "num_hidden_layers")))
        return select_names(names, keep_layer=stage.__contains__)


@register_checkpoint_loader(CHECKPOINT_FORMAT)
class StreamerCheckpointLoader(HfCheckpointLoader):
    """HF's checkpoint loader with the weights streamed and the config from the pulled dir."""

    def __init__(self, *, weight_loader=None, weight_mapper=None, config_loader=None) -> None:
        super().__init__(weight_loader=weight_loader, weight_mapper=weight_mapper, config_loader=config_loader)
        self._checkpoint_format = CHECKPOINT_FORMAT

    def get_default_weight_loader(self) -> StreamerWeightLoader:
        return StreamerWeightLoader()

    def get_default_config_loader(self) -> StreamerConfigLoader:
        return StreamerConfigLoader()

    def get_initialized_weight_mapper(self, model, config):
        """The architecture's HF mapper: the tensors are those of the HF checkpoint."""
        if self.weight_mapper is None:
            architectures = getattr(config.pretrained_config, "architectures", None) or []
            if not architectures:
                raise ValueError("Cannot determine model architecture from config")
            self.weight_mapper = AutoCheckpointMapper.get("HF", architectures[0])
        self.weight_mapper.init_model_and_config(model, config)
        return self.weight_mapper
