"""Every setting of streamer-service, read from the environment once.

This is the only module that reads ``os.environ`` for our own settings. Cloud
SDKs keep reading their standard variables themselves (``AWS_ENDPOINT_URL``,
``STORAGE_EMULATOR_HOST``, ``AZURE_STORAGE_CONNECTION_STRING``, ...); see
docs/configuration.md for the full table.
"""

from __future__ import annotations

import json
import os
import re
from functools import lru_cache
from pathlib import Path
from collections.abc import Mapping
from typing import Annotated, Literal

from pydantic import AliasChoices, ByteSize, Field, SecretStr, ValidationError, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from streamer_client._config import DEFAULT_SOCKET as _CLIENT_DEFAULT_SOCKET

__all__ = [
    "DEFAULT_SOCKET", "MIN_SHM_BUDGET", "Settings", "default_cache_dir", "describe_invalid", "env_name", "few_slots_warning",
    "get_settings",
]  # fmt: skip

# One default for serve, health, the client, docs and manifests (issue 14); the client owns it, it
# cannot import the service.
DEFAULT_SOCKET = _CLIENT_DEFAULT_SOCKET
"""The daemon's socket when ``STREAMER_SOCKET`` is unset (``serve``, ``health``, the ranks)."""

MIN_SHM_BUDGET = 64 * 1024
"""The smallest shared-memory budget that holds one useful slot. Below it every tensor becomes a
batch of its own (``--shm-budget 1``: 20,000 tensors took 33.7 s instead of 0.6 s, issue 14)."""

FEW_SLOTS = 4
"""A budget of fewer slots than this (of the configured slot size) is accepted with a warning."""


def default_cache_dir() -> Path:
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "streamer-service"


