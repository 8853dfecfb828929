"""tensorrt_llm/_torch/models/checkpoints/auto_mapper.py at 0b1d32058ae8e00616dd25cc97571a5fe962ca35, and the
HF mappers it finds (hf/weight_mapper.py registers the "HF" default)."""

from tensorrt_llm._torch.models.modeling_utils import MODEL_CLASS_MAPPER_MAPPING, register_mapper


class AutoCheckpointMapper:
    @staticmethod
    def get(format, name=None):
        if name is not None:
            try:
                return MODEL_CLASS_MAPPER_MAPPING[f"{name}_{format}"]()
            except KeyError:
                return MODEL_CLASS_MAPPER_MAPPING[format]()
        return MODEL_CLASS_MAPPER_MAPPING[format]()


@register_mapper("HF")
class HfWeightMapper:
    def init_model_and_config(self, model, config):
        self.model, self.config = model, config
