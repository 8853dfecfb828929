"""Ready-made fault hooks for ``CountingProxy.fault``, with the error bodies each cloud sends.

Compose them: ``every_nth(3, lambda r: cloud_error("s3", 503))`` answers a third of the ranged
GETs with S3's SlowDown; ``always(Fault.stalled(30))`` stalls every response mid-body."""

from __future__ import annotations

import itertools
import json
import threading
from collections.abc import Callable

from .proxy import Fault, FaultHook, RecordedRequest

__all__ = ["cloud_error", "denied_fault", "unavailable_fault", "first_n", "every_nth", "always", "range_get"]

_S3_CODES = {403: ("AccessDenied", "Access Denied"), 503: ("SlowDown", "Please reduce your request rate.")}
_AZ_CODES = {
    403: ("AuthorizationPermissionMismatch", "This request is not authorized to perform this operation using this permission."),
    503: ("ServerBusy", "The server is currently unable to receive requests. Please retry your request."),
}
_GCS_REASONS = {403: "forbidden", 503: "backendError"}


def cloud_error(backend: str, status: int, method: str = "GET") -> Fault:
    """A :class:`Fault` answering ``status`` with the error body and headers of ``backend``."""
    if backend == "s3":
        code, message = _S3_CODES.get(status, ("InternalError", "We encountered an internal error."))
        body = (
            '<?xml version="1.0" encoding="UTF-8"?>\n'
            f"<Error><Code>{code}</Code><Message>{message}</Message>"
            "<RequestId>INJECTED</RequestId></Error>"
        ).encode()
        headers = (("Content-Type", "application/xml"),)
    elif backend == "gcs":
        reason = _GCS_REASONS.get(status, "backendError")
        message = f"injected {status} ({reason})"
        body = json.dumps(
            {
                "error": {
                    "code": status,
                    "message": message,
                    "errors": [{"message": message, "domain": "global", "reason": reason}],
                }
            }
        ).encode()
        headers = (("Content-Type", "application/json; charset=UTF-8"),)
    elif backend == "azure":
        code, message = _AZ_CODES.get(status, ("InternalError", "The server encountered an internal error."))
        body = (
            '<?xml version="1.0" encoding="utf-8"?>'
            f"<Error><Code>{code}</Code><Message>{message}\nRequestId:injected</Message></Error>"
        ).encode()
        headers = (("Content-Type", "application/xml"), ("x-ms-error-code", code))
    else:
        raise ValueError(f"no cloud error format for backend {backend!r}")
    return Fault(status=status, body=b"" if method == "HEAD" else body, headers=headers)


def _always_error(backend: str, status: int) -> FaultHook:
    def hook(r: RecordedRequest) -> Fault | None:
        return cloud_error(backend, status, r.method)

    return hook


def denied_fault(backend: str) -> FaultHook:
    """Every request answered 403 access denied, in the backend's own error format."""
    return _always_error(backend, 403)


def unavailable_fault(backend: str) -> FaultHook:
    """Every request answered 503 (S3 SlowDown, GCS backendError, Azure ServerBusy)."""
    return _always_error(backend, 503)


def _numbered(fault: FaultHook, when: Callable[[RecordedRequest], bool] | None, chosen: Callable[[int], bool]) -> FaultHook:
    """Apply ``fault`` to the i-th request matching ``when`` (all when None), counted from 1, if ``chosen(i)``."""
    counter = itertools.count(1)
    lock = threading.Lock()

    def hook(r: RecordedRequest) -> Fault | None:
        if when is not None and not when(r):
            return None
        with lock:
            i = next(counter)
        return fault(r) if chosen(i) else None

    return hook


def first_n(n: int, fault: FaultHook, when: Callable[[RecordedRequest], bool] | None = None) -> FaultHook:
    """Apply ``fault`` to the first ``n`` requests that match ``when`` (all by default); then forward."""
    return _numbered(fault, when, lambda i: i <= n)


def range_get(r: RecordedRequest) -> bool:
    """A ranged GET: a safetensors header read or a Run:ai tensor read."""
    return r.method == "GET" and r.range is not None


def every_nth(n: int, fault: FaultHook, when: Callable[[RecordedRequest], bool] | None = range_get) -> FaultHook:
    """Apply ``fault`` to every ``n``-th request matching ``when`` (ranged GETs by default): a
    deterministic share ``1/n`` of them; the others, and every retry in between, are forwarded."""
    return _numbered(fault, when, lambda i: i % n == 0)


def always(fault: Fault) -> FaultHook:
    """``fault`` for every request (wrap in :func:`every_nth` or :func:`first_n` to narrow it)."""
    return lambda r: fault