class Settings(BaseSettings):
    """Service settings. Environment variables are ``STREAMER_<FIELD>`` unless noted."""

    model_config = SettingsConfigDict(env_prefix="STREAMER_", extra="ignore", frozen=True, populate_by_name=True)

    cache_dir: Path = Field(default_factory=default_cache_dir)
    """Root of the metadata cache (one dir per URI hash)."""

    shm_dir: Path = Path("/dev/shm")
    """Where shared-memory segments live (daemon mode)."""

    shm_budget: ByteSize = ByteSize(4 * 1024**3)
    """Most bytes of tensor buffers in use at once (plus one oversized tensor); at least 64 KiB."""

    slot_size: ByteSize = Field(default=ByteSize(256 * 1024**2), gt=0)
    """Size of one buffer slot; tensors larger than this get their own allocation."""

    socket: Path | None = None
    """Unix socket of the node daemon (unset: ``/run/streamer/daemon.sock``, the client's default too)."""

    launch_id: str | None = None
    """Explicit launch id (see docs/metadata-cache.md); default derived per process."""

    torchelastic_run_id: str | None = Field(
        default=None, validation_alias=AliasChoices("TORCHELASTIC_RUN_ID")
    )
    """Set by torchrun for every rank of one run: the launch id when STREAMER_LAUNCH_ID is unset."""

    force_pull: bool = Field(
        default=False,
        validation_alias=AliasChoices("TRTLLM_OBJECT_STORAGE_FORCE_PULL", "STREAMER_FORCE_PULL"),
    )
    """Re-pull metadata once per launch even when the cache is complete."""

    lock_timeout_s: float = Field(default=1800.0, gt=0)
    """How long a puller waits for another process's pull of the same URI."""

    lock_log_interval_s: float = Field(default=5.0, gt=0)
    """How often a waiting puller logs that it is still waiting."""

    storage_retries: int = Field(default=3, ge=0, le=20)
    """Retries of one failed storage request (listing, metadata download, header read)."""

    storage_connect_timeout_s: float = Field(default=5.0, gt=0)
    """Connect timeout of one storage request."""

    storage_read_timeout_s: float = Field(default=60.0, gt=0)
    """Read timeout of one storage request."""

    storage_retry_deadline_s: float = Field(default=60.0, gt=0)
    """GCS only: total time one request may spend retrying (its SDK retries by deadline)."""

    s3_addressing_style: Literal["auto", "path", "virtual"] = "auto"
    """boto3's S3 addressing style; ``path`` for most S3-compatible servers."""

    # Read parallelism of Run:ai's native reader (docs/configuration.md, "Read parallelism"). None
    # leaves Run:ai's default; runai.storage_environment passes a set value on.
    obj_concurrency: int | None = Field(default=None, ge=1, le=1024)
    """Object-storage clients Run:ai reads with at once (``RUNAI_STREAMER_OBJ_CONCURRENCY``; Run:ai: 8)."""

    s3_target_gbps: int | None = Field(default=None, ge=1, le=10_000)
    """Throughput target of each S3 client in Gbit/s (``RUNAI_STREAMER_S3_TARGET_GBPS``; the AWS CRT: 10)."""

    read_chunk_size: ByteSize | None = Field(default=None, ge=5 * 1024**2, le=1024**3)
    """Bytes one Run:ai read request asks for at once (``RUNAI_STREAMER_CHUNK_BYTESIZE``; Run:ai: 8 MiB from
    object storage, 2 MiB from files; object storage needs at least 5 MiB)."""

    local_reader: Literal["mapped", "runai"] = "mapped"
    """How the daemon and embedded CUDA loads read local checkpoint files: ``mapped`` (mapped and
    copied by native threads, ``streamer_service.mapped``; Run:ai where that extension is not built
    or ``RUNAI_STREAMER_FS_STRATEGY`` is set) or ``runai`` (Run:ai's reader, always)."""

    # Azure's account is not part of az:// URIs; these are the variables Run:ai's reader reads too.
    azure_storage_connection_string: SecretStr | None = Field(
        default=None, validation_alias=AliasChoices("AZURE_STORAGE_CONNECTION_STRING")
    )
    azure_storage_account_name: str | None = Field(default=None, validation_alias=AliasChoices("AZURE_STORAGE_ACCOUNT_NAME"))
    azure_storage_account_key: SecretStr | None = Field(
        default=None, validation_alias=AliasChoices("AZURE_STORAGE_ACCOUNT_KEY")
    )
    azure_storage_sas_token: SecretStr | None = Field(default=None, validation_alias=AliasChoices("AZURE_STORAGE_SAS_TOKEN"))
    azure_storage_endpoint_suffix: str = Field(
        default="blob.core.windows.net", validation_alias=AliasChoices("AZURE_STORAGE_ENDPOINT_SUFFIX")
    )

    group_access: bool = False
    """Socket 0660 and segments 0640 instead of 0600 (``serve --group-access``): ranks of another
    UID in the daemon's group may connect and map tensors."""

    tcp_port: int | None = Field(default=None, ge=1, le=65535)
    """Also serve on 127.0.0.1:PORT (``serve --tcp-port``); requires ``STREAMER_TOKEN``."""

    token: SecretStr | None = None
    """Bearer token the TCP listener requires (``Authorization: Bearer <token>``)."""

    metrics_port: int | None = Field(default=None, ge=1, le=65535)
    """Serve ``GET /metrics`` and ``GET /healthz`` on ``metrics_host:PORT`` (``serve --metrics-port``), read-only
    and without a token, for Prometheus and kubelet probes. Unset: no such listener."""

    metrics_host: str = "0.0.0.0"
    """Address the metrics listener binds (``serve --metrics-host``); ``0.0.0.0`` so the pod IP is scraped."""

    build_revision: str = "unknown"
    """Source revision the image was built from (the Dockerfile sets it); reported in ``streamer_build_info``."""

    allow: Annotated[list[str], NoDecode] = Field(default_factory=list)
    """URI prefixes the daemon may read (``--allow``, repeatable; in the environment a comma- or
    space-separated list, or a JSON list). Empty: any URI (the daemon logs a warning)."""

    metadata_patterns: Annotated[list[str], NoDecode] = Field(default_factory=list)
    """More file-name patterns (fnmatch, on the base name) to pull into the metadata cache, on top
    of ``metadata.LOADER_PATTERNS``; comma- or space-separated in the environment."""

    metadata_max_file_bytes: ByteSize = Field(default=ByteSize(256 * 1024**2), gt=0)
    """Largest single file a metadata pull accepts (a bigger one fails the pull, naming it)."""

    metadata_max_total_bytes: ByteSize = Field(default=ByteSize(1024**3), gt=0)
    """Most bytes one metadata pull may download in total."""


    retention_budget: ByteSize = ByteSize(0)
    """Shared memory the daemon may keep checkpoint bytes in after their load, so that the next load
    of the same checkpoint (a restarted rank, a new launch) reads nothing from storage; least
    recently used checkpoints are evicted first. On top of ``shm_budget``. 0: off."""

    segment_idle_s: float = Field(default=30.0, ge=0)
    """How long the daemon keeps an unused shared-memory segment for the next load (0: never)."""

    segment_prepare: bool = True
    """Make the ring's segments (up to 6 slots, within ``shm_budget``) when the daemon starts, in the
    background, and keep them for the first load however late it comes (docs/deploy.md, "Segments
    made at start"). Only with ``segment_idle_s`` > 0 and no retention budget (a retained load uses
    segments of its own). Off: the first load makes its segments itself."""

    join_timeout_s: float = Field(default=300.0, gt=0)
    """How long the ranks of a session have to join before the daemon gives up on it."""

    rank_timeout_s: float = Field(default=30.0, gt=0)
    """A rank silent this long (dead, hung) is reclaimed: its leases released, the others go on."""

    log_level: str = "INFO"
    """Least severe level logged (``--log-level``)."""

    log_format: Literal["text", "json"] = "text"
    """``json``: one JSON object per line (time, level, logger, message, extra fields) for log
    collectors; ``text``: one readable line (``--log-format``)."""

    progress: Literal["auto", "on", "off"] = "auto"
    """Progress bars on stderr (tqdm): ``auto`` draws them only when stderr is a terminal
    (``--progress`` / ``--no-progress``); the client draws one only when asked (``progress=True``)."""

    @field_validator("allow", "metadata_patterns", mode="before")
    @classmethod
    def _word_list(cls, value):
        # STREAMER_ALLOW="s3://a/m, gs://b/m" or "s3://a/m gs://b/m"; a JSON list still works.
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                return json.loads(text)
            return [part for part in re.split(r"[,\s]+", text) if part]
        return value

    @field_validator("shm_budget")
    @classmethod
    def _one_slot(cls, value: ByteSize) -> ByteSize:
        if value < MIN_SHM_BUDGET:
            raise ValueError(f"a budget of {int(value)} bytes is below one slot ({MIN_SHM_BUDGET} bytes = 64KiB); give e.g. 4GiB")
        return value

    @field_validator("log_level")
    @classmethod
    def _level(cls, value: str) -> str:
        value = value.upper()
        if value not in {"DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"}:
            raise ValueError(f"unknown log level {value!r}")
        return value

    @field_validator("torchelastic_run_id")
    @classmethod
    def _run_id(cls, value: str | None) -> str | None:
        # torchrun without a rendezvous id exports the literal "none".
        return None if not value or value == "none" else value


