"""Every setting of streamer-client and streamer-service: one schema, read without pydantic.

:class:`Settings` is the table. Each field is one row: its name, the environment variable(s) it
is read from (``STREAMER_<NAME>`` unless the row says otherwise; the first one set wins), its
type, its default, its parser and a one-line doc. Adding a setting is adding one row::

    nic_gbps: int | None = Setting(None, optional(integer(ge=1)), "the node NIC's rate, Gbit/s")

A :class:`Settings` is also the one value every part of the project takes. ``Settings()`` reads
the process environment now; ``Settings(shm_budget="8GiB")`` reads it with that field replaced;
both parse every value with its row's parser and raise :class:`SettingsError` naming each bad
variable (``STREAMER_SHM_BUDGET='lots': not a size: ...``). The daemon reads the same table
through pydantic-settings (``streamer_service.settings``): its model is built from these rows,
and tests/test_settings_parity.py checks that both readers agree on every field.

Reading rules, the same for both readers: a variable set to the empty string is unset; names are
case-sensitive; a value passed as an argument wins over the environment. The parsers of more
than one field are ``streamer_client._parsers``; those of a single field are here.
"""

import json
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from ._parsers import GiB, MiB, Secret, byte_size, choice, flag, integer, number, optional, path, secret, text, words
from ._progress import MODES as PROGRESS_MODES
from .errors import SettingsError

__all__ = [
    "DEFAULT_SOCKET", "MIN_SHM_BUDGET", "SETTINGS", "Secret", "Setting", "Settings", "SettingsError",
    "default_cache_dir", "read_settings",
]  # fmt: skip

DEFAULT_SOCKET = Path("/run/streamer/daemon.sock")
"""Where ``serve`` listens and ranks look for the daemon when ``STREAMER_SOCKET`` is unset: one
default for the daemon, the client, ``health``, the docs and the manifests."""

MIN_SHM_BUDGET = 64 * 1024
"""The smallest shared-memory budget that holds one useful slot: below it every tensor would be
a batch of its own, and a load of many tensors would take a request each."""

# --------------------------------------------------------------------------- parsers of single fields


def budget(value: Any) -> int:
    nbytes = byte_size()(value)
    if nbytes < MIN_SHM_BUDGET:
        raise ValueError(f"a budget of {nbytes} bytes is below one slot ({MIN_SHM_BUDGET} bytes = 64KiB); give e.g. 4GiB")
    return nbytes


def level_name(value: Any) -> str:
    level = text(value).strip().upper()
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise ValueError(f"unknown log level {level!r}: give DEBUG, INFO, WARNING, ERROR or CRITICAL")
    return level


def socket_address(value: Any) -> Path | str:
    """A unix socket's path, or ``tcp://127.0.0.1:PORT`` (kept as text: a path would fold ``//``)."""
    if isinstance(value, str) and value.startswith("tcp://"):
        return value
    return path(value)


def run_id(value: Any) -> str | None:
    # torchrun without a rendezvous id exports the literal "none".
    word = text(value)
    return None if word == "none" else word


def default_cache_dir() -> Path:
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "streamer-service"


# --------------------------------------------------------------------------- the table


class Setting:
    """One row of the table: ``Setting(default, parse, doc, env=...)`` in the body of
    :class:`Settings`, which fills in the row's name and type from the field. ``default`` may be a
    function, called at each read (a default that depends on the environment: ``cache_dir``)."""

    __slots__ = ("name", "env", "type", "default", "factory", "parse", "doc")

    def __init__(self, default: Any, parse: Callable[[Any], Any], doc: str, *, env: str | tuple[str, ...] = ()) -> None:
        self.factory: Callable[[], Any] | None = default if callable(default) else None
        self.default = None if self.factory is not None else default
        self.parse = parse
        self.doc = doc
        self.env: tuple[str, ...] = (env,) if isinstance(env, str) else env
        self.name = ""
        self.type: Any = None

    def default_value(self) -> Any:
        return self.factory() if self.factory is not None else self.default

    def lookup(self, environ: Mapping[str, str]) -> tuple[str, str] | None:
        """The first of this row's variables set (non-empty) in ``environ``, and its text."""
        for name in self.env:
            if environ.get(name):
                return name, environ[name]
        return None

    def __repr__(self) -> str:
        return f"Setting({self.name!r}, env={self.env!r}, default={self.default_value()!r})"


