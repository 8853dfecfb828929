"""streamer-service: object-storage checkpoint streaming with node-local fan-out.

The packages, bottom to top (docs/architecture.md; each ``__init__`` says what it owns and may
import): the foundation modules (``sizing``, ``uri``, ``settings``, ``logs``, ``access``);
``storage`` and ``readers``; ``metadata``; ``checkpoint``; ``load``; the two modes,
``embedded`` (in-process) and ``daemon`` (the node daemon); the tools ``sample``, ``demo``,
``bench`` and ``cli`` (``python -m streamer_service``).

Nothing happens at import: no native library is loaded, no thread started.
"""

__version__ = "0.1.0"
