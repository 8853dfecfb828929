"""Hugging Face transformers: the model from the pulled metadata dir, the weights from the stream.

``from_pretrained(uri)`` pulls config, tokenizer and any remote code into the node cache
(:func:`streamer_client.pull_metadata`), streams the weights (:func:`streamer_client.load_state_dict`,
through the daemon when there is one) and hands both to transformers' own ``from_pretrained``
with ``state_dict=``: transformers builds the model without random initialisation, ties shared
weights and takes the streamed tensors as they are. Missing, unexpected or mis-shaped weights
raise :class:`CheckpointError` instead of transformers' warning and random initialisation.

What transformers' ``from_pretrained(path)`` would also do, and ``state_dict=`` skips, is done here:
the model's ``generation_config`` is read from the pulled ``generation_config.json`` (its stop
tokens, e.g. Llama-3-Instruct's ``<|eot_id|>``), and ``name_or_path`` is the URI.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

from .. import _daemon_serves, load_state_dict, pull_metadata
from ..errors import CheckpointError, ConfigError

__all__ = ["from_pretrained", "model_class_for"]

# In-process, the read ring holds every byte once on its way to a tensor: a ring as large as the
# checkpoint (the default budget is 4 GiB) doubles the peak. 64 MiB keeps loading a 350 MB Llama
# at 1.4x the peak RSS growth of transformers loading the same local files, 2.2x with the default
# (tests/test_integrations.py measures it); through a daemon the ring is the daemon's.
IN_PROCESS_BUDGET = "64MiB"


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
            raise ConfigError(
                f"{config_dir} ships its own model code ({auto_map[auto_class.__name__]}): pass trust_remote_code=True to run it"
            )
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
    ``socket``, ``select``, ``budget``: default :data:`IN_PROCESS_BUDGET` in-process, the daemon's own through one...); other keyword
    arguments to transformers' ``from_pretrained`` (``dtype``, ``attn_implementation``,
    ``device_map``: that one needs accelerate, ``pip install 'streamer-client[huggingface]'``).
    """
    if from_pretrained_kwargs.get("device_map") is not None and importlib.util.find_spec("accelerate") is None:
        raise ConfigError(
            f"{os.fspath(uri)}: device_map needs accelerate, which transformers uses to place the weights: "
            "pip install 'streamer-client[huggingface]' (or accelerate)",
            uri=os.fspath(uri),
        )
    config_dir = pull_metadata(uri)
    cls, config = model_class_for(config_dir, model_class, trust_remote_code=trust_remote_code)
    kwargs = dict(stream_kwargs or {})
    # Through a daemon its own budget applies, and a budget= would only be warned of.
    if "budget" not in kwargs and not _daemon_serves(kwargs.get("socket"), kwargs.get("require_daemon", False)):
        kwargs["budget"] = IN_PROCESS_BUDGET
    state_dict = load_state_dict(uri, device=device, **kwargs)
    model, info = cls.from_pretrained(
        None, config=config, state_dict=state_dict, output_loading_info=True, **from_pretrained_kwargs
    )
    del state_dict  # the model holds the tensors now
    problems = {k: sorted(info.get(k) or ()) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    problems = {k: v for k, v in problems.items() if v}
    if problems:
        shown = "; ".join(f"{k.replace('_', ' ')}: {', '.join(map(str, v[:5]))}" for k, v in problems.items())
        first = next(iter(problems.values()))[0]
        raise CheckpointError(f"{os.fspath(uri)} does not fit {cls.__name__}: {shown}", uri=os.fspath(uri), key=str(first))
    _as_if_from(model, config_dir, os.fspath(uri))
    return model.eval()


def _as_if_from(model, config_dir: Path, uri: str) -> None:
    """What ``from_pretrained(path)`` sets from the path and ``state_dict=`` leaves unset."""
    if (config_dir / "generation_config.json").is_file() and model.can_generate():
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(config_dir)
    model.name_or_path = uri
    model.config._name_or_path = uri
