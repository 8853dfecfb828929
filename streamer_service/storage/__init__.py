"""Storage backends: S3, GCS, Azure Blob and local directories behind one interface."""

from __future__ import annotations

import importlib

from ..settings import Settings
from ..uri import Scheme, StorageURI
from .base import ObjectInfo, Storage

__all__ = ["BACKENDS", "ObjectInfo", "Storage", "open_storage"]

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
    module, _, name = BACKENDS[uri.scheme].partition(":")
    backend: type[Storage] = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    return backend(uri, settings)
