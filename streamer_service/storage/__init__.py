"""Storage backends: S3, GCS, Azure Blob and local directories behind one interface."""

from __future__ import annotations

import importlib
from collections.abc import Iterable

from ..settings import Settings
from ..uri import Scheme, StorageURI
from .base import ObjectInfo, Storage

__all__ = ["BACKENDS", "ObjectInfo", "Storage", "open_storage", "prepare_backends"]

BACKENDS: dict[Scheme, str] = {
    Scheme.S3: "s3:S3Storage",
    Scheme.GCS: "gcs:GCSStorage",
    Scheme.AZURE: "azure:AzureStorage",
    Scheme.LOCAL: "local:LocalStorage",
}
"""Each scheme's backend, ``module:class`` in this package. A module is imported when its scheme
is first opened: a process that reads a local directory imports no cloud SDK."""


def open_storage(uri: StorageURI, settings: Settings) -> Storage:
    """The backend for ``uri``'s scheme."""
    backend: type[Storage] = getattr(_backend_module(uri.scheme), BACKENDS[uri.scheme].partition(":")[2])
    return backend(uri, settings)


def prepare_backends(schemes: Iterable[Scheme]) -> dict[Scheme, Exception]:
    """Do now what the first client of each scheme's backend would do in this process: import its
    SDK, and where the module has a ``prepare()``, the rest (S3: botocore's service models and
    endpoint rules). A daemon calls it at start, so that its first load does not wait for it.
    Returns the schemes that could not be prepared (an SDK not installed), with why: a load of one
    of them meets the same error then."""
    failed: dict[Scheme, Exception] = {}
    for scheme in schemes:
        try:
            prepare = getattr(_backend_module(scheme), "prepare", None)
            if prepare is not None:
                prepare()
        except Exception as exc:  # noqa: BLE001 - reported to the caller, raised again by a load that needs it
            failed[scheme] = exc
    return failed


def _backend_module(scheme: Scheme):
    return importlib.import_module(f"{__name__}.{BACKENDS[scheme].partition(':')[0]}")
