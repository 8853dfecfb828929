"""tensorrt_llm/_torch/models/checkpoints/hf/config_loader.py: load(checkpoint_dir) -> ModelConfig whose
pretrained_config is transformers' config of that dir."""

from types import SimpleNamespace


class HfConfigLoader:
    def load(self, checkpoint_dir: str, **kwargs):
        import transformers

        return SimpleNamespace(pretrained_config=transformers.AutoConfig.from_pretrained(checkpoint_dir), checkpoint_dir=checkpoint_dir)

    def cleanup(self) -> None:
        pass
