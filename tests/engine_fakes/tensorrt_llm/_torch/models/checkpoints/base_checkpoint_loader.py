"""tensorrt_llm/_torch/models/checkpoints/base_checkpoint_loader.py at 03427565a3a93da4ad9e5485e356951c5cf590ab."""

from abc import ABC, abstractmethod

from tensorrt_llm._torch.models.checkpoints.auto_mapper import AutoCheckpointMapper
from tensorrt_llm._torch.models.modeling_utils import CHECKPOINT_LOADER_FORMAT_DEFAULT_MAPPING


class BaseCheckpointLoader(ABC):
    @abstractmethod
    def get_default_weight_loader(self): ...

    @abstractmethod
    def get_default_config_loader(self): ...

    @abstractmethod
    def cleanup(self) -> None: ...

    def load_config(self, checkpoint_dir: str, **kwargs):
        return self.config_loader.load(checkpoint_dir, **kwargs)

    def load_weights(self, checkpoint_dir: str, mapping, **kwargs):
        return self.weight_loader.load_weights(checkpoint_dir, mapping=mapping, **kwargs)

    @classmethod
    def get(cls, checkpoint_format: str, **kwargs):
        try:
            return CHECKPOINT_LOADER_FORMAT_DEFAULT_MAPPING[checkpoint_format](**kwargs)
        except KeyError:
            raise ValueError(f"Checkpoint loader for format {checkpoint_format} not found") from None

    def get_initialized_weight_mapper(self, model, config):
        if self.weight_mapper is not None:
            self.weight_mapper.init_model_and_config(model, config)
            return self.weight_mapper
        weight_mapper = AutoCheckpointMapper.get(self.checkpoint_format, config.pretrained_config.architectures[0])
        weight_mapper.init_model_and_config(model, config)
        self.weight_mapper = weight_mapper
        return weight_mapper
