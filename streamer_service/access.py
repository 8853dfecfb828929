"""Who may reach what the daemon holds, and what the daemon may read for them.

- The access mode: the daemon's socket, segments and metadata cache are its own user's
  (``0600``, dirs ``0700``), or also its group's with ``--group-access`` (``0640``, dirs
  ``0750``, socket ``0660``). Nothing it writes is more permissive than that.
- The ``--allow`` prefixes: a URI outside them gets one refusal, the same status and text
  whatever the path is (missing, a file, unreadable, a dir), decided from the URI's text before
  any filesystem call on it; a local path inside them is then resolved, and refused the same
  way when its links lead out.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from streamer_client.errors import ConfigError, StorageAccessDeniedError

from .settings import Settings
from .uri import Scheme, StorageURI, parse_uri

__all__ = ["AllowList", "check_shared_access", "dir_mode", "file_mode", "socket_mode"]


def file_mode(settings: Settings) -> int:
    """Mode of the files the daemon writes (segments, cached metadata)."""
    return 0o640 if settings.group_access else 0o600


def dir_mode(settings: Settings) -> int:
    """Mode of the dirs the daemon makes for what it writes (a cache dir and the dirs inside it)."""
    return 0o750 if settings.group_access else 0o700


def socket_mode(settings: Settings) -> int:
    return 0o660 if settings.group_access else 0o600


def check_shared_access(settings: Settings) -> None:
    """A daemon other users can ask (its group, or local processes with the token over TCP) reads
    only what ``--allow`` names: without it, any of them could have it read any path it can."""
    if settings.allow:
        return
    who = (
        "--group-access lets every member of the daemon's group"
        if settings.group_access
        else ("--tcp-port lets every local process that has the token")
    )
    if settings.group_access or settings.tcp_port is not None:
        raise ConfigError(
            f"{who} make this daemon read any path or URI it can; give the prefixes it may read with "
            "--allow / STREAMER_ALLOW (local dirs are readable only under a local prefix given there)"
        )


def _under(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix.rstrip("/") + "/")


class AllowList:
    """The ``--allow`` prefixes (none: any URI). Built from the operator's own settings: a local
    prefix is resolved once, here, and also kept as written (a link the operator named)."""

    def __init__(self, prefixes: Iterable[str]) -> None:
        self.written: list[str] = []  # what a request's text is compared with
        self.resolved: list[str] = []  # where a local request must still be once resolved
        schemes: set[Scheme] = set()
        for prefix in prefixes:
            parsed = parse_uri(prefix)
            self.written.append(parse_uri(prefix, resolve=False).normalized)
            schemes.add(parsed.scheme)
            if parsed.is_local:
                self.written.append(parsed.normalized)
                self.resolved.append(parsed.normalized)
        self.any = not self.written
        # The object stores a request may name: those of the prefixes, or all of them.
        self.cloud_schemes = frozenset((set(Scheme) if self.any else schemes) - {Scheme.LOCAL})

    def refusal(self, uri: str) -> StorageAccessDeniedError:
        """The one answer for every URI outside the prefixes."""
        return StorageAccessDeniedError(f"this daemon may not read {uri}: not under any --allow prefix", uri=uri)

    def check(self, uri: str) -> StorageURI:
        """``uri`` parsed, or the refusal. Its syntax is checked first (``InvalidURIError``, no
        filesystem call either); a local path is looked at only once its text is inside a prefix."""
        text = parse_uri(uri, resolve=False)
        if self.any:
            return parse_uri(uri)
        if not any(_under(text.normalized, prefix) for prefix in self.written):
            raise self.refusal(uri)
        if not text.is_local:
            return text
        if not any(_under(os.path.realpath(text.prefix), top) for top in self.resolved):
            raise self.refusal(uri)  # a link inside a prefix that leads out of them
        parsed = parse_uri(uri)  # now the filesystem: does it exist, is it a dir
        if not any(_under(parsed.normalized, top) for top in self.resolved):
            raise self.refusal(uri)  # a link changed since the check above
        return parsed
