"""The ``streamer-service`` command line."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from streamer_client.errors import ConfigError, InvalidURIError, SettingsError, StreamerError

from . import logs
from .settings import DEFAULT_SOCKET, Settings, get_settings, read_settings

log = logging.getLogger("streamer_service")

# docs/daemon.md, "Exit codes", is the table of these.
EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def _settings(args: argparse.Namespace) -> Settings:
    """The environment's settings with this command's flags on top, validated alike."""
    update = {}
    for field in ("cache_dir", "shm_dir", "socket", "shm_budget", "retention_budget", "allow", "tcp_port", "group_access",
                  "metrics_port", "metrics_host", "target_gbps"):  # fmt: skip
        value = getattr(args, field, None)
        # `is`, not `in`: a flag of 0 (`--tcp-port 0`) is a value to validate, not an absent flag.
        if value is not None and value is not False and value != []:
            update[field] = value
    return read_settings(update) if update else get_settings()


def cmd_pull(args: argparse.Namespace) -> int:
    from streamer_client._launch import resolve_launch_id

    from .metadata.cache import MetadataCache

    settings = _settings(args)
    # A CLI invocation is its own launch unless one is configured: `pull --force`
    # typed twice in one shell re-downloads twice (docs/metadata-cache.md).
    launch = resolve_launch_id(settings, args.launch_id, fallback=f"cli-{os.getpid()}")
    path = MetadataCache(settings, progress=logs.progress_mode(args.progress)).pull(
        args.uri, force=True if args.force else None, launch_id=launch
    )
    print(path)
    return EXIT_OK


def cmd_inspect(args: argparse.Namespace) -> int:
    from .checkpoint.open import open_checkpoint
    from .checkpoint.tensor_table import format_jsonl, format_table

    checkpoint = open_checkpoint(args.uri, _settings(args))
    text = format_jsonl(checkpoint.catalog) if args.json else format_table(checkpoint.catalog)
    sys.stdout.write(text if text.endswith("\n") else text + "\n")
    return EXIT_OK


def cmd_serve(args: argparse.Namespace) -> int:
    from .daemon.server import serve

    try:
        settings = _settings(args)
    except SettingsError as exc:
        return _startup_error(args, str(exc), exc)
    try:
        return serve(settings, args.stops)
    except (ConfigError, InvalidURIError) as exc:
        # Refused before anything was bound or served (server.check_startup, bind_unix_socket).
        return _startup_error(args, str(exc), exc)


def _startup_error(args: argparse.Namespace, message: str, exc: BaseException) -> int:
    """A refused start: one line and exit 2, nothing served (docs/daemon.md, "Exit codes")."""
    json_lines = (args.log_format or get_settings().log_format) == "json"
    return _error(f"streamer-service serve: error: {message}", EXIT_USAGE, json_lines=json_lines, command="serve", exc=exc)


def cmd_health(args: argparse.Namespace) -> int:
    # A probe runs every few seconds in every pod: the client's connection alone, no torch import.
    # Cheaper still for kubelet: an httpGet probe on the metrics listener's /healthz (docs/deploy.md).
    from streamer_client._connection import DaemonClient
    from streamer_client.errors import DaemonError

    settings = _settings(args)
    path = Path(settings.socket) if settings.socket else DEFAULT_SOCKET
    route = "/readyz" if args.ready else "/healthz"

    def unhealthy(message: str, **fields) -> int:
        if args.json:
            print(json.dumps({"status": "unavailable", "socket": str(path), "error": message, **fields}))
        json_lines = (args.log_format or settings.log_format) == "json"
        return _error(f"streamer-service health: error: {message}", EXIT_ERROR, json_lines=json_lines, command="health")

    client = DaemonClient(path, connect_timeout_s=5.0)
    try:
        status, body = client.get(route)
    except DaemonError as exc:
        return unhealthy(f"no daemon answers at {path}: {exc}")
    finally:
        client.close()
    if status != 200:
        reasons = body.get("reasons", []) if isinstance(body, dict) else []
        why = f": {'; '.join(reasons)}" if reasons else ""
        return unhealthy(f"{route} answered {status}{why}", http_status=status, **({"reasons": reasons} if reasons else {}))
    print(json.dumps({**body, "socket": str(path)}) if args.json else body.get("status"))
    return EXIT_OK


class _Version(argparse.Action):
    """``--version``: our versions and Run:ai's, looked up only when asked (no import at parse time)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None) -> None:  # noqa: A002
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        from .daemon.metrics import build_info

        try:
            revision = get_settings().build_revision
        except SettingsError:  # --version answers even where a STREAMER_* variable is bad
            revision = "unknown"
        info = build_info(revision)
        print(
            f"streamer-service {info['version']} (streamer-client {info['client_version']}, "
            f"runai-model-streamer {info['runai_version']}, Python {info['python_version']}, revision {info['revision']})"
        )
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="streamer-service",
        description="Object-storage checkpoint streaming with node-local shared-memory fan-out.",
    )
    parser.add_argument(
        "--version", action=_Version, help="print the versions of streamer-service, its client and Run:ai, and exit"
    )
    parser.add_argument("--log-level", help="DEBUG, INFO (default), WARNING, ERROR (STREAMER_LOG_LEVEL)")
    parser.add_argument("--log-format", choices=["text", "json"], help="text (default) or json lines (STREAMER_LOG_FORMAT)")
    bars = parser.add_mutually_exclusive_group()
    bars.add_argument(
        "--progress",
        action="store_const",
        const="on",
        dest="progress",
        help="draw progress bars on stderr even when it is not a terminal (STREAMER_PROGRESS=on)",
    )
    bars.add_argument(
        "--no-progress",
        action="store_const",
        const="off",
        dest="progress",
        help="no progress bars (STREAMER_PROGRESS=off); default: only on a terminal",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    pull = sub.add_parser("pull", help="pull a checkpoint's config, tokenizer and code into the node cache")
    pull.add_argument("uri", help="s3://bucket/prefix, gs://bucket/prefix, az://container/prefix or a local dir")
    pull.add_argument("--cache-dir", help="cache root (STREAMER_CACHE_DIR)")
    pull.add_argument("--force", action="store_true", help="re-pull once per launch (TRTLLM_OBJECT_STORAGE_FORCE_PULL)")
    pull.add_argument("--launch-id", help="launch id for --force (STREAMER_LAUNCH_ID); default: this invocation")
    pull.set_defaults(run=cmd_pull)

    inspect = sub.add_parser("inspect", help="print the tensor table of a checkpoint")
    inspect.add_argument("uri", help="s3://bucket/prefix, gs://bucket/prefix, az://container/prefix or a local dir")
    inspect.add_argument("--json", action="store_true", help="one JSON object per tensor instead of a table")
    inspect.add_argument("--cache-dir", help="cache root (STREAMER_CACHE_DIR)")
    inspect.set_defaults(run=cmd_inspect)

    serve = sub.add_parser("serve", help="run the node daemon")
    serve.add_argument("--socket", help="unix socket to serve on (STREAMER_SOCKET)")
    serve.add_argument("--cache-dir", help="metadata cache root (STREAMER_CACHE_DIR)")
    serve.add_argument("--shm-dir", help="shared-memory dir shared with the ranks (STREAMER_SHM_DIR)")
    serve.add_argument("--shm-budget", help="most shared memory in use, e.g. 16GiB (STREAMER_SHM_BUDGET)")
    serve.add_argument(
        "--retention-budget",
        help="shared memory kept for reloads after a load, e.g. 64GiB (STREAMER_RETENTION_BUDGET; default 0: off)",
    )
    serve.add_argument(
        "--target-gbps",
        type=int,
        metavar="GBITS",
        help="the node NIC's rate: Run:ai's read parallelism and the bytes in flight (STREAMER_TARGET_GBPS; default 100)",
    )
    serve.add_argument(
        "--allow",
        action="append",
        default=[],
        metavar="PREFIX",
        help="URI prefix the daemon may read (repeatable; STREAMER_ALLOW, commas or spaces between prefixes); "
        "required with --group-access or --tcp-port",
    )
    serve.add_argument("--group-access", action="store_true", help="socket 0660 and segments 0640 (STREAMER_GROUP_ACCESS)")
    serve.add_argument("--tcp-port", type=int, help="also listen on 127.0.0.1:PORT; needs STREAMER_TOKEN (STREAMER_TCP_PORT)")
    serve.add_argument(
        "--metrics-port",
        type=int,
        metavar="PORT",
        help="serve read-only /metrics and /healthz on PORT for Prometheus and probes (STREAMER_METRICS_PORT; default: off)",
    )
    serve.add_argument(
        "--metrics-host", metavar="ADDR", help="address of the metrics listener (STREAMER_METRICS_HOST; default 0.0.0.0)"
    )
    serve.set_defaults(run=cmd_serve)

    health = sub.add_parser("health", help="ask the daemon whether it is up (exit 0) or ready (--ready)")
    health.add_argument("--socket", help=f"the daemon's unix socket (STREAMER_SOCKET; default {DEFAULT_SOCKET})")
    health.add_argument(
        "--ready", action="store_true", help="ask /readyz (the daemon takes sessions) instead of /healthz (it is up)"
    )
    health.add_argument("--json", action="store_true", help="print the daemon's whole answer as one JSON object")
    health.set_defaults(run=cmd_health)

    demo = sub.add_parser("demo", help="the main job on a sample checkpoint (no cloud needed)")
    from . import demo as demo_module

    demo_module.add_arguments(demo)
    demo.set_defaults(run=demo_module.run)

    bench = sub.add_parser("bench", help="side-by-side benchmark: plain Run:ai, the daemon, embedded, download + load")
    from . import bench as bench_module

    bench_module.add_arguments(bench)
    bench.set_defaults(run=bench_module.run)
    return parser


def _json_requested(argv: Sequence[str]) -> bool:
    """``--log-format json`` on the command line, else ``STREAMER_LOG_FORMAT=json``: known before the
    arguments parse, so that even a usage error comes out as a JSON line."""
    argv = list(argv)
    for i, word in enumerate(argv):
        if word == "--log-format" and i + 1 < len(argv):
            return argv[i + 1] == "json"
        if word.startswith("--log-format="):
            return word.partition("=")[2] == "json"
    try:
        return get_settings().log_format == "json"
    except Exception:  # noqa: BLE001 - a bad variable is reported later, as a usage error
        return False


def _error(message: str, code: int, *, json_lines: bool, command: str | None, exc: BaseException | None = None) -> int:
    """Report an error that ends the command on stderr, as text or as one JSON line (docs/daemon.md, "Exit codes")."""
    if not json_lines:
        print(message, file=sys.stderr)
        return code
    record = logging.LogRecord("streamer_service.cli", logging.ERROR, __file__, 0, message, None, None)
    record.command = command
    record.exit_code = code
    if exc is not None:
        record.error = type(exc).__name__
        record.uri = getattr(exc, "uri", None)
        record.key = getattr(exc, "key", None)
    print(logs.JsonFormatter().format(record), file=sys.stderr)
    return code


class _Parser(argparse.ArgumentParser):
    argv: Sequence[str] = ()  # set by main() before parsing; subcommand parsers are of this class too

    def error(self, message: str):  # argparse: usage errors exit 2
        if not _json_requested(_Parser.argv):
            super().error(message)
        self.exit(_error(f"{self.prog}: error: {message}", EXIT_USAGE, json_lines=True, command=None))


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    _Parser.argv = argv
    args = build_parser().parse_args(argv)
    if args.command != "serve":
        return _run(args)
    from .daemon.stop_signals import StopSignals

    # Before anything heavy is imported: a stop that comes while the daemon starts is kept, not lost.
    with StopSignals() as args.stops:
        code = _run(args)
    if args.stops.exit_at_once:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _run(args: argparse.Namespace) -> int:
    try:
        settings = get_settings()
        level = (args.log_level or settings.log_level).upper()
        if not isinstance(logging.getLevelName(level), int):  # --log-level is not validated by Settings
            raise ValueError(f"unknown log level {level!r}")
        fmt = args.log_format or settings.log_format
    except SettingsError as exc:  # a bad STREAMER_* variable is a usage error, named as set
        return _error(f"streamer-service {args.command}: error: {exc}", EXIT_USAGE,
                      json_lines=args.log_format == "json", command=args.command, exc=exc)  # fmt: skip
    except ValueError as exc:
        return _error(f"streamer-service {args.command}: error: {exc}", EXIT_USAGE, json_lines=args.log_format == "json",
                      command=args.command, exc=exc)  # fmt: skip
    logs.configure(level, fmt)
    json_lines = fmt == "json"
    try:
        return args.run(args)
    except SettingsError as exc:  # a bad flag value: a usage error, like a bad variable
        return _error(
            f"streamer-service {args.command}: error: {exc}", EXIT_USAGE, json_lines=json_lines, command=args.command, exc=exc
        )
    except StreamerError as exc:
        return _error(
            f"streamer-service {args.command}: error: {exc}", EXIT_ERROR, json_lines=json_lines, command=args.command, exc=exc
        )
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
