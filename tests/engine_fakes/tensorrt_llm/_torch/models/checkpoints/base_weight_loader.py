"""tensorrt_llm/_torch/models/checkpoints/base_weight_loader.py at 0d93193ee668a2bb6daf5fb231039233a63e60a3."""

from abc import ABC, abstractmethod


class BaseWeightLoader(ABC):
    @abstractmethod
    def load_weights(self, checkpoint_dir: str, mapping, **kwargs):
        """A dict of tensor name -> tensor."""

    def cleanup(self) -> None:
        pass
