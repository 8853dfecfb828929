"""Deprecated: the old name of the internal module ``_host_memory`` (streamer_client/_deprecated.py)."""

from ._deprecated import moved

moved(__name__)
