"""Hugging Face transformers: the model from the pulled metadata dir, the weights from the stream.

``from_pretrained(uri)`` pulls config, tokenizer and any remote code into the node cache
(:func:`streamer_client.pull_metadata`), streams the weights (:func:`streamer_client.load_state_dict`,
through the daemon when there is one) and hands both to transformers' own ``from_pretrained``
with ``state_dict=``: transformers builds the model without random initialisation, ties shared
weights and takes the streamed tensors as they are. Missing, unexpected or mis-shaped weights
raise :class:`CheckpointError` instead of transformers' warning and random initialisation.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .. import load_state_dict, pull_metadata
from ..errors import CheckpointError, ConfigError

__all__ = ["from_pretrained", "model_class_for"]


def model_class_for(config_dir: Path, auto_class: Any = None, *, trust_remote_code: bool = False) -> tuple[type, Any]:
    """The concrete model class for the config in ``config_dir`` (default: ``AutoModelForCausalLM``)."""
    import transformers

    auto_class = auto_class or transformers.AutoModelForCausalLM
    config = transformers.AutoConfig.from_pretrained(config_dir, trust_remote_code=trust_remote_code)
    mapping = getattr(auto_class, "_model_mapping", None)
    if mapping is None:  # already a concrete class (LlamaForCausalLM, ...)
        return auto_class, config
    auto_map = getattr(config, "auto_map", None) or {}
    if auto_class.__name__ in auto_map:
        if not trust_remote_code:
            raise ConfigError(f"{config_dir} ships its own model code ({auto_map[auto_class.__name__]}): pass trust_remote_code=True to run it")
        from transformers.dynamic_module_utils import get_class_from_dynamic_module

        return get_class_from_dynamic_module(auto_map[auto_class.__name__], str(config_dir)), config
    try:
        return mapping[type(config)], config
    except KeyError:
        raise ConfigError(f"{auto_class.__name__} has no model for config type {type(config).__name__} ({config_dir})") from None


def from_pretrained(
    uri: str | os.PathLike,
    *,
    model_class: Any = None,
    trust_remote_code: bool = False,
    device: str = "cpu",
    stream_kwargs: dict | None = None,
    **from_pretrained_kwargs,
):
    """A transformers model for checkpoint ``uri``, weights streamed, in eval mode.

    ``model_class``: an auto class (default ``AutoModelForCausalLM``) or a concrete one.
    ``stream_kwargs`` go to :func:`streamer_client.load_state_dict` (``rank``, ``world_size``,
    ``socket``, ``select``...); other keyword arguments to transformers' ``from_pretrained``
    (``dtype``, ``attn_implementation``...).
    """
    config_dir = pull_metadata(uri)
    cls, config = model_class_for(config_dir, model_class, trust_remote_code=trust_remote_code)
    state_dict = load_state_dict(uri, device=device, **(stream_kwargs or {}))
    model, info = cls.from_pretrained(
        None, config=config, state_dict=state_dict, output_loading_info=True, **from_pretrained_kwargs
    )
    problems = {k: sorted(info.get(k) or ()) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    problems = {k: v for k, v in problems.items() if v}
    if problems:
        shown = "; ".join(f"{k.replace('_', ' ')}: {', '.join(map(str, v[:5]))}" for k, v in problems.items())
        first = next(iter(problems.values()))[0]
        raise CheckpointError(
            f"{os.fspath(uri)} does not fit {cls.__name__}: {shown}", uri=os.fspath(uri), key=str(first)
        )
    return model.eval()
