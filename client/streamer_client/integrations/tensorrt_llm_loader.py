"""TensorRT-LLM (PyTorch backend) checkpoint format ``STREAMER``.

    import streamer_client.integrations.tensorrt_llm_loader  # registers "STREAMER"
    llm = LLM(model=str(streamer_client.pull_metadata(uri)), checkpoint_format="STREAMER")

Importing this module registers, with TensorRT-LLM's own decorators, a checkpoint loader and a
weight loader named ``STREAMER``. The model path is the pulled metadata dir (its marker names the
URI) or the URI itself. The checkpoint is a Hugging Face one read through
:func:`streamer_client.stream`, so the config loader and the weight mappers are TensorRT-LLM's HF
ones; only where the weights come from changes. Each rank selects what its ``mapping`` needs
(:func:`.tensorrt_llm.rank_groups`): with pipeline parallelism only the decoder layers of its
stage (``mapping.pp_layers``), with expert parallelism only the experts of its ``moe_ep_rank``,
plus the tensors outside the layers; with tensor parallelism whole tensors, which TensorRT-LLM's
modules narrow. Through the daemon the node's ranks share one session (agreed over
torch.distributed or MPI, whichever TensorRT-LLM runs), so the node reads the union of the ranks'
selections once.

TensorRT-LLM's ``load_weights(checkpoint_dir, mapping)`` returns the rank's weights as one mapping,
which its model loader then walks module by module: that call holds the rank's whole selection.
:meth:`StreamerWeightLoader.load_weights_in_groups` is the same selection in groups (a decoder
layer, or a module outside the layers), each handed to a load function as soon as it is complete
and dropped after it, so a rank holds one group plus the tensors of groups still arriving.

Written against TensorRT-LLM's ``tensorrt_llm/_torch/models/checkpoints/`` (``base_weight_loader.py``
at 0d93193e, ``base_checkpoint_loader.py`` at 03427565, ``hf/checkpoint_loader.py`` at 0d93193e,
``auto_mapper.py`` at 0b1d3205), ``tensorrt_llm/_torch/models/modeling_utils.py`` (the
``register_*`` decorators) and ``tensorrt_llm/mapping.py`` at b35ac1b6. TensorRT-LLM does not
install here (it needs CUDA): tests/test_engine_interfaces.py pins that interface.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Hashable
from typing import Any

from tensorrt_llm._torch.models.checkpoints.auto_mapper import AutoCheckpointMapper
from tensorrt_llm._torch.models.checkpoints.base_weight_loader import BaseWeightLoader
from tensorrt_llm._torch.models.checkpoints.hf.checkpoint_loader import HfCheckpointLoader
from tensorrt_llm._torch.models.checkpoints.hf.config_loader import HfConfigLoader
from tensorrt_llm._torch.models.modeling_utils import register_checkpoint_loader, register_checkpoint_weight_loader

from .. import load_state_dict, pull_metadata
from ..errors import ConfigError
from ._engine import LoaderOptions, NodeRanks, agree_on_node, config_value, source_uri, torch_all_gather, weight_names
from .tensorrt_llm import load_groups, rank_groups

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
        """The rank's selection in one dict, as TensorRT-LLM's model loader takes it."""
        weights: dict[str, Any] = {}
        for _, tensors in self._groups(checkpoint_dir, mapping, "load_weights"):
            weights.update(tensors)
        return weights

    def load_weights_in_groups(
        self, checkpoint_dir: str, mapping, load_group: Callable[[Hashable, dict[str, Any]], None]
    ) -> list[Hashable]:
        """``load_group(key, {name: tensor})`` for each group of the rank's selection, as soon as it
        is complete; the group is dropped when ``load_group`` returns (keep no reference to it to
        free it). Returns the group keys in the order they were loaded. Needs the checkpoint's
        ``model.safetensors.index.json`` (the group plan is made from its names)."""
        loaded = []
        for key, tensors in self._groups(checkpoint_dir, mapping, "load_weights_in_groups"):
            load_group(key, tensors)
            loaded.append(key)
            del tensors
        return loaded

    def _groups(self, checkpoint_dir: str, mapping, caller: str):
        uri = self.options.uri or source_uri(checkpoint_dir)
        metadata = pull_metadata(uri)
        plan = self.plan(metadata, mapping)
        ranks = self._ranks(uri)
        kwargs = {"rank": ranks.rank, "world_size": ranks.world_size, "session": ranks.session, **self.options.stream_kwargs()}
        if plan is None:
            if caller == "load_weights_in_groups":
                raise ConfigError(
                    f"{uri}: load_weights_in_groups plans groups from model.safetensors.index.json, which it lacks", uri=uri
                )
            return [(None, load_state_dict(uri, **kwargs))]
        return load_groups(uri, plan, **kwargs)

    def _ranks(self, uri: str) -> NodeRanks:
        gather, global_rank = _all_gather()
        return agree_on_node(gather, global_rank=global_rank, session=self.options.session, uri=uri)

    @staticmethod
    def plan(metadata_dir, mapping) -> dict[str, list[str]] | None:
        """This rank's groups (:func:`.tensorrt_llm.rank_groups`); None without an index: every tensor."""
        names = weight_names(metadata_dir)
        if names is None:
            return None
        layers = config_value(metadata_dir, "num_hidden_layers") if mapping.pp_size > 1 else None
        return rank_groups(names, mapping, layers)


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
