"""Deprecated: the old name of the internal module ``_protocol`` (streamer_client/_deprecated.py)."""

from ._deprecated import moved

moved(__name__)
