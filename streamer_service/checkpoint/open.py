"""A checkpoint ready to stream: its metadata dir and its tensor table.

Opening a checkpoint pulls its metadata (a no-op when cached) and builds the
catalog from the listing recorded in ``.runai_complete``. The catalog is cached
beside the metadata dir as ``<sha256>.catalog.json``, keyed by a fingerprint
of the safetensors objects and the index (names, sizes, ETags), so a second
open reads no header from storage and a changed shard misses the cache.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import NamedTuple

from streamer_client.errors import CheckpointError, HeaderError, ObjectNotFoundError

from ..access import file_mode
from ..metadata.cache import Marker, MetadataCache, write_private
from ..settings import Settings
from ..storage import open_storage
from ..uri import StorageURI, parse_uri
from .catalog import INDEX_NAME, Catalog, build_catalog

__all__ = ["Checkpoint", "open_checkpoint"]

log = logging.getLogger(__name__)

# What fixes a checkpoint that is inconsistent as listed: the next load lists it again.
_LISTED_AGAIN = "listed just now; if an upload is still in progress, load again once it has finished"


class Checkpoint(NamedTuple):
    uri: StorageURI
    metadata_dir: Path
    catalog: Catalog
    generation: str = ""
    """Which pull of the metadata and which object versions the catalog describes: bytes kept
    from a load of one generation are served only to loads of the same one (``resident``)."""


def open_checkpoint(
    uri: str | StorageURI, settings: Settings, *, force: bool | None = None, launch_id: str | None = None
) -> Checkpoint:
    if not isinstance(uri, StorageURI):
        uri = parse_uri(uri)
    cache = MetadataCache(settings)
    metadata_dir, marker = cache.pull_marker(uri, force=force, launch_id=launch_id)
    cache_file = cache.root / f"{uri.cache_key}.catalog.json"
    try:
        try:
            catalog, fingerprint = _catalog(uri, settings, marker, cache_file)
        except (CheckpointError, ObjectNotFoundError) as exc:
            if cache.downloads:
                raise  # listed just now: the checkpoint itself is inconsistent
            # The cached listing may predate the end of an upload: list once more
            # before failing, so a finished upload loads without a forced pull.
            log.info("%s; pulling the metadata of %s again in case its cached listing is out of date", exc, uri)
            metadata_dir, marker = cache.pull_marker(uri, force=force, launch_id=launch_id, stale=marker)
            catalog, fingerprint = _catalog(uri, settings, marker, cache_file)
    except (CheckpointError, ObjectNotFoundError) as exc:
        if not _could_be_mid_upload(uri, exc):
            raise
        raise type(exc)(f"{exc.message} ({_LISTED_AGAIN})", uri=exc.uri, key=exc.key) from None
    generation = f"{fingerprint}:{marker.launch_id}:{marker.pulled_at}"
    return Checkpoint(uri=uri, metadata_dir=metadata_dir, catalog=catalog, generation=generation)


def _could_be_mid_upload(uri: StorageURI, exc: CheckpointError | ObjectNotFoundError) -> bool:
    """Whether an upload still in progress could explain ``exc``. Objects of object storage
    appear one at a time and each whole: a listing can lack some of them (a shard the index
    names, part of a shard set) but never hold part of one. So not what one object's bytes say
    (a safetensors header, the index's JSON), nor anything of a local dir, which is read as it
    is."""
    return not uri.is_local and not isinstance(exc, HeaderError) and exc.key != INDEX_NAME


def _catalog(uri: StorageURI, settings: Settings, marker: Marker, cache_file: Path) -> tuple[Catalog, str]:
    """The catalog of the listing ``marker`` recorded (from the catalog cache when it matches), and its key."""
    objects = [*marker.files, *marker.weights]
    fingerprint = Catalog.fingerprint(objects)
    catalog = _load_cached(cache_file, fingerprint)
    if catalog is None:
        with open_storage(uri, settings) as storage:
            catalog = build_catalog(storage, objects)
        _store(cache_file, fingerprint, catalog, file_mode(settings))
        log.info("catalog of %s: %d tensors, %d bytes in %d files", uri, len(catalog), catalog.total_bytes, len(catalog.files))
    return catalog, fingerprint


def _load_cached(path: Path, fingerprint: str) -> Catalog | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("fingerprint") != fingerprint:
            return None
        return Catalog.from_json(data["catalog"])
    except (OSError, ValueError, KeyError, TypeError, CheckpointError):
        return None  # absent, torn or from another version: rebuild


def _store(path: Path, fingerprint: str, catalog: Catalog, mode: int) -> None:
    # os.urandom: secrets.token_hex's bytes, without importing hmac on a load's path.
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{os.urandom(4).hex()}")
    try:
        write_private(tmp, json.dumps({"fingerprint": fingerprint, "catalog": catalog.to_json()}).encode(), mode)
        os.replace(tmp, path)
    except OSError as exc:
        # The cache is an optimization: a full or read-only disk costs header reads next time, nothing else.
        log.warning("could not cache the catalog at %s: %s", path, exc)
        tmp.unlink(missing_ok=True)
