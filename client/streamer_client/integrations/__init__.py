"""Adapters from :func:`streamer_client.stream` to what inference engines consume.

- :mod:`.vllm` — ``weights_iterator``: ``(name, tensor)`` pairs for a model's ``load_weights``
  (vLLM, SGLang).
- :mod:`.tensorrt_llm` — ``load_groups``: a per-rank plan of tensor-name groups (e.g. one per
  layer), each handed over as soon as all its tensors arrived (TensorRT-LLM-style loaders).
- :mod:`.huggingface` — ``from_pretrained``: a transformers model built from the pulled metadata
  dir, its weights from the stream, loaded strictly.

Each is a few lines over the public API and imports only torch at import time; transformers is
imported when :func:`.huggingface.from_pretrained` is called. See docs/integration.md and the
runnable scripts in examples/.
"""
