"""streamer-service: object-storage checkpoint streaming with node-local fan-out.

Nothing happens at import: no native library is loaded, no thread started.
"""

__version__ = "0.1.0"
