"""Deprecated: the old name of the internal module ``_pinning`` (streamer_client/_deprecated.py)."""

from ._deprecated import moved

moved(__name__)
