"""Parsers of setting values: each takes the text of an environment variable or a Python value
of its type, and returns the value or raises ``ValueError`` saying what was expected.

Both readers of the settings table (``streamer_client._settings``: the client's and the daemon's)
call the same parser for a field, so that they agree by construction.
"""

import contextlib
import json
import math
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = [
    "Secret",
    "byte_size",
    "choice",
    "flag",
    "integer",
    "number",
    "optional",
    "path",
    "secret",
    "size_text",
    "text",
    "words",
]

KiB, MiB, GiB = 1024, 1024**2, 1024**3


def flag(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        word = value.strip().lower()
        if word in ("1", "true", "t", "yes", "y", "on"):
            return True
        if word in ("0", "false", "f", "no", "n", "off"):
            return False
    raise ValueError("not a flag: give 1, true, yes or on; 0, false, no or off")


def _bounded(value, shown: str, ge=None, gt=None, le=None, show=str):
    if ge is not None and value < ge:
        raise ValueError(f"{shown} is below the least allowed, {show(ge)}")
    if gt is not None and not value > gt:
        raise ValueError(f"{shown} must be more than {show(gt)}")
    if le is not None and value > le:
        raise ValueError(f"{shown} is above the most allowed, {show(le)}")
    return value


def integer(*, ge: int | None = None, le: int | None = None) -> Callable[[Any], int]:
    def parse(value: Any) -> int:
        number = None
        if isinstance(value, int) and not isinstance(value, bool):
            number = value
        elif isinstance(value, str) and re.fullmatch(r"\s*[+-]?[0-9]+\s*", value):
            number = int(value)
        if number is None:
            raise ValueError("not a whole number")
        return _bounded(number, str(number), ge=ge, le=le)

    return parse


def number(*, ge: float | None = None, gt: float | None = None) -> Callable[[Any], float]:
    def parse(value: Any) -> float:
        result = None
        if isinstance(value, (int, float, str)) and not isinstance(value, bool):
            try:
                result = float(value)
            except (ValueError, OverflowError):
                pass
        if result is None or math.isnan(result):
            raise ValueError("not a number")
        return _bounded(result, f"{result:g}", ge=ge, gt=gt)

    return parse


_UNITS = {"": 1, "b": 1}
for _i, _prefix in enumerate("kmgtpe", start=1):
    _UNITS.update({_prefix: 1000**_i, f"{_prefix}b": 1000**_i, f"{_prefix}ib": 1024**_i})
# Compiled on first use (re's cache), not at import.
_SIZE = r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*"


def size_text(nbytes: int) -> str:
    for unit, name in ((GiB, "GiB"), (MiB, "MiB"), (KiB, "KiB")):
        if nbytes >= unit and nbytes % unit == 0:
            return f"{nbytes // unit}{name} ({nbytes} bytes)"
    return f"{nbytes} bytes"


def byte_size(*, ge: int | None = None, gt: int | None = None, le: int | None = None) -> Callable[[Any], int]:
    """Bytes: ``1000000``, ``512MiB``, ``4GiB``, ``1.5GB`` (``k``/``KB`` are 1000, ``KiB`` 1024)."""

    def parse(value: Any) -> int:
        nbytes = None
        if isinstance(value, int) and not isinstance(value, bool):
            nbytes = value
        elif isinstance(value, str) and (match := re.fullmatch(_SIZE, value)) and match[2].lower() in _UNITS:
            scalar, unit = match[1], _UNITS[match[2].lower()]
            with contextlib.suppress(OverflowError):  # a fraction too large for a float
                nbytes = int(scalar) * unit if "." not in scalar else int(float(scalar) * unit)
        if nbytes is None or nbytes < 0:
            raise ValueError("not a size: give e.g. 4GiB, 512MiB or 1000000 (bytes)")
        return _bounded(nbytes, size_text(nbytes), ge=ge, gt=gt, le=le, show=size_text)

    return parse


def text(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError("not text")
    return value


def choice(*words: str) -> Callable[[Any], str]:
    """One of ``words``, in any case."""

    def parse(value: Any) -> str:
        word = text(value).strip().lower()
        if word not in words:
            raise ValueError(f"not one of {', '.join(words)}")
        return word

    return parse


def path(value: Any) -> Path:
    if isinstance(value, os.PathLike) or isinstance(value, str):
        return Path(value)
    raise ValueError("not a path")


def words(value: Any) -> tuple[str, ...]:
    """``"s3://a/m, gs://b/m"`` or ``"s3://a/m gs://b/m"``; a JSON list for words with spaces."""
    if isinstance(value, str):
        stripped = value.strip()
        if not stripped.startswith("["):
            return tuple(part for part in re.split(r"[,\s]+", stripped) if part)
        try:
            value = json.loads(stripped)
        except ValueError:
            raise ValueError("not a JSON list of strings") from None
    if not isinstance(value, (list, tuple)) or not all(isinstance(item, str) for item in value):
        raise ValueError("not a list of strings")
    return tuple(value)


def optional(parse: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``parse``, and ``None`` stays ``None`` (a field that may be unset)."""
    return lambda value: None if value is None else parse(value)


class Secret:
    """Text that ``repr``, ``str`` and logs show as ``**********`` (tokens, keys, SAS tokens)."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def get_secret_value(self) -> str:
        return self._value

    def __len__(self) -> int:
        return len(self._value)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and other._value == self._value

    def __hash__(self) -> int:
        return hash(self._value)

    def __repr__(self) -> str:
        return "Secret('**********')"

    def __str__(self) -> str:
        return "**********"


def secret(value: Any) -> Secret:
    return value if isinstance(value, Secret) else Secret(text(value))
