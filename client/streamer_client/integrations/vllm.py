"""vLLM: the load format ``streamer`` (registered by :func:`register`) and ``weights_iterator``.

``pip install streamer-client`` next to vLLM is all it takes: the distribution declares
:func:`register` as a ``vllm.general_plugins`` entry point, which vLLM runs in every process, so
``vllm serve s3://bucket/model --load-format streamer`` and
``LLM(model="s3://...", load_format="streamer")`` work (the loader: :mod:`.vllm_loader`). This
module itself imports no vLLM: the client installs and imports without it.

``weights_iterator`` (:mod:`.weights`) is what the loader streams through, for a model's
``load_weights``. The loader imports it from there, not from here: this module imports the loader
(on :func:`register`) and the loader does not import this module.
"""

from __future__ import annotations

from ._engine import LOAD_FORMAT
from .weights import weights_iterator

__all__ = ["LOAD_FORMAT", "register", "weights_iterator"]


def register() -> None:
    """The ``vllm.general_plugins`` entry point: registers the ``streamer`` load format.

    vLLM calls it in its front end and in each worker, possibly more than once per process; the
    import does the work once.
    """
    from . import vllm_loader  # noqa: F401  (registers on import)