_AZURE = "Azure (the account is not part of az:// URIs; Run:ai's reader reads these variables too): "


class Settings:
    """The settings in force: ``Settings()`` reads the environment, ``Settings(field=value, ...)``
    with those fields replaced (validated alike); read-only. :attr:`given` names the fields that
    were set. ``Settings.<field>`` is the field's row (``Settings.force_pull.env``).
    docs/configuration.md is the reference for operators."""

    cache_dir: Path = Setting(default_cache_dir, path, "root of the metadata cache (one dir per URI hash)")
    shm_dir: Path = Setting(Path("/dev/shm"), path, "where shared-memory segments live (a rank: unset, where the daemon says)")
    shm_budget: int = Setting(4 * GiB, budget, "most bytes of tensor buffers in use at once (plus one oversized tensor)")
    slot_size: int = Setting(256 * MiB, byte_size(gt=0), "one buffer slot; larger tensors get their own allocation")
    socket: Path | str | None = Setting(
        None, optional(socket_address), "the node daemon's unix socket or tcp://127.0.0.1:PORT (unset: DEFAULT_SOCKET)"
    )
    launch_id: str | None = Setting(None, optional(text), "explicit launch id (docs/metadata-cache.md)")
    torchelastic_run_id: str | None = Setting(
        None, optional(run_id), "torchrun's run id: the launch id when STREAMER_LAUNCH_ID is unset", env="TORCHELASTIC_RUN_ID"
    )
    force_pull: bool = Setting(
        False,
        flag,
        "re-pull metadata once per launch even when the cache is complete",
        env=("TRTLLM_OBJECT_STORAGE_FORCE_PULL", "STREAMER_FORCE_PULL"),
    )
    lock_timeout_s: float = Setting(1800.0, number(gt=0), "how long a puller waits for another process's pull of the same URI")
    lock_log_interval_s: float = Setting(5.0, number(gt=0), "how often a waiting puller logs that it is still waiting")
    storage_retries: int = Setting(
        3, integer(ge=0, le=20), "retries of one failed storage request (listing, metadata, header, Run:ai S3 reads)"
    )
    storage_connect_timeout_s: float = Setting(5.0, number(gt=0), "connect timeout of one storage request")
    storage_read_timeout_s: float = Setting(60.0, number(gt=0), "read timeout of one storage request")
    storage_retry_deadline_s: float = Setting(
        60.0, number(gt=0), "GCS: total time one request may spend retrying; Run:ai S3: its retry window"
    )
    s3_addressing_style: str = Setting(
        "auto", choice("auto", "path", "virtual"), "boto3's S3 addressing style; path for most S3-compatible servers"
    )
    target_gbps: int = Setting(
        100,
        integer(ge=1, le=10_000),
        "the node NIC's rate, Gbit/s: Run:ai's read parallelism and the bytes a load keeps in flight",
    )
    obj_concurrency: int | None = Setting(
        None, optional(integer(ge=1, le=1024)), "object-storage clients Run:ai reads with at once (Run:ai: 8)"
    )
    s3_target_gbps: int | None = Setting(
        None, optional(integer(ge=1, le=10_000)), "throughput target of each S3 client, Gbit/s (the AWS CRT: 10)"
    )
    read_chunk_size: int | None = Setting(
        None, optional(byte_size(ge=5 * MiB, le=GiB)), "bytes one Run:ai read request asks for (Run:ai: 8 MiB)"
    )
    local_reader: str = Setting(
        "mapped", choice("mapped", "runai"), "how the daemon and CUDA loads read local files: mapped (native copier) or runai"
    )
    pin_segments: str = Setting(
        "auto",
        choice("auto", "always", "never"),
        "a CUDA rank: page-lock the daemon's segments (always), stage them through a small pinned ring (never), or stage what the daemon serves from memory and a process's first load of small-page segments that are not a ring of recycled slots, and pin the rest (auto)",
    )
    azure_storage_connection_string: Secret | None = Setting(
        None, optional(secret), _AZURE + "connection string", env="AZURE_STORAGE_CONNECTION_STRING"
    )
    azure_storage_account_name: str | None = Setting(
        None, optional(text), _AZURE + "account name", env="AZURE_STORAGE_ACCOUNT_NAME"
    )
    azure_storage_account_key: Secret | None = Setting(
        None, optional(secret), _AZURE + "shared key", env="AZURE_STORAGE_ACCOUNT_KEY"
    )
    azure_storage_sas_token: Secret | None = Setting(None, optional(secret), _AZURE + "SAS token", env="AZURE_STORAGE_SAS_TOKEN")
    azure_storage_endpoint_suffix: str = Setting(
        "blob.core.windows.net", text, _AZURE + "blob host suffix", env="AZURE_STORAGE_ENDPOINT_SUFFIX"
    )
    group_access: bool = Setting(False, flag, "socket 0660 and segments 0640 instead of 0600 (serve --group-access)")
    tcp_port: int | None = Setting(
        None, optional(integer(ge=1, le=65535)), "also serve on 127.0.0.1:PORT; requires STREAMER_TOKEN"
    )
    token: Secret | None = Setting(
        None, optional(secret), "bearer token of the TCP listener (the daemon requires it, a rank sends it)"
    )
    metrics_port: int | None = Setting(
        None, optional(integer(ge=1, le=65535)), "serve GET /metrics and /healthz on this port (unset: off)"
    )
    metrics_host: str = Setting("0.0.0.0", text, "address the metrics listener binds")
    build_revision: str = Setting("unknown", text, "source revision the image was built from (streamer_build_info)")
    allow: tuple[str, ...] = Setting((), words, "URI prefixes the daemon may read (empty: any URI)")
    metadata_patterns: tuple[str, ...] = Setting((), words, "more file-name patterns to pull into the metadata cache")
    metadata_max_file_bytes: int = Setting(256 * MiB, byte_size(gt=0), "largest single file a metadata pull accepts")
    metadata_max_total_bytes: int = Setting(GiB, byte_size(gt=0), "most bytes one metadata pull downloads in total")
    retention_budget: int = Setting(0, byte_size(), "shared memory the daemon keeps checkpoints in after their load (0: off)")
    segment_idle_s: float = Setting(
        30.0, number(ge=0), "how long the daemon keeps an unused segment for the next load (0: never)"
    )
    segment_prepare: bool = Setting(
        True,
        flag,
        "make the first load's ring segments when the daemon starts, and keep them (and the last load's oversized tensor's) between loads",
    )
    join_timeout_s: float = Setting(300.0, number(gt=0), "how long the ranks of a session have to join")
    rank_timeout_s: float = Setting(30.0, number(gt=0), "a rank silent this long is reclaimed")
    stop_grace_s: float = Setting(
        10.0, number(ge=0), "how long a stopping daemon waits for its ranks to hear that it stops before it stops serving"
    )
    log_level: str = Setting("INFO", level_name, "least severe level logged")
    log_format: str = Setting("text", choice("text", "json"), "text: one readable line; json: one JSON object per line")
    progress: str = Setting("auto", choice(*PROGRESS_MODES), "progress bars on stderr: auto (on a terminal), on, off")
    connect_timeout_s: float = Setting(5.0, number(gt=0), "a rank's connect timeout to the daemon")
    require_daemon: bool = Setting(False, flag, "a rank with no daemon raises DaemonError instead of loading in-process")

    def __init__(self, **overrides: Any) -> None:
        values, given = _read(os.environ, overrides, None)
        _fill(self, values, given)

    @classmethod
    def from_values(cls, values: Mapping[str, Any], given: Iterable[str]) -> "Settings":
        """Settings of values a reader parsed already (the service's pydantic-settings model)."""
        missing = set(NAMES) - set(values)
        if missing:
            raise TypeError(f"Settings.from_values: no value for {sorted(missing)}")
        settings = object.__new__(cls)
        _fill(settings, {name: values[name] for name in NAMES}, frozenset(given))
        return settings

    @property
    def given(self) -> frozenset[str]:
        """The fields read from the environment or passed as arguments (the others are defaults)."""
        return self._given  # type: ignore[attr-defined]

    def if_given(self, name: str) -> Any:
        """Field ``name`` where it was set, else None: a rank leaves what it did not set to the
        daemon (``force_pull``, ``shm_dir``)."""
        return getattr(self, name) if name in self.given else None

    def replace(self, **changes: Any) -> "Settings":
        """A copy with ``changes`` (parsed as arguments are, and counted as given)."""
        parsed, given = _read({}, changes, None)
        values = {name: parsed[name] if name in changes else getattr(self, name) for name in NAMES}
        return Settings.from_values(values, self.given | given)

    def to_json(self) -> str:
        """The values as one JSON object (paths as text, secrets as ``**********``), for logs."""

        def plain(value: Any) -> Any:
            if isinstance(value, (Path, Secret)):
                return str(value)
            return list(value) if isinstance(value, tuple) else value

        return json.dumps({name: plain(getattr(self, name)) for name in NAMES})

    # Written out rather than a frozen dataclass: generating the dataclass methods of 44 fields
    # was most of this module's import time, which every rank process pays.
    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"Settings are read-only: use settings.replace({name}=...)")

    def __delattr__(self, name: str) -> None:
        raise AttributeError("Settings are read-only")

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return all(getattr(self, name) == getattr(other, name) for name in NAMES)

    def __hash__(self) -> int:
        return hash(tuple(getattr(self, name) for name in NAMES))

    def __repr__(self) -> str:
        return f"Settings({', '.join(f'{name}={getattr(self, name)!r}' for name in NAMES)})"


