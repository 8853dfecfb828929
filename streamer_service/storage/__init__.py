"""Storage backends: S3, GCS, Azure Blob and local directories behind one interface."""

from __future__ import annotations

from ..settings import Settings
from ..uri import Scheme, StorageURI
from .base import ObjectInfo, Storage

__all__ = ["ObjectInfo", "Storage", "open_storage"]


def open_storage(uri: StorageURI, settings: Settings) -> Storage:
    """The backend for ``uri``. Cloud SDKs are imported here, not at package import."""
    if uri.scheme is Scheme.S3:
        from .s3 import S3Storage

        return S3Storage(uri, settings)
    if uri.scheme is Scheme.GCS:
        from .gcs import GCSStorage

        return GCSStorage(uri, settings)
    if uri.scheme is Scheme.AZURE:
        from .azure import AzureStorage

        return AzureStorage(uri, settings)
    from .local import LocalStorage

    return LocalStorage(uri, settings)
