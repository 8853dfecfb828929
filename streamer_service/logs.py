"""Log output of the CLI and the daemon: a level and a format (``text`` or ``json``); and whether
the CLI's commands draw progress bars (:func:`progress_mode`).

``json`` writes one object per line for log collectors (Loki, Cloud Logging, Elasticsearch):
``time`` (UTC, ISO 8601), ``level``, ``logger``, ``message``, the fields passed with
``extra={...}``, and ``exception`` with the traceback when there is one. uvicorn's own loggers
are routed through the same handler (``serve`` gives uvicorn no logging config of its own).

Nothing here prints settings: secrets are ``streamer_client._settings.Secret`` and render as ``**********``.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import datetime, timezone

__all__ = ["JsonFormatter", "TEXT_FORMAT", "configure", "progress_mode"]

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# Attributes every LogRecord has; anything else on a record came from ``extra=`` (uvicorn adds
# color_message, its message with ANSI colours: not for collectors).
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName", "color_message"}


_SDK_LOGGERS = ("httpx", "botocore", "boto3", "s3transfer", "urllib3", "azure", "google")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_") and key not in entry:
                entry[key] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str, ensure_ascii=False)


def configure(level: str, fmt: str, stream=None) -> None:
    """Send every logger's records at ``level`` and above to stderr in format ``fmt``."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    # One INFO line per request (httpx), "Found credentials in environment variables." (botocore),
    # every Azure request's headers (azure.core): SDK chatter, not ours, unless debugging.
    sdk_level = logging.DEBUG if logging.getLevelName(level) == logging.DEBUG else logging.WARNING
    for name in _SDK_LOGGERS:
        logging.getLogger(name).setLevel(sdk_level if name != "httpx" else logging.WARNING)


def progress_mode(asked: str | None) -> str:
    """A command's ``--progress`` / ``--no-progress`` (``asked``), else ``STREAMER_PROGRESS``
    (``auto``: bars on a terminal only). Here, not in ``cli``, so that the commands ``cli`` imports
    (``demo``) need not import ``cli`` back."""
    from .settings import get_settings

    return asked or get_settings().progress