def _fill(settings: Settings, values: Mapping[str, Any], given: frozenset[str]) -> None:
    for name, value in values.items():
        object.__setattr__(settings, name, value)
    object.__setattr__(settings, "_given", given)


def _rows(cls: type) -> tuple[Setting, ...]:
    rows = []
    for name, annotation in cls.__annotations__.items():
        row = cls.__dict__[name]
        row.name, row.type = name, annotation
        row.env = row.env or (f"STREAMER_{name.upper()}",)
        rows.append(row)
    return tuple(rows)


SETTINGS: tuple[Setting, ...] = _rows(Settings)
"""The table: the rows of :class:`Settings`, in declaration order."""

NAMES = tuple(row.name for row in SETTINGS)
_ROWS = {row.name: row for row in SETTINGS}


def check_names(overrides: Mapping[str, Any]) -> None:
    unknown = sorted(set(overrides) - set(_ROWS))
    if unknown:
        raise TypeError(f"no such setting: {', '.join(unknown)}")


def problem(row: Setting, raw: Any, message: str, *, environ: Mapping[str, str], arguments: Mapping[str, str] | None,
            passed: bool) -> str:  # fmt: skip
    """One refused value as both readers say it: the variable it came from (or the argument it
    was passed as: ``invalid argument: budget='lots': ...``), the value, what was expected."""
    if passed and arguments is not None:
        return f"invalid argument: {arguments.get(row.name, row.name)}={raw!r}: {message}"
    found = None if passed else row.lookup(environ)
    return f"{found[0] if found else row.env[0]}={raw!r}: {message}"


