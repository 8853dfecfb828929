"""tensorrt_llm/_torch/models/modeling_utils.py (the registries and their decorators, as upstream)."""

MODEL_CLASS_MAPPER_MAPPING = {}
MODEL_CLASS_CHECKPOINT_WEIGHT_LOADER_DEFAULT_MAPPING = {}
CHECKPOINT_LOADER_FORMAT_DEFAULT_MAPPING = {}
MODEL_CLASS_CONFIG_LOADER_DEFAULT_MAPPING = {}


def register_mapper(format, name=None):
    def decorator(cls):
        MODEL_CLASS_MAPPER_MAPPING[f"{name}_{format}" if name is not None else format] = cls
        return cls

    return decorator


def register_checkpoint_weight_loader(name):
    def decorator(cls):
        MODEL_CLASS_CHECKPOINT_WEIGHT_LOADER_DEFAULT_MAPPING[name] = cls
        return cls

    return decorator


def register_checkpoint_loader(name):
    def decorator(cls):
        CHECKPOINT_LOADER_FORMAT_DEFAULT_MAPPING[name] = cls
        return cls

    return decorator


def get_checkpoint_weight_loader(name):
    if name not in MODEL_CLASS_CHECKPOINT_WEIGHT_LOADER_DEFAULT_MAPPING:
        raise ValueError(f"Default checkpoint weight loader {name} not found.")
    return MODEL_CLASS_CHECKPOINT_WEIGHT_LOADER_DEFAULT_MAPPING[name]
