"""tensorrt_llm/_torch/models/checkpoints/hf/checkpoint_loader.py at 0d93193ee668a2bb6daf5fb231039233a63e60a3."""

from tensorrt_llm._torch.models.checkpoints.base_checkpoint_loader import BaseCheckpointLoader
from tensorrt_llm._torch.models.checkpoints.hf.config_loader import HfConfigLoader
from tensorrt_llm._torch.models.modeling_utils import register_checkpoint_loader


class HfWeightLoader:
    def load_weights(self, checkpoint_dir, mapping, **kwargs):
        raise AssertionError("the built-in HF weight loader reads local files; STREAMER must not reach it")


@register_checkpoint_loader("HF")
class HfCheckpointLoader(BaseCheckpointLoader):
    def __init__(self, *, weight_loader=None, weight_mapper=None, config_loader=None):
        self._weight_loader = self.get_default_weight_loader() if weight_loader is None else weight_loader
        self._config_loader = self.get_default_config_loader() if config_loader is None else config_loader
        self._weight_mapper = weight_mapper
        self._checkpoint_format = "HF"

    def cleanup(self) -> None:
        self._weight_mapper = self._weight_loader = self._config_loader = None

    def get_default_weight_loader(self):
        return HfWeightLoader()

    def get_default_config_loader(self):
        return HfConfigLoader()

    @property
    def weight_loader(self):
        return self._weight_loader

    @property
    def weight_mapper(self):
        return self._weight_mapper

    @weight_mapper.setter
    def weight_mapper(self, value):
        self._weight_mapper = value

    @property
    def config_loader(self):
        return self._config_loader

    @property
    def checkpoint_format(self):
        return self._checkpoint_format