def _read(environ: Mapping[str, str], overrides: Mapping[str, Any], arguments: Mapping[str, str] | None):
    check_names(overrides)
    values: dict[str, Any] = {}
    given: set[str] = set()
    problems: list[str] = []
    for row in SETTINGS:
        passed = row.name in overrides
        found = None if passed else row.lookup(environ)
        if not passed and found is None:
            values[row.name] = row.default_value()
            continue
        raw = overrides[row.name] if passed else found[1]
        try:
            values[row.name] = row.parse(raw)
        except ValueError as exc:
            problems.append(problem(row, raw, str(exc), environ=environ, arguments=arguments, passed=passed))
        given.add(row.name)
    if problems:
        raise SettingsError("; ".join(problems))
    return values, frozenset(given)


def parse_argument(name: str, value: Any, argument: str) -> Any:
    """One setting passed as the argument ``argument`` (e.g. ``budget=``), parsed by its row;
    :class:`SettingsError` ``invalid argument: budget='lots': ...`` when refused."""
    row = _ROWS[name]
    try:
        return row.parse(value)
    except ValueError as exc:
        raise SettingsError(problem(row, value, str(exc), environ={}, arguments={name: argument}, passed=True)) from None


def read_settings(overrides: Mapping[str, Any] | None = None, *, arguments: Mapping[str, str] | None = None) -> Settings:
    """The environment's settings with ``overrides`` on top. With ``arguments`` (field → the
    argument's public name), a bad override is named as that argument, else as its variable."""
    values, given = _read(os.environ, dict(overrides or {}), arguments)
    return Settings.from_values(values, given)