def env_name(field: str) -> str:
    """The environment variable a settings field is read from (its alias, else ``STREAMER_<FIELD>``)."""
    info = Settings.model_fields.get(field)
    alias = info.validation_alias if info is not None else None
    if isinstance(alias, AliasChoices):
        return str(alias.choices[0])
    return f"STREAMER_{field.upper()}"


def describe_invalid(exc: ValidationError, arguments: Mapping[str, str] | None = None) -> str:
    """A pydantic error as one line naming each variable, e.g. ``STREAMER_SHM_BUDGET='lots': ...``.

    ``arguments`` maps the fields a caller passed as arguments to the names it passed them by
    (``{"shm_budget": "budget"}``): those are named as arguments, not as variables.
    """
    problems = []
    for error in exc.errors():
        field = str(error["loc"][0]) if error["loc"] else ""
        if arguments and field in arguments:
            name = arguments[field]
        else:
            name = env_name(field) if field in Settings.model_fields else field
        problems.append(f"{name}={error.get('input')!r}: {error['msg']}")
    return "; ".join(problems)


def few_slots_warning(settings: Settings) -> str | None:
    """What to warn about when the budget holds fewer than a few slots of the configured size."""
    budget, slot = int(settings.shm_budget), int(settings.slot_size)
    if budget >= FEW_SLOTS * slot:
        return None
    return (
        f"STREAMER_SHM_BUDGET ({budget} bytes) holds fewer than {FEW_SLOTS} slots of STREAMER_SLOT_SIZE "
        f"({slot} bytes): slots shrink to {max(budget // FEW_SLOTS, 1)} bytes and loads of many tensors "
        "take more requests; raise the budget for speed"
    )


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings, read once. Tests build ``Settings(...)`` directly."""
    return Settings()
